"""The tiny pipelines: saved folders load through ``DiffusionPipeline.from_pretrained`` and generate; the edit and
image-to-video ones use their input image."""

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


def _flat_image(rgb: tuple[int, int, int]):
    """A flat 64x64 colour: two of them differ in their mean, which even the random models' attention carries."""
    from PIL import Image

    return Image.new("RGB", (64, 64), rgb)


RED, BLUE, GREEN = _flat_image((200, 30, 30)), _flat_image((30, 30, 200)), _flat_image((30, 200, 30))

# Output size of each family's call: Kontext makes `max_area` pixels (default 1024**2) and, unless `_auto_resize` is
# off, first resizes the input image to ~1024x1024 px; the Qwen pipelines encode the input at ~1024x1024 px anyway.
EDIT_CASES = [
    ("tiny_kontext", "FluxKontextPipeline", {"max_area": 64 * 64, "_auto_resize": False}, (1, 64, 64, 3)),
    # The Qwen pipelines encode the input at ~1024x1024 px: seconds each.
    pytest.param("tiny_qwen_edit", "QwenImageEditPipeline", {}, (1, 64, 64, 3), marks=pytest.mark.slow),
    pytest.param("tiny_qwen_edit_plus", "QwenImageEditPlusPipeline", {}, (1, 64, 64, 3), marks=pytest.mark.slow),
    ("tiny_wan_i2v", "WanImageToVideoPipeline", {"height": 32, "width": 32, "num_frames": 5}, (1, 5, 32, 32, 3)),
]


def _edit(pipe, image, size: dict) -> np.ndarray:
    out = pipe(
        prompt="a photo of a cat riding a horse",
        image=image,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator("cpu").manual_seed(0),
        **{"height": 64, "width": 64, **size},
    )
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


def _load(path: str, pipeline_class: str):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe).__name__ == pipeline_class
    return pipe


@pytest.mark.parametrize(("fixture", "pipeline_class", "size", "shape"), EDIT_CASES)
def test_tiny_image_conditioned_pipeline_loads_and_uses_its_input_image(request, fixture, pipeline_class, size, shape):
    pipe = _load(request.getfixturevalue(fixture), pipeline_class)

    red = _edit(pipe, RED, size)
    assert red.shape == shape
    assert np.isfinite(red).all()
    # The random models barely use the image (Qwen: ~1e-4 of the [0, 1] range), but a call is deterministic.
    assert not np.array_equal(red, _edit(pipe, BLUE, size)), "two input images gave the same output"


@pytest.mark.slow
def test_tiny_qwen_edit_plus_uses_a_second_input_image(tiny_qwen_edit_plus):
    pipe = _load(tiny_qwen_edit_plus, "QwenImageEditPlusPipeline")

    both = _edit(pipe, [RED, BLUE], {})  # one prompt, two images ("Picture 1: ... Picture 2: ...")
    assert both.shape == (1, 64, 64, 3)
    assert not np.array_equal(both, _edit(pipe, [RED, GREEN], {})), "the second image made no difference"
