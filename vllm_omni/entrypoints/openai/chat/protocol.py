"""Request and response shapes of ``POST /v1/chat/completions`` for a diffusion model, in upstream vllm-omni's
shape (`api_router.py`)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.protocol import ModelName


class ChatImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    """A data URL (``data:image/png;base64,...``): the server fetches no URL."""


class ChatContentPart(BaseModel):
    """One part of a chat message's content: its text, or an input image."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ChatImageURL | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    """``user``: the chat adapter refuses the others (a diffusion model has no conversation)."""
    content: str | list[ChatContentPart]


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` for a diffusion model, in upstream vllm-omni's shape: the prompt is the user
    messages' text, their ``image_url`` parts are input images, and the generation parameters come at the top level
    (as openai-python's ``extra_body`` sends them) or in a literal ``extra_body`` object (as upstream's curl examples
    do). Those are the Images (or Videos) API's fields, checked there; any other key is refused."""

    model_config = ConfigDict(extra="allow")

    model: ModelName = None
    """A served model name (or a LoRA adapter's); unset or empty: the served model."""
    messages: list[ChatMessage] = Field(min_length=1)
    extra_body: dict[str, Any] | None = None
    stream: bool = False
    """Refused when true: a diffusion chat answer comes whole (``/v1/images/generations`` streams previews)."""


class ChatMediaURL(BaseModel):
    url: str
    """``data:<media type>;base64,<bytes>``."""


class ChatMediaPart(BaseModel):
    """One generated image (``image_url``) or video (``video_url``) of the answer, as upstream's."""

    type: Literal["image_url", "video_url"]
    image_url: ChatMediaURL | None = None
    video_url: ChatMediaURL | None = None


class ChatAnswer(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: list[ChatMediaPart]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatAnswer
    finish_reason: Literal["stop"] = "stop"
    logprobs: None = None


class ChatUsage(BaseModel):
    prompt_tokens: int
    """The Images API's ``input_tokens``."""
    completion_tokens: int
    """The Images API's ``output_tokens``: denoiser positions of the images made."""
    total_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage | None = None
    """As the Images API counts it; unset for a video, or a model folder without a tokenizer."""
