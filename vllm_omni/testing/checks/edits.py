"""Image inputs for checks against the stock diffusers variants (tests/entrypoints/test_omni_edits.py, the edits
server tests, benchmarks/bench_serving.py --task edit)."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from PIL import Image


def noise_image(seed: int, size: int = 64) -> Image.Image:
    """A reproducible RGB image of uniform noise."""
    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


def square_mask(size: int = 64) -> Image.Image:
    """A diffusers mask (white: repaint) of the centre square."""
    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    return mask


def stock_edit(
    model: str, prompt: str, image: Image.Image, seed: int, strength: float, mask: Image.Image | None = None, **kwargs
) -> np.ndarray:
    """The stock image-to-image (or, with ``mask``, inpainting) variant of ``model``'s text-to-image pipeline, built
    with ``from_pipe`` and called alone: its image as float RGB in [0, 1]."""
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    from vllm_omni.testing.checks.stock import stock_pipeline

    pipeline = (AutoPipelineForImage2Image if mask is None else AutoPipelineForInpainting).from_pipe(
        stock_pipeline(model)
    )
    pipeline.set_progress_bar_config(disable=True)
    if mask is not None:
        kwargs["mask_image"] = mask
    if "height" in inspect.signature(pipeline.__call__).parameters:
        kwargs.update(height=image.height, width=image.width)
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipeline(
        prompt=prompt, image=image, strength=strength, generator=generator, output_type="np", **kwargs
    ).images[0]
