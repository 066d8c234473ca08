"""OpenAI's defaults for an Images request that names one of OpenAI's image models: clients that hard-code
``dall-e-3`` or ``gpt-image-1`` (served with ``--served-model-name``) expect OpenAI's answer for that model. The
rule is `OPENAI_IMAGE_MODELS`, one row per model; docs/migration.md's table is generated from it
(`vllm_omni.entrypoints.openai.docs`)."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Literal, TypeVar

from vllm_omni.entrypoints.openai.protocol import SIZE_PATTERN, ImageGenerationRequest


@dataclass(frozen=True)
class OpenAIImageModel:
    """What OpenAI answers for one of its image models, for the fields a request leaves unset."""

    response_format: Literal["url", "b64_json"]
    """The images' form: DALL·E answers ``url`` (LangChain's and LibreChat's DALL·E tools read ``data[].url``),
    GPT Image ``b64_json`` (the only form it answers)."""
    quality: Literal["standard", "auto"]
    """The quality (the steps, [quality](serving.md#quality-usage-and-openais-other-image-fields)) it runs at."""
    sizes: tuple[str, ...]
    """The sizes OpenAI makes it at, which its clients send as they are: each is served at the largest size of its
    aspect ratio that the served model makes within ``--max-image-pixels`` (each side a multiple of what the
    pipeline needs), and the answer's ``size`` says which. Other sizes are served as given."""


OPENAI_IMAGE_MODELS: dict[str, OpenAIImageModel] = {
    "dall-e-2": OpenAIImageModel("url", "standard", ("256x256", "512x512", "1024x1024")),
    "dall-e-3": OpenAIImageModel("url", "standard", ("1024x1024", "1792x1024", "1024x1792")),
    "gpt-image-*": OpenAIImageModel("b64_json", "auto", ("1024x1024", "1536x1024", "1024x1536")),
}
"""OpenAI's image models by name (a glob: ``gpt-image-*`` is ``gpt-image-1``, ``gpt-image-1-mini``, ...). A request
whose ``model`` is any other name keeps this server's defaults."""


def openai_image_model(name: str | None) -> OpenAIImageModel | None:
    """The OpenAI model that ``name`` names, if any."""
    if name is None:
        return None
    return next((model for pattern, model in OPENAI_IMAGE_MODELS.items() if fnmatch.fnmatchcase(name, pattern)), None)


R = TypeVar("R", bound=ImageGenerationRequest)


def with_openai_defaults(body: R) -> R:
    """``body`` with its OpenAI model's ``response_format`` and ``quality`` where it sets none (a stream keeps
    ``b64_json``, the only form its events carry); ``body`` itself when it names no OpenAI model. The copy's
    ``model_fields_set`` is still what the client sent."""
    model = openai_image_model(body.model)
    if model is None:
        return body
    unset = {"response_format": model.response_format, "quality": model.quality}
    if body.stream:
        del unset["response_format"]
    defaults = {name: value for name, value in unset.items() if name not in body.model_fields_set}
    if not defaults:
        return body
    return type(body).model_construct(_fields_set=set(body.model_fields_set), **(dict(body) | defaults))


def openai_size(body: ImageGenerationRequest, multiple: int, max_pixels: int) -> tuple[int, int] | None:
    """``(width, height)`` to make one of its OpenAI model's sizes at: scaled down to ``max_pixels`` with its
    aspect ratio, each side rounded down to ``multiple`` (at least one); ``None`` for any other size or model."""
    model = openai_image_model(body.model)
    if model is None or body.size not in model.sizes:
        return None
    match = SIZE_PATTERN.match(body.size)
    assert match is not None, "an OpenAI model's sizes are WxH"
    width, height = int(match[1]), int(match[2])
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    fitted = [max(multiple, int(side * scale) // multiple * multiple) for side in (width, height)]
    return fitted[0], fitted[1]
