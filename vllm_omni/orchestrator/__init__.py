"""The orchestration across stages: `AsyncOmniEngine` routes requests to one `StageRuntime` per stage, whose replicas
run inline or as Ray actors (each replica steps one `vllm_omni.diffusion.engine` loop, or an llm stage's vLLM)."""
