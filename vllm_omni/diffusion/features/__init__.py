"""What a stage adds to its pipeline: previews, SDE, step cache, quantization, GGUF, sleep, weights."""
