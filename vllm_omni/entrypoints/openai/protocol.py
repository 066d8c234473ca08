"""Request and response shapes of the OpenAI Images and Videos APIs, plus the extensions of docs/serving.md."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from vllm_omni.config.serving import QualityLevel
from vllm_omni.sampling_params import MAX_LORA_SCALE, MAX_PARTIAL_IMAGES, MAX_SEED

SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


class LoraAdapterChoice(BaseModel):
    """One entry of the ``lora`` extension: an adapter the server serves, and its scale."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    scale: float = Field(default=1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)


LoraField = LoraAdapterChoice | list[LoraAdapterChoice] | None
"""``lora``: one adapter, or a list of them to stack."""


def lora_from_form(value: Any) -> Any:
    """A form's ``lora`` field arrives as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError('lora must be JSON: {"name": ..., "scale": ...} or a list of them') from None
    return value


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: StrictInt = Field(default=1, ge=1, le=10)
    size: str = "auto"
    """``WIDTHxHEIGHT`` in pixels, or ``auto`` for the model's default."""
    response_format: Literal["b64_json", "url", "file"] = "b64_json"
    """``b64_json`` (as OpenAI's newest image model and upstream vllm-omni answer), ``url`` (a link to the image
    store), or ``file``: the image's bytes themselves (a zip of them for several images), as upstream's."""
    output_format: Literal["png", "jpeg", "webp"] = "png"
    """Case-insensitive; ``jpg`` is another name for ``jpeg``."""
    output_compression: StrictInt | None = Field(default=None, ge=0, le=100)
    """Quality for jpeg and webp, 0–100."""
    quality: Literal["auto", "low", "medium", "high", "standard", "hd"] = "auto"
    """Denoising steps by level (`image_usage.quality_steps`): ``standard`` is ``medium``, ``hd`` and ``auto`` are
    ``high``; ``num_inference_steps`` wins over it."""
    background: Literal["auto", "opaque", "transparent"] = "auto"
    """``transparent`` is refused: the served pipelines make opaque RGB images."""
    style: Literal["vivid", "natural"] | None = None
    """DALL·E 3's style: accepted, changes nothing in generation."""
    moderation: Literal["auto", "low"] = "auto"
    """Accepted; no moderation model runs here."""
    safety_identifier: str | None = Field(default=None, max_length=64)
    """An end user's stable id, logged with the request id when the request completes (``user`` when unset)."""
    user: str | None = None
    stream: bool = False
    """Answer with server-sent events: ``partial_images`` previews, then each image (base64)."""
    partial_images: StrictInt = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Previews streamed before the image (needs ``stream``); fewer when the request has too few steps."""
    # Extensions.
    negative_prompt: str | None = None
    num_inference_steps: StrictInt | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    """True classifier-free guidance with ``negative_prompt`` (Flux and Qwen-Image families)."""
    flow_shift: float | None = Field(default=None, gt=0.0, le=100.0)
    """The timestep shift of a flow-matching scheduler with a fixed one (SD3, Wan); refused where the scheduler
    shifts by image size (Flux) or is not flow matching."""
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    lora: LoraField = None
    """LoRA adapters to apply (docs/lora.md); ``model: "<adapter>"`` selects one at scale 1."""
    cache: bool = True
    """Use the server's step cache (``--cache-backend``); ``false``: every block runs at every step."""
    enhance_prompt: bool | None = None
    """Let the deploy's llm stage rewrite the prompt (answered as ``revised_prompt``); ``false`` skips it, ``true``
    is refused where no llm stage is deployed."""

    @field_validator("size")
    @classmethod
    def _check_size(cls, size: str) -> str:
        if size != "auto" and not SIZE_PATTERN.match(size):
            raise ValueError("size must be 'auto' or WIDTHxHEIGHT in pixels, such as '512x512'")
        return size

    @field_validator("output_format", mode="before")
    @classmethod
    def _format_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.lower()
            return "jpeg" if value == "jpg" else value
        return value

    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)``, or ``None`` for ``auto``."""
        match = SIZE_PATTERN.match(self.size)
        return (int(match[1]), int(match[2])) if match else None


class ImageEditRequest(ImageGenerationRequest):
    """``POST /v1/images/edits``: its multipart form fields (the files, ``image`` / ``image[]`` and ``mask``, are read
    apart). Form values arrive as text, so its integers are parsed from it."""

    n: int = Field(default=1, ge=1, le=10)
    size: str = "auto"
    """``WIDTHxHEIGHT`` in pixels, or ``auto`` for the first image's size (rounded down to what the model needs)."""
    output_compression: int | None = Field(default=None, ge=0, le=100)
    partial_images: int = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    num_inference_steps: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    # Extensions.
    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    """How far the input image is noised (image-to-image, inpainting); the model's variant's default when unset."""

    _lora_from_form = field_validator("lora", mode="before")(lora_from_form)


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImageInputTokensDetails(BaseModel):
    text_tokens: int
    """The prompt's tokens and the negative prompt's, by the model's prompt tokenizer."""
    image_tokens: int
    """Denoiser positions of the input images (edits) at the sizes they go to the model; 0 without."""


