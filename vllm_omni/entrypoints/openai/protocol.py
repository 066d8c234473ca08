"""Request and response shapes of the OpenAI Images, Videos and Speech APIs and of upstream vllm-omni's
``POST /v1/audio/generate`` and ``GET /v1/audio/voices``, plus the extensions of docs/serving.md.

A request field is one declaration in its request model: its type with bounds, its default, its docstring (the
field's description in the OpenAPI schema and its row in docs/serving.md, `vllm_omni.entrypoints.openai.docs`) and,
for a field that its route copies into the sampling parameters, a `Sampling` in its metadata."""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator

from vllm_omni.config.serving import QualityLevel
from vllm_omni.entrypoints.openai.audio.encoding import AudioFormat
from vllm_omni.entrypoints.openai.audio.tempo import MAX_SPEED, MIN_SPEED
from vllm_omni.entrypoints.openai.request_fields import Ignored, Sampling
from vllm_omni.entrypoints.openai.rollout_fields import RolloutFields
from vllm_omni.sampling_params import MAX_INPUT_IMAGES, MAX_PARTIAL_IMAGES, MAX_SEED, PRIORITY_BOUND, LoraChoice

SIZE_PATTERN = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


LoraField = LoraChoice | list[LoraChoice] | None
"""``lora``: one adapter, or a list of them to stack."""


def _unset_if_empty(value: Any) -> Any:
    return None if value == "" else value


ModelName = Annotated[str | None, BeforeValidator(_unset_if_empty)]
"""``model``: a served model name, or unset for the served model. An empty string is unset too: Open WebUI's edits
send ``model: ""`` when no edit model is configured."""


