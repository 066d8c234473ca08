"""LLM stages on vLLM's own engine: the replica actor (`actor.py`); its driver side is
`vllm_omni.orchestrator.llm_replicas`."""
