"""The stock diffusers pipelines that the tests and checks compare against, loaded once per folder.

A stock call leaves its pipeline as it found it (each call sets its scheduler's timesteps anew), so one loaded
pipeline serves every reference image of a run; a caller that changes a pipeline (adapters, hooks, VAE tiling)
loads its own.
"""

from __future__ import annotations

import functools


@functools.cache
def stock_pipeline(model: str):
    """``DiffusionPipeline.from_pretrained(model)`` from local files, progress bar off; the same object each time."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
