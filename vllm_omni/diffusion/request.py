"""What a diffusion request is: its sampling parameters, its batch key, its engine-side state and how it fails
(its output is in `outputs.py`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

if TYPE_CHECKING:
    from vllm_omni.diffusion.previews import Preview

MAX_SEED = 2**63 - 1

MAX_INPUT_IMAGES = 16
"""Most input images one request may carry (``image``)."""


MAX_LORA_SCALE = 8.0
"""Largest absolute ``scale`` a request may give an adapter."""

MAX_PARTIAL_IMAGES = 3
"""Most previews one request may ask for (OpenAI's limit)."""


class LoraSelection(BaseModel):
    """One LoRA adapter a request applies, and how strongly (docs/lora.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The adapter's name (``--lora-modules name=path``, or ``/v1/load_lora_adapter``)."""
    scale: float = Field(default=1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)
    """Multiplier of the adapter's delta, as diffusers' ``set_adapters`` weight (1: as trained; 0: off)."""
    path: str | None = None
    """Where the adapter is read from: the engine sets it from its adapters when it admits the request; a caller
    leaves it unset."""


class OmniDiffusionSamplingParams(BaseModel):
    """How to generate; ``None`` means the pipeline's own default."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, arbitrary_types_allowed=True)

    height: int | None = Field(default=None, ge=1, le=16384)
    """Output height in pixels."""

    width: int | None = Field(default=None, ge=1, le=16384)
    """Output width in pixels."""

    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    """Denoising steps."""

    guidance_scale: float | None = Field(default=None, ge=0.0)
    """Guidance scale (classifier-free, or embedded guidance for distilled models)."""

    num_outputs_per_prompt: int = Field(default=1, ge=1, le=64)
    """Images (or videos) generated for the prompt."""

    num_frames: int | None = Field(default=None, ge=1, le=1024)
    """Frames of each video (video pipelines only; ``None``: the pipeline's default)."""

    fps: int | None = Field(default=None, ge=1, le=240)
    """Frames per second the video is meant to play at (carried to the output; video pipelines only)."""

    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seed of the request's own generator; a random one is drawn (and reported) when unset."""

    negative_prompt: str | None = None
    """What to steer away from (pipelines that accept ``negative_prompt``)."""

    image: list[Image.Image] | None = Field(default=None, min_length=1, max_length=MAX_INPUT_IMAGES)
    """Input images (a single image is taken as a list of one): image-to-image, instruction edits or
    image-to-video, as the served model does (docs/serving.md); several only for models that take several."""

    mask_image: Image.Image | None = None
    """Inpainting mask in diffusers' convention (white: repaint, black: keep), the size of the first image."""

    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    """How far the input image is noised before denoising (image-to-image and inpainting; ``None``: 0.6 for
    image-to-image, 1.0 for inpainting); the request runs ``int(num_inference_steps * strength)`` steps."""

    output_type: Literal["pil", "np"] = "pil"
    """``pil``: PIL images; ``np``: float arrays in [0, 1] of shape (H, W, 3)."""

    extra_args: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments of the pipeline call (e.g. ``max_sequence_length``); batched requests must agree."""

    partial_images: int = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Previews of the running request to hand its caller before the output (0–3), made at evenly spaced steps
    (`AsyncOmni.generate` yields them); requests with different counts share batches."""

    cache: bool = True
    """Use the stage's step cache (``cache_backend``); ``False``: every block runs at every step. Requests that
    differ share batches."""

    enhance_prompt: bool | None = None
    """Whether the deploy's llm stage rewrites the prompt first (`OmniRequestOutput.revised_prompt`): ``None``, if
    there is one; ``False`` skips it; ``True`` is refused where none is deployed."""

    lora: tuple[LoraSelection, ...] = ()
    """LoRA adapters to apply, each ``{"name", "scale"}`` (one, or a list to stack them); requests with different
    adapters share batches."""

    @field_validator("lora", mode="before")
    @classmethod
    def _one_adapter_is_a_list(cls, lora: Any) -> Any:
        if lora is None:
            return ()
        return [lora] if isinstance(lora, dict | LoraSelection) else lora

    @field_validator("lora")
    @classmethod
    def _adapters_once(cls, lora: tuple[LoraSelection, ...]) -> tuple[LoraSelection, ...]:
        names = [s.name for s in lora]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"lora names adapter(s) {', '.join(repeated)} more than once; give each once")
        return lora

    @field_validator("image", mode="before")
    @classmethod
    def _one_image_is_a_list(cls, image: Any) -> Any:
        return [image] if isinstance(image, Image.Image) else image

    @field_validator("mask_image")
    @classmethod
    def _mask_fits_the_image(cls, mask: Image.Image | None, info: ValidationInfo) -> Image.Image | None:
        images = info.data.get("image")
        if mask is not None:
            if not images:
                raise ValueError("mask_image needs an image to inpaint")
            if mask.size != images[0].size:
                raise ValueError(
                    f"mask_image is {mask.width}x{mask.height} and the image {images[0].width}x{images[0].height}: "
                    "they must be the same size"
                )
        return mask

    @property
    def task(self) -> ImageTask:
        """What the request asks of the model: ``text`` (no input image), ``image`` (an input image, no mask) or
        ``inpaint`` (an image and a mask)."""
        if self.image is None:
            return "text"
        return "inpaint" if self.mask_image is not None else "image"


ImageTask = Literal["text", "image", "inpaint"]
"""What a request asks of the model (`OmniDiffusionSamplingParams.task`)."""


class SamplingParamsError(ValueError):
    """Sampling parameters this pipeline cannot run; ``param`` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.param, str(self))


class UnknownLoraError(SamplingParamsError):
    """A request (or an unload) names a LoRA adapter the server does not have; ``adapters`` are those it has."""

    def __init__(self, name: str, adapters: list[str]):
        known = ", ".join(sorted(adapters)) or "none"
        super().__init__("lora", f"The LoRA adapter '{name}' does not exist; adapters: {known}")
        self.name, self.adapters = name, adapters

    def __reduce__(self):
        return type(self), (self.name, self.adapters)


class BatchKey(NamedTuple):
    """Requests batch together only when every field is equal: one pipeline call takes one value of each."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float | None
    num_outputs_per_prompt: int
    num_frames: int | None
    fps: int | None
    output_type: str
    has_negative_prompt: bool
    extra_args: tuple[tuple[str, str], ...]
    task: str
    strength: float | None
    image_sizes: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, params: OmniDiffusionSamplingParams) -> BatchKey:
        """The key of complete ``params`` (no ``None`` left in the fields it reads)."""
        return cls(
            height=params.height,
            width=params.width,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            num_outputs_per_prompt=params.num_outputs_per_prompt,
            num_frames=params.num_frames,
            fps=params.fps,
            output_type=params.output_type,
            has_negative_prompt=params.negative_prompt is not None,
            extra_args=tuple(sorted((k, repr(v)) for k, v in params.extra_args.items())),
            task=params.task,
            strength=params.strength,
            image_sizes=tuple(image.size for image in params.image or ()),
        )


