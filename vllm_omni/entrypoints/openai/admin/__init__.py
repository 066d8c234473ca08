"""The operator's routes: health, metrics, served models and LoRA, sleep, profiling, playground."""
