"""Diffusion engine core: requests, the batching scheduler, the pipeline runner and the engine loop."""