class RequestFailedError(RuntimeError):
    """A request failed on its own (its batch neighbours were re-run and unaffected)."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.reason = message

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.request_id, self.reason)


class RequestAbortedError(RequestFailedError):
    """The request was aborted (``abort(request_id)`` or a cancelled caller) before it finished."""

    def __init__(self, request_id: str):
        super().__init__(request_id, "aborted")

    def __reduce__(self):
        return type(self), (self.request_id,)


class StageUnavailableError(RequestFailedError):
    """No replica of the stage could take the request: every replica is down (dead or restarting)."""

    def __init__(self, stage_id: int, message: str, request_id: str | None = None):
        unavailable = f"stage {stage_id} is unavailable: {message}"
        super().__init__(request_id, unavailable)
        if request_id is None:  # refused before it had an id in the engine: no "request ... failed" prefix
            self.args = (unavailable,)
        self.stage_id, self.reason = stage_id, message

    def __reduce__(self):
        return type(self), (self.stage_id, self.reason, self.request_id)


@dataclass(eq=False)
class DiffusionRequest:
    """Engine-side state of one request; ``params`` is complete (no ``None`` left that the key needs)."""

    request_id: str
    prompt: str
    params: OmniDiffusionSamplingParams
    seed: int
    key: Hashable
    """Requests batch together only when their keys are equal: its stage role's key for its parameters."""
    arrival_time: float = field(default_factory=time.monotonic)
    started_time: float | None = None
    """When the engine started working on it (its batch was scheduled; step mode: its encoding began)."""
    future: Future = field(default_factory=Future)
    aborted: bool = False
    steps_done: int = 0
    """Denoising steps finished so far (updated by the pipeline's step callback, or by `denoise_step`)."""
    total_steps: int | None = None
    """Denoiser evaluations the request needs, once known (step mode: its own schedule's length)."""
    state: Any = None
    """Its stepper's denoising state while a role that denoises step by step holds it; ``None`` before and after."""
    preparing: bool = False
    """Step mode: its encoding has been handed to the encode worker."""
    payload: Any = None
    """A split pipeline's previous stage output for it (`Conditioning` or `Latents`); ``None`` for the first."""
    on_preview: Callable[[Preview], None] | None = None
    """Where its partial images go (``params.partial_images`` of them), on the engine's thread; ``None``: nowhere."""
    previews_sent: int = 0
    """Previews made so far."""

    @property
    def pixels(self) -> int:
        """``width × height × frames × n``: what the stage's ``max_batch_pixels`` budget counts."""
        p = self.params
        return (p.width or 1) * (p.height or 1) * (p.num_frames or 1) * p.num_outputs_per_prompt

    @property
    def progress(self) -> float:
        """Fraction of its denoising steps done."""
        return self.steps_done / (self.total_steps or self.params.num_inference_steps)

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        key: Hashable | None = None,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> DiffusionRequest:
        key = key if key is not None else BatchKey.of(params)
        seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        return cls(
            request_id=request_id,
            prompt=prompt,
            params=params,
            seed=seed,
            key=key,
            payload=payload,
            on_preview=on_preview,
        )
