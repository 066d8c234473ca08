"""The tiny SD3 and SDXL pipelines: saved folders load through ``DiffusionPipeline.from_pretrained`` and generate."""

import numpy as np
import pytest
import torch


def _generate(pipe, seed: int) -> np.ndarray:
    image = pipe(
        "a photo of a cat riding a horse",
        num_inference_steps=2,
        height=64,
        width=64,
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    assert image.size == (64, 64)
    return np.asarray(image)


@pytest.mark.parametrize(
    ("fixture", "pipeline_class"),
    [("tiny_sd3", "StableDiffusion3Pipeline"), ("tiny_sdxl", "StableDiffusionXLPipeline")],
)
def test_tiny_pipeline_loads_and_generates(request, fixture, pipeline_class):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(request.getfixturevalue(fixture), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == pipeline_class
    assert pipe.default_sample_size * pipe.vae_scale_factor == 64

    first = _generate(pipe, seed=0)
    assert first.shape == (64, 64, 3)
    assert first.std() > 1.0, "the image is (nearly) constant"
    assert np.array_equal(first, _generate(pipe, seed=0)), "the same seed gave a different image"
    assert not np.array_equal(first, _generate(pipe, seed=1)), "two seeds gave the same image"
