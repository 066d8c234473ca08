"""A request's input images as a pipeline takes them: at the request's output size, resized the way diffusers'
image processor resizes (Lanczos), so that request mode, step mode and split stages see the same pixels."""

from __future__ import annotations

from PIL import Image

from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def fit(image: Image.Image, width: int, height: int, mode: str = "RGB") -> Image.Image:
    """``image`` in ``mode`` at ``width × height`` (unchanged when it already is)."""
    image = image if image.mode == mode else image.convert(mode)
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.LANCZOS)


def fitted_inputs(params: OmniDiffusionSamplingParams) -> tuple[list[Image.Image], Image.Image | None]:
    """The request's input images (RGB) and mask (L) at its output size; complete ``params`` with an image."""
    width, height = params.width, params.height
    assert params.image is not None and width is not None and height is not None, "incomplete params"
    images = [fit(image, width, height) for image in params.image]
    mask = None if params.mask_image is None else fit(params.mask_image, width, height, "L")
    return images, mask
