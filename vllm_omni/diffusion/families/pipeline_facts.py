"""What a pipeline's class, call signature and scheduler say about the requests it takes, read by `ModelCard` when
a pipeline loads: the call arguments vllm-omni sets itself, the pipelines that need or take several input images,
the scheduler's shift key, the text encoder's sequence limit, the default size and the image- and video-conditioned
variants of a text-to-image or text-to-video pipeline; how an audio pipeline takes a clip's length and start
(`AUDIO_PIPELINES`) and at what rate it makes it; and whether it batches requests (`check_batchable`)."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni.sampling_params import ImageTask


@dataclass(frozen=True)
class AudioArgs:
    """How an audio pipeline's call takes a clip's length and start (`OmniDiffusionSamplingParams.audio_length`,
    ``audio_start``), and the longest clip it makes: its entry of `AUDIO_PIPELINES`."""

    length: str
    """Its argument for the clip's length in seconds; with ``start``, for the clip's end (start + length)."""
    start: str | None = None
    """Its argument for where the clip starts, in seconds; ``None``: its clips start at 0."""
    longest: Callable[[Any], float] | None = None
    """The longest clip it makes, in seconds, read off the loaded pipeline (with ``start``: the latest end);
    ``None``: its code states no bound."""
    per_row: tuple[str, ...] = ()
    """Arguments its call takes one per prompt when the prompt is a list (the request's ``extra_args`` value, else
    the call's default, repeated): diffusers 0.42's ACE-Step indexes ``lyrics`` per prompt, a string included."""


def _stable_audio_longest(pipeline) -> float:
    """Stable Audio denoises a latent of a fixed length (its transformer's ``sample_size``) and crops the clip out
    of its decode: ``sample_size`` × the VAE's hop length samples, at the VAE's rate (47.55 s for Stable Audio
    Open 1.0)."""
    return pipeline.transformer.config.sample_size * pipeline.vae.hop_length / pipeline.vae.config.sampling_rate


AUDIO_PIPELINES: dict[str, AudioArgs] = {
    "StableAudioPipeline": AudioArgs("audio_end_in_s", start="audio_start_in_s", longest=_stable_audio_longest),
    "StableAudio3Pipeline": AudioArgs("duration"),
    # diffusers clamps a longer duration to max_wav_duration (30 s) without a word: refused above it instead
    "LongCatAudioDiTPipeline": AudioArgs("audio_duration_s", longest=lambda pipeline: pipeline.max_wav_duration),
    "AceStepPipeline": AudioArgs("audio_duration", per_row=("lyrics",)),
    "AudioLDM2Pipeline": AudioArgs("audio_length_in_s"),
}
"""The audio pipelines by class: the call arguments a request's ``audio_length`` and ``audio_start`` become. An audio
pipeline missing here serves at its own default length, and refuses ``audio_length``."""


def returns_audio(pipeline_class: type) -> bool:
    """Whether a pipeline's call makes audio: it returns diffusers' ``AudioPipelineOutput`` (``.audios``)."""
    return "AudioPipelineOutput" in str(inspect.signature(pipeline_class.__call__).return_annotation)


def sample_rate(pipeline) -> int | None:
    """The rate of an audio pipeline's waveforms in Hz: its own ``sample_rate`` (LongCat-AudioDiT, ACE-Step), its
    vocoder's (AudioLDM 2), else its VAE's ``sampling_rate`` (Stable Audio's Oobleck); ``None`` where none says."""
    rate = getattr(pipeline, "sample_rate", None)
    for component in ("vocoder", "vae"):
        if rate is None:
            rate = getattr(getattr(getattr(pipeline, component, None), "config", None), "sampling_rate", None)
    return int(rate) if isinstance(rate, int | float) else None


RESERVED_ARGS = frozenset(
    {
        "prompt",
        "negative_prompt",
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "generator",
        "output_type",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "num_waveforms_per_prompt",
        "num_frames",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "return_dict",
        "latents",
        "prompt_embeds",
        "image",
        "mask_image",
        "video",
        "strength",
    }
    | {arg for args in AUDIO_PIPELINES.values() for arg in (args.length, args.start) if arg is not None}
)
"""Arguments the runner sets itself; ``extra_args`` may not carry them."""

TWO_EXPERT_ARGS = ("guidance_scale_2", "boundary_ratio")
"""``extra_args`` of two-expert Wan 2.2 folders only: the low-noise expert's guidance, and where it takes over."""

IMAGE_REQUIRED = frozenset({"QwenImageEditPipeline", "QwenImageEditPlusPipeline"})
"""Instruction-edit pipelines whose ``image`` defaults to ``None`` but that cannot run without one."""
SEVERAL_IMAGES = frozenset({"QwenImageEditPlusPipeline"})
"""Pipelines that take several input images for one prompt."""
ONE_IMAGE_PER_CALL = frozenset({"QwenImageEditPlusPipeline", "WanImageToVideoPipeline"})
"""Pipelines whose call takes the input images of one request only (one prompt's list; one image for all rows)."""
ALONE_WITH_IMAGES = "a request with input images runs alone: the pipeline's call takes one request's images only"
"""Why a request with images to a pipeline of `ONE_IMAGE_PER_CALL` gets a batch key of its own (`roles`)."""


def flow_shift_key(scheduler) -> str | None:
    """The config key that sets ``scheduler``'s fixed timestep shift: ``flow_shift`` (UniPC and DPM-Solver with
    flow sigmas, as Wan folders have), ``shift`` (flow matching's Euler without shifting by image size: SD3, and
    the tiny Wan); ``None`` for schedulers without one (Flux's shifts by image size; SD's are not flow matching)."""
    config = getattr(scheduler, "config", None) or {}
    if config.get("use_dynamic_shifting"):
        return None
    if "flow_shift" in config and config.get("use_flow_sigmas"):
        return "flow_shift"
    if "shift" in config and "FlowMatch" in type(scheduler).__name__:
        return "shift"
    return None


_SEQUENCE_CHECK = re.compile(r"max_sequence_length\s*>\s*(\d+)")
"""How diffusers' ``check_inputs`` states the bound: ``if max_sequence_length is not None and max_sequence_length >
512: raise ValueError(...)``."""


def sequence_limit(pipeline_class: type[Any], defaults: Mapping[str, Any]) -> int | None:
    """The largest ``max_sequence_length`` a pipeline's call takes: the bound its own ``check_inputs`` raises above
    (512 for Flux and SD3, 1024 for Qwen-Image), else its call's default (Wan's 512, the text length its transformer
    was trained with); ``None`` when its call takes none (or neither says)."""
    if "max_sequence_length" not in inspect.signature(pipeline_class.__call__).parameters:
        return None
    try:
        source = inspect.getsource(pipeline_class.check_inputs)
    except (AttributeError, OSError, TypeError):  # no check_inputs, or no source to read
        source = ""
    match = _SEQUENCE_CHECK.search(source)
    if match:
        return int(match[1])
    default = defaults.get("max_sequence_length")
    return default if isinstance(default, int) and not isinstance(default, bool) else None


def default_size(pipeline, defaults: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``(height, width)`` a pipeline makes when a call gives none: its call's defaults, else its sample size
    (``default_sample_size``, or its denoiser's ``sample_size``) times its VAE's factor, else what its modular
    pipeline's defaults say (Z-Image's call sets 1024 inside), else the size its call works out from its default
    aspect ratio (HunyuanVideo 1.5); ``None`` when none of them says."""
    height, width = defaults.get("height"), defaults.get("width")
    if isinstance(height, int) and isinstance(width, int):
        return height, width
    sample = getattr(pipeline, "default_sample_size", None)
    if sample is None:
        denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
    scale = getattr(pipeline, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(scale, int):
        return (sample * scale,) * 2
    return _modular_default_size(pipeline) or _aspect_default_size(pipeline)


class _AsModular:
    """A loaded pipeline seen as its modular pipeline (``modular``): that class's properties, read over the
    pipeline's own attributes and components."""

    def __init__(self, modular: type, pipeline):
        self._modular, self._pipeline = modular, pipeline

    def __getattr__(self, name: str) -> Any:
        found = inspect.getattr_static(self._modular, name, None)
        return found.__get__(self) if isinstance(found, property) else getattr(self._pipeline, name)


def _modular_default_size(pipeline) -> tuple[int, int] | None:
    """``default_height`` and ``default_width`` of the pipeline's modular counterpart in diffusers (``ZImagePipeline``
    → ``ZImageModularPipeline``), read over its components; ``None`` where there is none or it says none."""
    import diffusers

    name = type(pipeline).__name__.removesuffix("Pipeline") + "ModularPipeline"
    modular = getattr(diffusers, name, None)
    if not isinstance(modular, type) or not isinstance(inspect.getattr_static(modular, "default_height", 0), property):
        return None
    view = _AsModular(modular, pipeline)
    try:
        height, width = view.default_height, view.default_width
    except (AttributeError, TypeError, ValueError):  # a property needing a component this pipeline lacks
        return None
    return (height, width) if isinstance(height, int) and isinstance(width, int) else None


def _aspect_default_size(pipeline) -> tuple[int, int] | None:
    """The size a call without one works out from the pipeline's default aspect ratio and target size, with its
    processor's ``calculate_default_height_width`` (HunyuanVideo 1.5's 16:9 bucket nearest its ``target_size``)."""
    processor = getattr(pipeline, "video_processor", None) or getattr(pipeline, "image_processor", None)
    ratio, target = getattr(pipeline, "default_aspect_ratio", None), getattr(pipeline, "target_size", None)
    if ratio is None or target is None or processor is None or not hasattr(processor, "calculate_default_height_width"):
        return None
    height, width = processor.calculate_default_height_width(ratio[1], ratio[0], target)
    return int(height), int(width)


def min_steps(scheduler, most: int = 4) -> int:
    """The fewest inference steps whose schedule ``scheduler`` makes finite, tried on a fresh copy of it up to
    ``most``: 2 for flow matching stretched to a terminal sigma (``shift_terminal``: Qwen-Image, LTX), whose one-step
    schedule is 0 / 0; 1 for the others, and where it cannot tell."""
    import warnings

    import numpy as np

    if scheduler is None or not hasattr(scheduler, "set_timesteps") or not hasattr(scheduler, "from_config"):
        return 1
    shifted = {"mu": 0.0} if scheduler.config.get("use_dynamic_shifting") else {}  # any image size will do
    for steps in range(1, most + 1):
        probe = type(scheduler).from_config(scheduler.config)
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                probe.set_timesteps(steps, **shifted)
        except Exception:  # noqa: BLE001 - a scheduler that wants more than a step count: no bound known
            return 1
        schedule = getattr(probe, "sigmas", None)
        schedule = probe.timesteps if schedule is None else schedule
        if np.isfinite(np.asarray(schedule, dtype=np.float64)).all():
            return steps
    return 1


def image_variants(pipeline_name: str) -> dict[ImageTask, type]:
    """The image-to-image, inpainting and video-to-video pipeline classes of a text-to-image (or text-to-video)
    class, which ``from_pipe`` builds on its components: diffusers' AutoPipeline tables for images, and for videos
    the class named as diffusers names them (``WanPipeline`` → ``WanVideoToVideoPipeline``)."""
    from diffusers.pipelines.auto_pipeline import (
        AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
        AUTO_INPAINT_PIPELINES_MAPPING,
        AUTO_TEXT2IMAGE_PIPELINES_MAPPING,
    )

    variants: dict[ImageTask, type] = {}
    video = video_variant(pipeline_name)
    if video is not None:
        variants["video"] = video
    family = next((k for k, v in AUTO_TEXT2IMAGE_PIPELINES_MAPPING.items() if v.__name__ == pipeline_name), None)
    tables: dict[ImageTask, Mapping[str, type]] = {
        "image": AUTO_IMAGE2IMAGE_PIPELINES_MAPPING,
        "inpaint": AUTO_INPAINT_PIPELINES_MAPPING,
    }
    if family is None:
        return variants
    return variants | {task: table[family] for task, table in tables.items() if family in table}


def keeps_everything(pipeline, variant: type) -> bool:
    """Whether ``variant.from_pipe(pipeline)`` keeps all that the loaded pipeline runs with: each of its components
    and each setting of its config (not a two-expert Wan 2.2's ``transformer_2`` and ``boundary_ratio``, which
    ``WanVideoToVideoPipeline`` has not: it would run the high-noise expert alone)."""
    takes = set(inspect.signature(variant).parameters)  # its __init__'s
    components = {name for name, component in pipeline.components.items() if component is not None}
    config = getattr(pipeline, "config", None) or {}
    settings = {
        name
        for name, value in config.items()
        if not name.startswith("_") and name not in pipeline.components and value not in (None, False)
    }
    return components | settings <= takes


def video_variant(pipeline_name: str) -> type | None:
    """diffusers' video-to-video pipeline of a text-to-video class (``WanPipeline`` → ``WanVideoToVideoPipeline``,
    ``CogVideoXPipeline`` → ``CogVideoXVideoToVideoPipeline``): the class its name gives, if diffusers has one whose
    call takes a ``video``; ``None`` otherwise."""
    import diffusers

    if not pipeline_name.endswith("Pipeline") or "VideoToVideo" in pipeline_name:
        return None
    name = pipeline_name.removesuffix("Pipeline") + "VideoToVideoPipeline"
    try:
        found = getattr(diffusers, name, None)
    except (ImportError, RuntimeError):  # a lazy class whose optional dependency is missing
        return None
    if not isinstance(found, type) or "video" not in inspect.signature(found.__call__).parameters:
        return None
    return found


def schedule_index(scheduler, timestep) -> int:
    """Where ``timestep`` is in the scheduler's schedule when its ``step`` is called with it (request mode, before
    the scheduler moves on)."""
    index = getattr(scheduler, "step_index", None)
    if index is not None:
        return index
    begin = getattr(scheduler, "begin_index", None)
    if begin is not None:
        return begin
    if hasattr(scheduler, "index_for_timestep"):
        return int(scheduler.index_for_timestep(timestep))
    return 0


def _accepts_list(parameter: inspect.Parameter | None) -> bool:
    """Whether a ``__call__`` parameter is annotated to take a list (``List[str]``, ``list[Generator]``...)."""
    if parameter is None:
        return False
    pending = [parameter.annotation]
    while pending:
        annotation = pending.pop()
        if isinstance(annotation, str):
            if "list" in annotation.lower():
                return True
            continue
        if typing.get_origin(annotation) is list or annotation is list:
            return True
        pending.extend(typing.get_args(annotation))
    return False


def check_batchable(pipeline_cls: type, max_num_seqs: int) -> None:
    """Fail at start-up when ``max_num_seqs > 1`` but the pipeline cannot take one list of prompts and generators."""
    if max_num_seqs <= 1:
        return
    params = inspect.signature(pipeline_cls.__call__).parameters
    missing = [name for name in ("prompt", "generator") if not _accepts_list(params.get(name))]
    if missing:
        raise ValueError(
            f"{pipeline_cls.__name__} cannot batch requests: its __call__ does not take a list for "
            f"{' and '.join(missing)}. Set max_num_seqs=1 (--max-num-seqs 1) to serve it one request at a time."
        )