class ImageUsage(BaseModel):
    """OpenAI's ``usage`` of an Images API answer, counted as docs/serving.md says (`image_usage.response_fields`)."""

    input_tokens: int
    input_tokens_details: ImageInputTokensDetails
    output_tokens: int
    """Denoiser positions of the images made: ``(width / latent_pixels) × (height / latent_pixels)`` each."""
    total_tokens: int


class ImageGenerationResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    background: Literal["opaque"]
    output_format: str
    quality: QualityLevel | None = None
    """The level whose steps ran; unset when the request gave ``num_inference_steps``."""
    size: str
    usage: ImageUsage | None = None
    """Unset when the model folder has no tokenizer."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every non-2xx answer of this server has this body."""

    error: ErrorInfo


class ModelEntry(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI's model object): a served model name or a LoRA adapter. Not the
    diffusion `ModelCard`, which says what a loaded pipeline takes."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm-omni"
    root: str
    parent: str | None = None
    """For a LoRA adapter, the base model it applies to (as vLLM lists adapters)."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]


class VideoGenerationRequest(BaseModel):
    """``POST /v1/videos`` (JSON or form fields); unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = None
    """``WIDTHxHEIGHT`` in pixels; unset: the model's default (or ``width`` and ``height``)."""
    width: int | None = Field(default=None, ge=1)
    """Extension (upstream vllm-omni's): the width in pixels, given with ``height`` instead of ``size``."""
    height: int | None = Field(default=None, ge=1)
    """Extension: the height in pixels, given with ``width`` instead of ``size``."""
    seconds: float | None = Field(default=None, gt=0, le=600)
    """Duration at ``fps``; OpenAI sends it as a string such as ``"4"``."""
    num_frames: int | None = Field(default=None, ge=1)
    """Extension: the frame count itself (instead of ``seconds``)."""
    fps: int | None = Field(default=None, ge=1, le=240)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    true_cfg_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    """True classifier-free guidance with ``negative_prompt``, for pipelines that take it (Wan's ``guidance_scale``
    is true guidance already: it refuses this)."""
    flow_shift: float | None = Field(default=None, gt=0.0, le=100.0)
    """Extension: the timestep shift of the scheduler (Wan's ``flow_shift``), as for images."""
    guidance_scale_2: float | None = Field(default=None, ge=0.0, le=100.0)
    """Extension: the low-noise expert's guidance of a two-expert Wan 2.2 folder (``guidance_scale`` when unset)."""
    boundary_ratio: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Extension: where a two-expert Wan 2.2 folder's low-noise expert takes over, as a fraction of the training
    timesteps (the folder's own when unset)."""
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    lora: LoraField = None
    """LoRA adapters to apply (docs/lora.md); JSON text in a form."""
    cache: bool = True
    """Extension: use the server's step cache (``--cache-backend``); ``false``: every block runs at every step."""
    enhance_prompt: bool | None = None
    """Extension: let the deploy's llm stage rewrite the prompt (the job's ``revised_prompt``); ``false`` skips it,
    ``true`` is refused where no llm stage is deployed."""
    partial_images: int = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Extension: previews of the running job (0–3), each shown by ``GET /v1/videos/{id}/content?variant=thumbnail``
    while it runs (the job's ``preview_index`` counts them)."""

    _lora_from_form = field_validator("lora", mode="before")(lora_from_form)

    @field_validator("size")
    @classmethod
    def _check_size(cls, size: str | None) -> str | None:
        if size is not None and not SIZE_PATTERN.match(size):
            raise ValueError("size must be WIDTHxHEIGHT in pixels, such as '832x480'")
        return size

    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` from ``size`` or from ``width`` and ``height`` (the route refuses both ways at
        once), or ``None`` for the model's default."""
        if self.width is not None and self.height is not None:
            return self.width, self.height
        match = SIZE_PATTERN.match(self.size or "")
        return (int(match[1]), int(match[2])) if match else None


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``, as vLLM's."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    """Replace an adapter of the same name instead of refusing it."""


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``, as vLLM's."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None = None
    size: str
    seconds: str
    error: ErrorInfo | None = None
    preview_index: int | None = None
    """Extension: the index of the latest preview of a running job (``partial_images``), from 0."""
    revised_prompt: str | None = None
    """Extension: the prompt the deploy's llm stage wrote, which the video was made from (a completed job of a
    deploy with an llm stage that the request did not skip)."""


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


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

    model: str | None = None
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