def lora_from_form(value: Any) -> Any:
    """A form's ``lora`` field arrives as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError('lora must be JSON: {"name": ..., "scale": ...} or a list of them') from None
    return value


class ImageGenerationRequest(RolloutFields):
    """``POST /v1/images/generations``; unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prompt: str = Field(min_length=1)
    """At most ``--max-prompt-length`` characters."""
    model: ModelName = None
    """If given, one of the served model names, or a LoRA adapter's name, which applies it at scale 1
    ([lora.md](lora.md)); else 404 ``model_not_found``. Unset or empty: the served model. A name of OpenAI's
    (``dall-e-2``, ``dall-e-3``, ``gpt-image-*``) served with ``--served-model-name`` also gives OpenAI's defaults
    for that model ([OpenAI's model names](#clients-that-name-openais-models))."""
    n: Annotated[StrictInt, Sampling("num_outputs_per_prompt")] = Field(default=1, ge=1, le=10)
    """Images for the prompt. More than 1 needs a pipeline with ``num_images_per_prompt``."""
    size: str = "auto"
    """``WIDTHxHEIGHT`` in pixels, or ``auto`` for the model's default size. ``width × height`` at most
    ``--max-image-pixels``; each side a multiple of what the pipeline needs (at least 8)."""
    response_format: Literal["b64_json", "url", "file"] = "b64_json"
    """``b64_json`` and ``url`` as in OpenAI (``url``: a link to the image store); ``file`` (upstream vllm-omni's):
    the answer is the image itself, with its media type, or for ``n`` > 1 a zip (``application/zip``) of
    ``image_0.png``, ``image_1.png``, ..., as a download: ``Content-Disposition: attachment;
    filename="<request id>.<png|jpeg|webp|zip>"``."""
    output_format: Literal["png", "jpeg", "webp"] = "png"
    """Encoding of the images; case-insensitive, and ``jpg`` is ``jpeg``."""
    output_compression: StrictInt | None = Field(default=None, ge=0, le=100)
    """Quality for ``jpeg`` and ``webp``; with ``png``, a lossless format, it is
    [ignored](#ignored-fields-and---strict-fields) (a ``Warning``), as upstream vllm-omni accepts it. Unset: quality
    100."""
    quality: Literal["auto", "low", "medium", "high", "standard", "hd"] = "auto"
    """The number of denoising steps ([quality](#quality-usage-and-openais-other-image-fields)): ``standard`` is
    ``medium``, ``hd`` and ``auto`` are ``high``; ``num_inference_steps`` wins over it."""
    background: Literal["auto", "opaque", "transparent"] = "auto"
    """The served pipelines make opaque RGB images: ``transparent`` is a 400 naming ``background``."""
    style: Annotated[
        Literal["vivid", "natural"] | None, Ignored("DALL-E 3's style: the served model takes no style")
    ] = None
    """DALL·E 3's style: accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``): the served
    model takes no style."""
    moderation: Annotated[
        Literal["auto", "low"],
        Ignored("no moderation model runs on this server: nothing is filtered, whatever it says"),
    ] = "auto"
    """Accepted and [ignored](#ignored-fields-and---strict-fields) when given (a ``Warning``): no moderation model
    runs here ([OpenAI's other image fields](#quality-usage-and-openais-other-image-fields))."""
    complexity: Annotated[
        Literal["low", "medium", "high"] | None, Ignored("the served model has no complexity setting")
    ] = None
    """OpenAI's: accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``)."""
    frame_count: Annotated[
        StrictInt | None, Ignored("this server makes still images (output_format png, jpeg or webp), not animations")
    ] = Field(default=None, ge=1)
    """OpenAI's (animated images): accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``)."""
    frame_duration_ms: Annotated[
        StrictInt | None, Ignored("this server makes still images (output_format png, jpeg or webp), not animations")
    ] = Field(default=None, ge=1)
    """OpenAI's (animated images): accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``)."""
    svg: Annotated[
        dict[str, Any] | str | None, Ignored("this server makes raster images (output_format png, jpeg or webp)")
    ] = None
    """OpenAI's (SVG output): accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``)."""
    safety_identifier: str | None = Field(default=None, max_length=64)
    """An end user's stable id, logged with the request id when the request completes."""
    user: str | None = None
    """Logged as ``safety_identifier`` is, when that is unset."""
    stream: bool = False
    """Answer with [server-sent events](#streaming-partial-images) instead of one JSON object: ``partial_images``
    previews, then each image (base64)."""
    partial_images: Annotated[StrictInt, Sampling()] = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Previews streamed before each image; needs ``stream``. Fewer when the request has too few steps."""
    # Extensions.
    negative_prompt: Annotated[str | None, Sampling()] = None
    """Extension. At most ``--max-prompt-length`` characters. [Ignored](#ignored-fields-and---strict-fields) if the
    pipeline takes no ``negative_prompt``, or if nothing would use it: on pipelines with ``true_cfg_scale`` (Flux,
    Qwen-Image) unless it is above 1, on the others unless ``guidance_scale`` is above 1."""
    num_inference_steps: StrictInt | None = Field(default=None, ge=1)
    """Extension. At most ``--max-inference-steps``. Unset: the steps of ``quality`` (by default the pipeline's
    own)."""
    guidance_scale: Annotated[float | None, Sampling()] = Field(default=None, ge=0.0, le=100.0)
    """Extension. [Ignored](#ignored-fields-and---strict-fields) if the pipeline takes no ``guidance_scale``, or has
    no guidance embedding to use it on (FLUX.1-schnell, Qwen-Image: they guide with ``true_cfg_scale``). Unset: the
    pipeline's default."""
    true_cfg_scale: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, ge=0.0, le=100.0)
    """Extension. True classifier-free guidance with ``negative_prompt``, on pipelines that take it (Flux,
    Qwen-Image, Kontext); [ignored](#ignored-fields-and---strict-fields) elsewhere, and above 1 without a
    ``negative_prompt``, where it would do nothing.
    Unset: the pipeline's default."""
    flow_shift: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, gt=0.0, le=100.0)
    """Extension. The timestep shift of a flow-matching scheduler with a fixed one (SD3, Wan; sets its ``shift``,
    or ``flow_shift`` for UniPC / DPM-Solver with flow sigmas) for this request alone;
    [ignored](#ignored-fields-and---strict-fields) where the scheduler shifts by image size (FLUX.1's own folders) or
    is not flow matching (SD, SDXL). Unset: the scheduler's."""
    max_sequence_length: Annotated[StrictInt | None, Sampling(extra_args=True)] = Field(default=None, ge=1)
    """Extension. The prompt's tokens for the T5-style text encoder of Flux, SD3, Wan and Qwen-Image (cut or padded to
    it): fewer is faster. At most what the encoder takes (512 for Flux, SD3 and Wan; 1024 for Qwen-Image), else a 400
    naming the limit; ignored (a `Warning`, as every ignored field) by pipelines whose call takes none (SD, SDXL).
    Requests with different lengths run in different batches. Unset: the pipeline's (512 for Flux and Wan, 256 for
    SD3)."""
    seed: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=0, le=MAX_SEED)
    """Extension. The same seed gives the same image, alone or batched (up to floating-point rounding). Unset: a
    random one."""
    lora: LoraField = None
    """Extension. LoRA adapters to apply: ``{"name": ADAPTER, "scale": 1.0}``, or a list to stack adapters; scale
    −8 to 8 ([lora.md](lora.md)). ``model: "<adapter>"`` selects one at scale 1. Also on edits (a form field holding
    the JSON) and videos."""
    cache: Annotated[bool, Sampling()] = True
    """Extension. Use the server's step cache (``--cache-backend``); ``false``: every block runs at every step."""
    enhance_prompt: Annotated[bool | None, Sampling()] = None
    """Extension. Whether the deploy's ``llm`` stage rewrites the prompt first, answered as ``revised_prompt``
    ([prompt enhancement](#prompt-enhancement-enhance_prompt-and-revised_prompt)): unset, if there is one; ``false``
    skips it; ``true`` without an ``llm`` stage is a 400 naming ``enhance_prompt``. Also on edits, videos and
    chat."""
    priority: Annotated[StrictInt, Sampling()] = Field(default=0, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    """Extension (vLLM's): with ``--scheduling-policy priority`` a lower value starts sooner, arrival order among
    equals ([priority scheduling](#priority-scheduling)); in step mode it preempts worse running requests at a step
    boundary (they resume where they left), in request mode a running batch is not interrupted. Under ``fcfs`` (the
    default) any value but 0 is a 400 naming ``priority`` and the flag. Also on edits, videos and chat."""

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
    apart). Form values arrive as text, so its integers are parsed from it (`model_validate`)."""

    size: str = "auto"
    """``WIDTHxHEIGHT`` in pixels, or ``auto``: the first image's size, each side rounded down to the multiple the
    model needs. The image (and mask) is resized to ``size`` (Lanczos) for image-to-image and inpainting; an
    instruction-edit model sizes its input itself."""
    # Extensions.
    strength: Annotated[float | None, Sampling()] = Field(default=None, gt=0.0, le=1.0)
    """Extension: how far the image is noised. The request runs ``int(num_inference_steps × strength)`` steps; a
    strength that leaves none is a 400. [Ignored](#ignored-fields-and---strict-fields) by models that take no strength
    (instruction-edit models). Unset: 0.6 for image-to-image, 1.0 for inpainting."""

    input_fidelity: Annotated[
        Literal["high", "low"] | None,
        Ignored("the served model has no input-fidelity setting: strength sets how far an edit departs from its image"),
    ] = None
    """OpenAI's: accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``); ``strength`` is how
    far an edit departs from its input image here."""
    markup: Annotated[str | None, Ignored("the served model takes no markup image")] = None
    """OpenAI's (a file): accepted and [ignored](#ignored-fields-and---strict-fields) (a ``Warning``); its file is
    not read."""

    _lora_from_form = field_validator("lora", mode="before")(lora_from_form)

    @classmethod
    def model_validate(cls, obj: Any, *, strict: bool | None = False, **kwargs: Any) -> ImageEditRequest:
        """Not strict: the integers a JSON body must give as JSON integers (``StrictInt``) are parsed from a form's
        text, with the same bounds."""
        return super().model_validate(obj, strict=strict, **kwargs)


class ImageReference(BaseModel):
    """An input image by reference, as OpenAI's API gives one: ``{"image_url": URL}``."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    image_url: str = Field(min_length=1)
    """A data URL (``data:image/png;base64,...``), an ``http(s)`` URL the server fetches (from the hosts
    ``--allowed-media-domains`` lists; unset, any host with only public addresses), or a ``file://`` URL of a file
    under ``--allowed-local-media-path``."""


class ImageEditJSONBody(ImageEditRequest):
    """``POST /v1/images/edits`` as OpenAI's JSON body: the form's fields, with the images by reference. The shape
    its OpenAPI schema shows; the route takes ``images`` and ``mask`` out with `media.edit_references` (whose
    refusals name the field as OpenAI's do) and reads the rest as an `ImageEditRequest`."""

    images: list[ImageReference] = Field(min_length=1, max_length=MAX_INPUT_IMAGES)
    """The images to edit (the form's ``image`` / ``image[]`` files)."""
    mask: ImageReference | None = None
    """OpenAI's mask (the form's ``mask`` file): a PNG whose fully transparent pixels mark what to repaint."""


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    log_probs: list[float] | None = None
    """Extension: with ``logprobs``, the log-probability of each stochastic step that made the image."""


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


class VideoGenerationRequest(RolloutFields):
    """``POST /v1/videos`` (JSON or form fields); unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    prompt: str = Field(min_length=1)
    """At most ``--max-prompt-length`` characters."""
    model: ModelName = None
    """One of the served model names (or a LoRA adapter's, as for images). Unset or empty: the served model."""
    size: str | None = None
    """``WIDTHxHEIGHT`` in pixels: each side a multiple of 16 for Wan, ``width × height`` at most
    ``--max-image-pixels``. Unset: the model's default (or ``width`` and ``height``)."""
    width: int | None = Field(default=None, ge=1)
    """Extension (upstream vllm-omni's): the width in pixels, given with ``height`` instead of ``size``; with
    ``size`` too, 400 naming them."""
    height: int | None = Field(default=None, ge=1)
    """Extension: the height in pixels, given with ``width`` instead of ``size``."""
    seconds: float | None = Field(default=None, gt=0, le=600)
    """Duration at ``fps`` (OpenAI sends it as a string such as ``"4"``): ``num_frames`` becomes the nearest valid
    count (4k + 1 for Wan)."""
    num_frames: int | None = Field(default=None, ge=1)
    """Extension: the frame count itself, instead of ``seconds``; 4k + 1 for Wan; at most ``--max-video-frames``.
    Unset: the model's default (81 for Wan)."""
    fps: Annotated[int | None, Sampling()] = Field(default=None, ge=1, le=240)
    """Extension: the frame rate of the MP4. Unset: 16."""
    negative_prompt: Annotated[str | None, Sampling()] = None
    """Extension, as for images: at most ``--max-prompt-length`` characters; on Wan it acts only with
    ``guidance_scale`` above 1, else it is [ignored](#ignored-fields-and---strict-fields)."""
    num_inference_steps: Annotated[int | None, Sampling()] = Field(default=None, ge=1)
    """Extension: at most ``--max-inference-steps``. Unset: the pipeline's default."""
    guidance_scale: Annotated[float | None, Sampling()] = Field(default=None, ge=0.0, le=100.0)
    """Extension, as for images (Wan's is true classifier-free guidance). Unset: the pipeline's default."""
    true_cfg_scale: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, ge=0.0, le=100.0)
    """Extension: true classifier-free guidance with ``negative_prompt``, for pipelines that take it (Wan's
    ``guidance_scale`` is true guidance already: it ignores this). Unset: the pipeline's default."""
    flow_shift: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, gt=0.0, le=100.0)
    """Extension, as for images: the timestep shift of the scheduler (Wan's ``flow_shift``). Unset: the
    scheduler's."""
    max_sequence_length: Annotated[int | None, Sampling(extra_args=True)] = Field(default=None, ge=1)
    """Extension, as for images: the prompt's tokens for the text encoder, at most 512 for Wan. Unset: the
    pipeline's (512 for Wan)."""
    guidance_scale_2: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, ge=0.0, le=100.0)
    """Extension for two-expert Wan 2.2 folders (``transformer_2`` and ``boundary_ratio`` in
    ``model_index.json``): the low-noise expert's guidance. A one-expert folder
    [ignores](#ignored-fields-and---strict-fields) it; step mode refuses two-expert folders at start-up. Unset:
    ``guidance_scale``."""
    boundary_ratio: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, gt=0.0, lt=1.0)
    """Extension for two-expert Wan 2.2 folders: where the low-noise expert takes over, as a fraction of the
    training timesteps. A one-expert folder [ignores](#ignored-fields-and---strict-fields) it. Unset: the folder's."""
    seed: Annotated[int | None, Sampling()] = Field(default=None, ge=0, le=MAX_SEED)
    """Extension, as for images. Unset: a random one."""
    lora: LoraField = None
    """Extension: LoRA adapters to apply, as for images ([lora.md](lora.md)); JSON text in a form."""
    cache: Annotated[bool, Sampling()] = True
    """Extension: use the server's step cache (``--cache-backend``); ``false``: every block runs at every step."""
    enhance_prompt: Annotated[bool | None, Sampling()] = None
    """Extension, as for images: let the deploy's ``llm`` stage rewrite the prompt (the job's ``revised_prompt``);
    ``false`` skips it, ``true`` without an ``llm`` stage is a 400."""
    priority: Annotated[int, Sampling()] = Field(default=0, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    """Extension (vLLM's), as for images: with ``--scheduling-policy priority`` a lower value starts sooner; under
    ``fcfs`` any value but 0 is a 400."""
    partial_images: Annotated[int, Sampling()] = Field(default=0, ge=0, le=MAX_PARTIAL_IMAGES)
    """Extension: previews of the running job, each shown by ``GET /v1/videos/{id}/content?variant=thumbnail``
    while it runs; the job's ``preview_index`` counts them."""

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


class VideoRemixRequest(VideoGenerationRequest):
    """``POST /v1/videos/{video_id}/remix`` (JSON): OpenAI's ``prompt``, and the extensions of a new video job;
    the video's shape (``size``, ``width``, ``height``, ``seconds``, ``num_frames``, ``fps``) follows the source
    video, and the route refuses it."""

    strength: Annotated[float | None, Sampling()] = Field(default=None, gt=0.0, le=1.0)
    """Extension: how far the source video is noised before it is denoised with the new prompt (1: nothing of it
    is kept). Unset: 0.8 (diffusers' video-to-video default)."""


SHAPE_FIELDS = ("size", "width", "height", "seconds", "num_frames", "fps")
"""The fields of a video job that a remix takes from its source video (`VideoRemixRequest`)."""


class AudioGenerationRequest(BaseModel):
    """``POST /v1/audio/generate``, upstream vllm-omni's request for its audio diffusion models (Stable Audio): text to
    a sound clip, answered with the audio file itself. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: str = Field(min_length=1)
    """The sound to make, described. At most ``--max-prompt-length`` characters."""
    model: ModelName = None
    """One of the served model names (or a LoRA adapter's, as for images). Unset or empty: the served model."""
    response_format: AudioFormat = "wav"
    """The file format of the answer ([audio.md](audio.md)): its ``Content-Type``, and its sample rate in
    ``X-Sample-Rate`` (``opus`` is always 48 kHz; ``mp3`` and ``aac`` take the next rate up where they lack the
    model's). ``wav`` by default, as upstream vllm-omni."""
    audio_length: Annotated[float | None, Sampling()] = None
    """Seconds of audio: more than 0, and at most what the model makes from ``audio_start`` (Stable Audio Open 1.0:
    47.55 s), else a 400 naming the range. Unset: the model's longest clip from ``audio_start``."""
    audio_start: Annotated[float | None, Sampling()] = 0.0
    """Where the clip starts, in seconds, for models conditioned on a start (Stable Audio): 0 or more, below the
    longest clip; other models take 0 only."""
    negative_prompt: Annotated[str | None, Sampling()] = None
    """What the audio should not sound like. At most ``--max-prompt-length`` characters;
    [ignored](#ignored-fields-and---strict-fields) unless ``guidance_scale`` is above 1."""
    guidance_scale: Annotated[float | None, Sampling()] = Field(default=None, ge=0.0, le=100.0)
    """Classifier-free guidance. Unset: the pipeline's default (7 for Stable Audio)."""
    num_inference_steps: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=1)
    """At most ``--max-inference-steps``. Unset: the pipeline's default (100 for Stable Audio)."""
    seed: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=0, le=MAX_SEED)
    """The same seed gives the same audio, alone or batched (up to floating-point rounding). Unset: a random one."""
    n: Annotated[StrictInt, Sampling("num_outputs_per_prompt")] = Field(default=1, ge=1, le=10)
    """Extension: waveforms for the prompt, on pipelines that take ``num_waveforms_per_prompt`` (Stable Audio). More
    than 1 answers a zip (``application/zip``) of ``audio_0.<format>``, ``audio_1.<format>``, ..."""
    speed: float | None = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    """Upstream vllm-omni's: play the audio this many times as fast, at the same pitch (FFmpeg's ``atempo``): the
    answer is about ``audio_length / speed`` seconds long. Unset: 1."""
    stream_format: Literal["audio"] | None = "audio"
    """Upstream vllm-omni's: the answer is the audio file itself (``audio``); its ``sse`` is not served (a 400 naming
    the field), as upstream refuses it."""
    lora: LoraField = None
    """Extension: LoRA adapters to apply, as for images ([lora.md](lora.md))."""
    cache: Annotated[bool, Sampling()] = True
    """Extension: use the server's step cache (``--cache-backend``); ``false``: every block runs at every step."""
    priority: Annotated[StrictInt, Sampling()] = Field(default=0, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    """Extension (vLLM's), as for images: with ``--scheduling-policy priority`` a lower value starts sooner; under
    ``fcfs`` any value but 0 is a 400."""

    @property
    def prompt(self) -> str:
        """``input``, under the name the shared checks and the engine give a prompt."""
        return self.input


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


VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
"""Where a video job stands (`VideoObject.status`)."""


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    status: VideoStatus
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
    log_probs: list[float] | None = None
    """Extension: with ``logprobs``, the log-probability of each stochastic step that made the video."""
    remixed_from_video_id: str | None = None
    """The video a remix was made from (``POST /v1/videos/{video_id}/remix``), as OpenAI's."""


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


MAX_SPEECH_INPUT = 4096
"""The longest ``input`` of ``POST /v1/audio/speech``, in characters (OpenAI's limit)."""


class VoiceId(BaseModel):
    """A voice by id, as OpenAI's custom voices are given: ``{"id": "..."}``; here, any voice the model speaks."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    id: str = Field(min_length=1)
    """The voice's name, as ``voice`` gives it as a string."""


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech``, OpenAI's text to speech, answered with the audio as it is made. Unknown fields are
    rejected."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: str = Field(min_length=1, max_length=MAX_SPEECH_INPUT)
    """The text to speak: 1 to 4,096 characters."""
    model: ModelName = None
    """One of the served model names, or one of OpenAI's speech models (``tts-1``, ``tts-1-hd``,
    ``gpt-4o-mini-tts*``), which name the served model too. Unset or empty: the served model."""
    voice: str | VoiceId | None = None
    """The voice: one of the model's (``GET /v1/audio/voices``), or one of OpenAI's (``alloy``, ``ash``, ...), which
    the model's family maps to one of its own; ``{"id": VOICE}`` is the same as ``VOICE``. A model of a single voice
    takes any name. Else 400 naming ``voice``. Unset: the model's default voice."""
    instructions: Annotated[str | None, Sampling()] = Field(default=None, max_length=MAX_SPEECH_INPUT)
    """How to speak (a style prompt), for families that take one; the others
    [ignore](#ignored-fields-and---strict-fields) it (a ``Warning``)."""
    response_format: AudioFormat = "mp3"
    """The audio's format ([audio.md](audio.md)), each of them streamed: its ``Content-Type``, and its sample rate in
    ``X-Sample-Rate`` (``opus`` is always 48 kHz; ``mp3`` and ``aac`` take the next rate up where they lack the
    model's). ``mp3`` by default, as OpenAI."""
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    """Play the speech this many times as fast, at the same pitch (FFmpeg's ``atempo``, streamed too)."""
    stream_format: Literal["audio", "sse"] = "audio"
    """``audio``: the answer is the audio file, its bytes sent as they are made; ``sse``: server-sent events,
    ``speech.audio.delta`` with the next bytes in base64, then ``speech.audio.done`` with the usage."""
    # Extensions.
    seed: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=0, le=MAX_SEED)
    """Extension: the talker's sampling seed; the same seed speaks the same audio, alone or batched. Unset: a random
    one."""
    max_new_tokens: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=1)
    """Extension (upstream vllm-omni's): the most codec tokens the talker generates, which bounds the audio's length.
    Unset: the family's limit."""
    initial_codec_chunk_frames: Annotated[StrictInt | None, Sampling()] = Field(default=None, ge=1)
    """Extension (upstream vllm-omni's): codec frames in the first chunk decoded; fewer is a sooner first audio.
    Unset: the server's chunk-sizing policy."""
    priority: Annotated[StrictInt, Sampling()] = Field(default=0, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND)
    """Extension (vLLM's), as for images: with ``--scheduling-policy priority`` a lower value starts sooner; under
    ``fcfs`` any value but 0 is a 400."""

    @property
    def prompt(self) -> str:
        """``input``, under the name the shared checks and the engine give a prompt."""
        return self.input

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_is_a_name_or_an_id(cls, voice: Any) -> Any:
        if isinstance(voice, dict) and set(voice) != {"id"}:  # else pydantic's error is about a string
            raise ValueError('voice must be a voice name or {"id": "<voice name>"}')
        return voice

    @property
    def voice_name(self) -> str | None:
        """``voice``, a string or ``{"id": ...}``, as its name."""
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice


class SpeechUsage(BaseModel):
    """OpenAI's ``usage`` of a speech answer (``speech.audio.done``)."""

    input_tokens: int
    """The tokens of the talker's prompt: the text in the family's format, with its voice."""
    output_tokens: int
    """The codec tokens the talker generated."""
    total_tokens: int


class SpeechAudioDeltaEvent(BaseModel):
    """OpenAI's ``speech.audio.delta`` event: the next bytes of the audio file, in base64."""

    type: Literal["speech.audio.delta"] = "speech.audio.delta"
    audio: str


class SpeechAudioDoneEvent(BaseModel):
    """OpenAI's ``speech.audio.done`` event: the audio is complete."""

    type: Literal["speech.audio.done"] = "speech.audio.done"
    usage: SpeechUsage


class VoiceList(BaseModel):
    """``GET /v1/audio/voices``: upstream vllm-omni's shape (``voices``, ``uploaded_voices``), with the OpenAI names
    that map to them."""

    voices: list[str]
    """The served model's voices; empty for a model of a single voice, which takes any name."""
    uploaded_voices: list[dict[str, Any]] = Field(default_factory=list)
    """Upstream's voices uploaded for cloning: none here (no family clones a voice)."""
    default_voice: str | None
    """The voice of a request that gives none."""
    openai_voices: dict[str, str]
    """Each OpenAI voice name this model takes, and the model's voice it speaks in."""
