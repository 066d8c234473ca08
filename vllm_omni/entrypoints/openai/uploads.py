"""Input images of multipart requests (``/v1/images/edits``, a video's ``input_reference``): hostile until checked.

A file is refused, with a 400 naming its field, when it is larger than ``--max-input-image-bytes``, is not a PNG,
JPEG or WebP image, or its header declares more than ``--max-input-image-pixels``; the pixel check reads only the
header, so a decompression bomb is refused without being decoded. Decoding runs off the event loop.
"""

from __future__ import annotations

import asyncio
import io
import warnings

from PIL import Image, UnidentifiedImageError
from starlette.datastructures import FormData, UploadFile

from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.sampling_params import MAX_INPUT_IMAGES

FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp"}
"""Image formats an upload may have (Pillow's names → the API's)."""

UPLOAD_PATHS = ("/v1/images/edits", "/v1/videos", "/v1/videos/sync", "/v1/chat/completions")
"""Routes whose bodies carry image files (chat completions: as data URLs): their body limit has room for them
(`upload_body_limit`)."""


def upload_body_limit(serving: ServingConfig) -> int:
    """The body limit of the routes in `UPLOAD_PATHS`: the largest files they take, plus the usual fields."""
    return serving.max_request_body_bytes + (MAX_INPUT_IMAGES + 1) * serving.max_input_image_bytes


def form_files(form: FormData, *names: str) -> list[UploadFile]:
    """The files sent under any of ``names`` (``image`` and ``image[]``); a text value there is refused."""
    files = []
    for name in names:
        for value in form.getlist(name):
            if not isinstance(value, UploadFile):
                param = name.removesuffix("[]")  # image[] is the API's image field, as a list
                raise APIError(400, f"{name} must be a file (multipart/form-data)", param=param, code="invalid_value")
            files.append(value)
    return files


async def read_images(files: list[UploadFile], param: str, serving: ServingConfig) -> list[Image.Image]:
    """The decoded images of ``files`` (each checked, see the module docstring)."""
    contents = []
    for upload in files:
        if upload.size is not None and upload.size > serving.max_input_image_bytes:
            raise _too_large(param, upload.size, serving)
        contents.append(await upload.read())
    return await asyncio.to_thread(lambda: [decode_image(data, param, serving) for data in contents])


def decode_image(data: bytes, param: str, serving: ServingConfig) -> Image.Image:
    """One checked, decoded image (runs in a worker thread)."""
    if len(data) > serving.max_input_image_bytes:
        raise _too_large(param, len(data), serving)
    allowed = ", ".join(FORMATS.values())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit is checked below
            image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise _too_many_pixels(param, None, serving) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise APIError(400, f"{param} is not an image ({allowed})", param=param, code="invalid_image") from None
    if image.format not in FORMATS:
        raise APIError(
            400, f"{param} is a {image.format} image; allowed formats: {allowed}", param=param, code="invalid_image"
        )
    if image.width * image.height > serving.max_input_image_pixels:
        raise _too_many_pixels(param, image, serving)
    try:
        image.load()
    except Exception:  # noqa: BLE001 - whatever a truncated or corrupt file raises in its decoder
        raise APIError(400, f"{param} could not be decoded", param=param, code="invalid_image") from None
    return image


def openai_mask(mask: Image.Image, image: Image.Image) -> Image.Image:
    """OpenAI's mask (a PNG whose fully transparent pixels mark what to edit) as diffusers' (white: repaint)."""
    if mask.format != "PNG" or ("A" not in mask.getbands() and "transparency" not in mask.info):
        raise APIError(
            400,
            "mask must be a PNG with an alpha channel: its fully transparent pixels mark what to edit",
            param="mask",
            code="invalid_image",
        )
    if mask.size != image.size:
        raise APIError(
            400,
            f"mask is {mask.width}x{mask.height} and the image {image.width}x{image.height}: "
            "they must be the same size",
            param="mask",
            code="invalid_value",
        )
    alpha = mask.convert("RGBA").getchannel("A")
    return alpha.point(lambda value: 255 if value == 0 else 0)


def _too_large(param: str, size: int, serving: ServingConfig) -> APIError:
    return APIError(
        400,
        f"{param} is {size} bytes, above the limit of {serving.max_input_image_bytes} (--max-input-image-bytes)",
        param=param,
        code="image_too_large",
    )


def _too_many_pixels(param: str, image: Image.Image | None, serving: ServingConfig) -> APIError:
    size = "" if image is None else f" ({image.width}x{image.height})"
    return APIError(
        400,
        f"{param} has more pixels{size} than the limit of {serving.max_input_image_pixels} (--max-input-image-pixels)",
        param=param,
        code="image_too_large",
    )
