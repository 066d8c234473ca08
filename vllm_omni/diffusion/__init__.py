"""One diffusers stage replica: its engine loop (orchestrator/), the pipeline it runs (pipeline/), per-family facts and
steppers (families/), LoRA (lora/), several ranks (parallel/) and the features a call adds (features/)."""
