"""How to generate: the sampling parameters of a diffusion request (`OmniDiffusionSamplingParams`), their limits,
and the parameters once admitted (`AdmittedParams`). Public, and imported by every layer (the HTTP APIs, the engines,
the steppers); it imports nothing of the package (but `IgnoredField` of outputs.py, for type checking only)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

if TYPE_CHECKING:
    from vllm_omni.outputs import IgnoredField

MAX_SEED = 2**63 - 1

PRIORITY_BOUND = 2**63
"""``priority`` lies in ``[-PRIORITY_BOUND, PRIORITY_BOUND)``: vLLM's bounds (a 64-bit integer)."""

SPEECH_FIELDS = ("voice", "instructions", "max_new_tokens", "initial_codec_chunk_frames")
"""The fields only speech models read; a diffusion model lists each one given as ignored."""

MAX_INPUT_IMAGES = 16
"""Most input images one request may carry (``image``)."""


MAX_LORA_SCALE = 8.0
"""Largest absolute ``scale`` a request may give an adapter."""

MAX_PARTIAL_IMAGES = 3
"""Most previews one request may ask for (OpenAI's limit)."""

DEFAULT_VIDEO_FPS = 16
"""Frame rate a video is reported at when the request gives none (``fps``; Wan models are trained at 16 fps)."""


class LoraChoice(BaseModel):
    """One LoRA adapter a request applies, and how strongly (docs/lora.md): an entry of a request's ``lora``, in
    Python and over HTTP alike."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """The adapter's name (``--lora-modules name=path``, or ``/v1/load_lora_adapter``)."""
    scale: float = Field(default=1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)
    """Multiplier of the adapter's delta, as diffusers' ``set_adapters`` weight (1: as trained; 0: off)."""


class LoraSelection(LoraChoice):
    """A `LoraChoice` with where its adapter is read from, which the engine sets when it admits the request."""

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
    """Images (or videos, or waveforms) generated for the prompt."""

    num_frames: int | None = Field(default=None, ge=1, le=1024)
    """Frames of each video (video pipelines only; ``None``: the pipeline's default)."""

    fps: int | None = Field(default=None, ge=1, le=240)
    """Frames per second the video is meant to play at (carried to the output; video pipelines only)."""

    audio_length: float | None = Field(default=None, allow_inf_nan=False)
    """Seconds of audio each waveform holds (audio pipelines only; ``None``: the pipeline's default, Stable Audio's
    longest clip). Upstream vllm-omni's name; the pipeline's own argument is its family's (Stable Audio's
    ``audio_end_in_s``, start + length; AudioLDM 2's ``audio_length_in_s``). Checked against what the model makes
    (more than 0, at most its longest clip) when the request is admitted."""

    audio_start: float | None = Field(default=None, allow_inf_nan=False)
    """Where the clip starts, in seconds, for audio pipelines conditioned on a start (Stable Audio's
    ``audio_start_in_s``: the clip is ``[audio_start, audio_start + audio_length]`` of its longest one); ``None``:
    0. Upstream vllm-omni's name."""

    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seed of the request's own generator; a random one is drawn (and reported) when unset."""

    negative_prompt: str | None = None
    """What to steer away from (pipelines that accept ``negative_prompt``)."""

    image: list[Image.Image] | None = Field(default=None, min_length=1, max_length=MAX_INPUT_IMAGES)
    """Input images (a single image is taken as a list of one): image-to-image, instruction edits or
    image-to-video, as the served model does (docs/serving.md); several only for models that take several."""

    video: list[Image.Image] | None = Field(default=None, min_length=1)
    """Input video, as its frames, for video-to-video (the served model's video-to-video variant, built on its
    components with ``from_pipe``: a remix of a completed video); not with ``image``."""

    mask_image: Image.Image | None = None
    """Inpainting mask in diffusers' convention (white: repaint, black: keep), the size of the first image."""

    strength: float | None = Field(default=None, gt=0.0, le=1.0)
    """How far the input image (or video) is noised before denoising (image-to-image, inpainting and
    video-to-video; ``None``: 0.6 for image-to-image, 1.0 for inpainting, 0.8 for video-to-video, diffusers'
    default); the request runs ``int(num_inference_steps * strength)`` steps."""

    output_type: Literal["pil", "np"] = "pil"
    """``pil``: PIL images; ``np``: float arrays in [0, 1] of shape (H, W, 3). Audio is always float arrays
    (`OmniRequestOutput.audios`)."""

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

    priority: int = Field(default=0, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    """vLLM's request priority: under a stage's ``scheduling_policy`` ``priority`` a lower value starts sooner
    (arrival order among equals); under ``fcfs`` (the default) any value but 0 is refused, naming ``priority``. In
    request mode it reorders waiting requests only (a running batch is never interrupted); in step mode a better
    request also preempts worse running ones at a step boundary, which resume later where they left. Requests that
    differ share batches."""

    voice: str | None = None
    """Speech models: the voice to speak in, one of the model's (``None``: its default; a model of one voice takes
    any name)."""

    instructions: str | None = None
    """Speech models: how to speak (tone, pace); only families with style prompts read it, others list it in
    ``ignored_fields``."""

    max_new_tokens: int | None = Field(default=None, ge=1, le=65536)
    """Speech models: the most code tokens the talker generates (``None``: the family's default); it bounds the
    audio's length."""

    initial_codec_chunk_frames: int | None = Field(default=None, ge=1, le=4096)
    """Speech models: the codec frames of the first streamed chunk (``None``: the family's small first chunk, for
    a fast first audio); later chunks grow to the family's steady size."""

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

    @field_validator("video")
    @classmethod
    def _video_alone(cls, video: list[Image.Image] | None, info: ValidationInfo) -> list[Image.Image] | None:
        if video is not None and info.data.get("image") is not None:
            raise ValueError("give an input video or input images, not both")
        return video

    @property
    def task(self) -> ImageTask:
        """What the request asks of the model: ``text`` (no input image), ``image`` (an input image, no mask),
        ``inpaint`` (an image and a mask) or ``video`` (an input video)."""
        if self.video is not None:
            return "video"
        if self.image is None:
            return "text"
        return "inpaint" if self.mask_image is not None else "image"


ImageTask = Literal["text", "image", "inpaint", "video"]
"""What a request asks of the model (`OmniDiffusionSamplingParams.task`)."""


@dataclass(frozen=True)
class AdmittedParams:
    """Sampling parameters every stage has admitted: complete (the model's defaults filled in, the seed drawn),
    checked, and the batch key each stage gives them. Made once per request (`AsyncOmni.admit`,
    `OmniEngine.admit`); ``generate`` takes them as they are."""

    params: OmniDiffusionSamplingParams
    keys: tuple[Hashable, ...]
    """One batch key per stage, in request order."""
    ignored: tuple[IgnoredField, ...] = ()
    """The request's fields that the model would not use, dropped from ``params``: its caller reports them (the
    HTTP layer's ``Warning`` header, log line and counter; `OmniBase`'s warning)."""
