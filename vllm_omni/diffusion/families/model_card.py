"""`ModelCard`: what admitting a request needs to know of a pipeline (its call arguments and their defaults, sizes,
kind), read once when the pipeline loads, and the completion of sampling parameters from it.

A card is plain data, without torch or weights: it crosses to the driver with a Ray replica's `ReplicaInfo`, so
every stage admits a request where the request arrives, with no call to a replica (`roles.StageAdmission`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.families.pipeline_facts import (
    AUDIO_PIPELINES,
    IMAGE_REQUIRED,
    ONE_IMAGE_PER_CALL,
    RESERVED_ARGS,
    SEVERAL_IMAGES,
    TWO_EXPERT_ARGS,
    default_size,
    flow_shift_key,
    image_variants,
    keeps_everything,
    min_steps,
    returns_audio,
    sample_rate,
    sequence_limit,
)
from vllm_omni.diffusion.features.sde import SDE_ARGS, steps_flow_euler
from vllm_omni.errors import SamplingParamsError
from vllm_omni.outputs import IgnoredField, OutputKind
from vllm_omni.sampling_params import (
    DEFAULT_VIDEO_FPS,
    MAX_INPUT_IMAGES,
    SPEECH_FIELDS,
    ImageTask,
    OmniDiffusionSamplingParams,
)

_PLAIN = (int, float, str, bool)
ENGINE_ARGS = SDE_ARGS | {"flow_shift"}
"""``extra_args`` keys the engine applies itself: no pipeline call takes them."""

OUTPUTS_ARGS = ("num_images_per_prompt", "num_videos_per_prompt", "num_waveforms_per_prompt")
"""The call arguments of outputs per prompt, by what a pipeline makes."""

DEFAULT_STRENGTH: dict[ImageTask, float] = {"image": 0.6, "inpaint": 1.0, "video": 0.8}
"""``strength`` of a request that gives none: keep much of the image when transforming it, repaint the masked
area from scratch when inpainting, and diffusers' default for video-to-video (a remix)."""


@dataclass(frozen=True)
class AudioCard:
    """What admission reads of an audio pipeline (`ModelCard.audio`): its rate, the longest clip it makes and the
    call arguments a request's clip becomes (its entry of `AUDIO_PIPELINES`, as plain data)."""

    sample_rate: int
    """The rate of its waveforms in Hz."""
    longest: float | None = None
    """The longest clip it makes in seconds (with a start argument: the latest end); ``None``: no bound known."""
    length_arg: str | None = None
    """Its call's argument for the clip's length (with ``start_arg``: for its end); ``None``: none known, and
    ``audio_length`` is refused."""
    start_arg: str | None = None
    """Its call's argument for the clip's start; ``None``: its clips start at 0."""
    default_length: float | None = None
    """The length of a clip a request gives none for: its call's default, else the longest (less the start);
    ``None``: the pipeline works it out (left to it)."""
    per_row: tuple[str, ...] = ()
    """Its call's arguments taken one per prompt (`AudioArgs.per_row`)."""

    @classmethod
    def of(cls, pipeline, pipeline_class: type, defaults: Mapping[str, Any]) -> AudioCard | None:
        """The audio facts of ``pipeline`` (as ``pipeline_class``); ``None`` for a pipeline that makes no audio."""
        rate = sample_rate(pipeline)
        if not returns_audio(pipeline_class) or rate is None:
            return None
        args = AUDIO_PIPELINES.get(pipeline_class.__name__)
        if args is None:
            return cls(rate)
        longest = None if args.longest is None else float(args.longest(pipeline))
        default = defaults.get(args.length) if args.start is None else None
        return cls(
            sample_rate=rate,
            longest=longest,
            length_arg=args.length,
            start_arg=args.start,
            default_length=float(default) if isinstance(default, int | float) else longest,
            per_row=args.per_row,
        )

    def call_args(self, length: float | None, start: float | None) -> dict[str, float]:
        """The pipeline's arguments for a clip of ``length`` seconds from ``start`` (complete parameters)."""
        if self.length_arg is None or length is None:
            return {}
        if self.start_arg is None:
            return {self.length_arg: length}
        start = start or 0.0
        return {self.start_arg: start, self.length_arg: start + length}


@dataclass(frozen=True)
class ModelCard:
    """A loaded pipeline's facts that admission reads (`ModelCard.of`)."""

    pipeline_name: str
    """Its class name, e.g. ``FluxPipeline``."""
    call_args: frozenset[str]
    """The names of its ``__call__`` arguments."""
    call_defaults: Mapping[str, Any]
    """The plain (number or string) defaults of its ``__call__`` arguments."""
    default_size: tuple[int, int] | None
    """``(height, width)`` it uses when none is given (`pipeline_facts.default_size`); ``None``: none."""
    size_multiple: int
    """Height and width must be multiples of this."""
    frame_multiple: int
    """A video's num_frames must be 1 more than a multiple of this: the VAE's temporal compression."""
    outputs_arg: str | None
    """Its argument for outputs per prompt (``num_images_per_prompt``, ``num_videos_per_prompt`` or
    ``num_waveforms_per_prompt``), if any."""
    latent_pixels: int = 8
    """Pixels per side of one position of its denoiser's input: the VAE's spatial factor, times 2 for transformer
    (DiT) pipelines, which pack or patch latents 2×2 (16 for Flux, SD3 and Qwen-Image; 8 for SD and SDXL)."""
    config_args: frozenset[str] = frozenset()
    """Settings of its pipeline's config that a request may give in ``extra_args`` (the runner sets them around
    its batch's call; they join the batch key with the rest): ``boundary_ratio`` of a two-expert Wan 2.2 folder."""
    flow_shift_key: str | None = None
    """The key of its noise scheduler's config that a request's ``flow_shift`` sets (`flow_shift_key`); ``None``:
    its scheduler has no fixed shift to set, and ``flow_shift`` is refused."""
    ignores_guidance_scale: bool = False
    """Whether its call takes ``guidance_scale`` that its denoiser has no embedding for, so that it does nothing: a
    transformer with ``guidance_embeds`` off (FLUX.1-schnell, Qwen-Image), which guides with ``true_cfg_scale``."""
    image_required: bool = False
    """Whether it needs an input image (image-to-image, inpainting, instruction-edit and image-to-video pipelines)."""
    max_images: int = 1
    """How many input images one request may give (when it takes ``image``)."""
    batches_images: bool = True
    """Whether one call takes a different input image per prompt; else a request with images runs alone (as one
    with an input video does: a video-to-video call encodes one video)."""
    flow_matching: bool = False
    """Whether its scheduler is a flow-matching one, whose image pipelines count the steps a strength keeps
    differently (`strength_offset`); diffusers' video-to-video pipelines count as the UNet ones, whatever their
    scheduler."""
    flow_euler: bool = False
    """Whether its scheduler steps flow matching's Euler, which stochastic sampling replaces (`sde.SDE_ARGS`)."""
    min_steps: int = 1
    """The fewest ``num_inference_steps`` whose noise schedule is finite (`pipeline_facts.min_steps`): 2 for a
    scheduler stretched to a terminal sigma (Qwen-Image, LTX), which divides 0 by 0 at one step."""
    max_sequence_length: int | None = None
    """The largest ``max_sequence_length`` (the prompt's tokens for its T5-style text encoder) its call takes
    (`sequence_limit`); ``None``: its call takes no ``max_sequence_length``."""
    audio: AudioCard | None = None
    """An audio pipeline's rate and clip arguments; ``None`` for image and video pipelines."""
    variants: Mapping[ImageTask, ModelCard] = field(default_factory=dict)
    """Cards of the pipelines it serves image tasks with (``image``: image-to-image, ``inpaint``; ``video``:
    video-to-video), built on its components with ``from_pipe``; empty for a pipeline that takes ``image`` itself
    or has no such variant."""

    @property
    def output(self) -> OutputKind:
        """What it makes, the one place every layer reads it (the output's field, the engine's metrics, the HTTP
        APIs' model checks): ``audio`` (its call returns diffusers' ``AudioPipelineOutput``), ``video`` (it takes
        ``num_frames``, or a ``video`` whose frames it keeps), else ``image``."""
        if self.audio is not None:
            return "audio"
        if "num_frames" in self.call_args or "video" in self.call_args:
            return "video"
        return "image"

    @property
    def default_steps(self) -> int:
        """``num_inference_steps`` of a request that gives none: its call default, else 50."""
        return self.call_defaults.get("num_inference_steps") or 50

    @property
    def noises_its_image(self) -> bool:
        """Whether its input image is the canvas it noises and denoises (image-to-image, inpainting: it takes
        ``strength``), rather than a condition it sizes and encodes itself (instruction edits, image-to-video)."""
        return "strength" in self.call_args

    @property
    def tasks(self) -> frozenset[ImageTask]:
        """What requests it serves: ``text`` (no input image), ``image``, ``inpaint``
        (`OmniDiffusionSamplingParams.task`)."""
        return self._own_tasks | frozenset(self.variants)

    @property
    def _own_tasks(self) -> frozenset[ImageTask]:
        if "mask_image" in self.call_args:  # an inpainting pipeline served as it is
            return frozenset({"inpaint"})
        if "video" in self.call_args:  # a video-to-video pipeline served as it is
            return frozenset({"video"})
        own: set[ImageTask] = {"image"} if "image" in self.call_args else set()
        return frozenset(own if self.image_required else own | {"text"})

    def for_task(self, task: ImageTask) -> ModelCard:
        """The card of the pipeline that serves ``task``; `SamplingParamsError` naming the field when none does."""
        if task in self.variants:
            return self.variants[task]
        if task in self._own_tasks:
            return self
        name = self.pipeline_name
        if task == "video":
            raise SamplingParamsError("video", f"{name} has no video-to-video variant: it cannot remix a video")
        if task == "inpaint":
            raise SamplingParamsError("mask_image", f"{name} cannot inpaint: it takes no mask_image")
        if "inpaint" in self._own_tasks:
            raise SamplingParamsError("mask_image", f"{name} inpaints: give an image and a mask_image")
        if task == "text":
            raise SamplingParamsError("image", f"{name} edits images: give an input image")
        raise SamplingParamsError("image", f"{name} takes no input image")

    @classmethod
    def of(cls, pipeline, pipeline_class: type | None = None) -> ModelCard:
        """The card of a loaded pipeline (or of ``pipeline_class`` built on its components by ``from_pipe``)."""
        pipeline_class = pipeline_class or type(pipeline)
        name = pipeline_class.__name__
        parameters = inspect.signature(pipeline_class.__call__).parameters
        defaults = {
            name: p.default
            for name, p in parameters.items()
            if p.default is not inspect.Parameter.empty and isinstance(p.default, _PLAIN)
        }
        # Latents are the VAE's spatial factor times smaller and packed or patched 2×2 by DiT pipelines; UNet
        # pipelines check multiples of 8 themselves.
        scale = getattr(pipeline, "vae_scale_factor", 0) or getattr(pipeline, "vae_scale_factor_spatial", 1)
        image = parameters.get("image")
        return cls(
            pipeline_name=name,
            call_args=frozenset(parameters),
            call_defaults=defaults,
            default_size=default_size(pipeline, defaults),
            size_multiple=max(8, 2 * int(scale)),
            frame_multiple=int(getattr(pipeline, "vae_scale_factor_temporal", 1) or 1),
            outputs_arg=next((n for n in OUTPUTS_ARGS if n in parameters), None),
            latent_pixels=int(scale) * (2 if "transformer" in pipeline.components else 1),
            config_args=frozenset({"boundary_ratio"})
            if getattr(pipeline, "transformer_2", None) is not None
            and getattr(pipeline, "config", {}).get("boundary_ratio") is not None
            else frozenset(),
            flow_shift_key=flow_shift_key(getattr(pipeline, "scheduler", None)),
            ignores_guidance_scale="guidance_scale" in parameters
            and "true_cfg_scale" in parameters  # FLUX.2 [klein] has no embedding either: its guidance_scale is CFG
            and getattr(getattr(getattr(pipeline, "transformer", None), "config", None), "guidance_embeds", None)
            is False,
            image_required=image is not None
            and (image.default is inspect.Parameter.empty or name in IMAGE_REQUIRED or "strength" in parameters),
            max_images=MAX_INPUT_IMAGES if name in SEVERAL_IMAGES else 1,
            batches_images=name not in ONE_IMAGE_PER_CALL and "video" not in parameters,
            flow_matching="FlowMatch" in type(getattr(pipeline, "scheduler", None)).__name__
            and "video" not in parameters,
            flow_euler=steps_flow_euler(getattr(pipeline, "scheduler", None)),
            min_steps=min_steps(getattr(pipeline, "scheduler", None)),
            max_sequence_length=sequence_limit(pipeline_class, defaults),
            audio=AudioCard.of(pipeline, pipeline_class, defaults),
            variants={}
            if image is not None or pipeline_class is not type(pipeline)
            else {
                task: cls.of(pipeline, variant)
                for task, variant in image_variants(name).items()
                if keeps_everything(pipeline, variant)
            },
        )

    def complete_params(
        self, params: OmniDiffusionSamplingParams
    ) -> tuple[OmniDiffusionSamplingParams, tuple[IgnoredField, ...]]:
        """Fill unset fields with the defaults of the pipeline that serves the request's task, and drop the fields
        it would not use, each an `IgnoredField` (in the order they are checked); raise `SamplingParamsError` for
        what it cannot take."""
        card = self.for_task(params.task)
        if params.image is not None and len(params.image) > card.max_images:
            raise SamplingParamsError(
                "image", f"{card.pipeline_name} takes {card.max_images} input image(s), got {len(params.image)}"
            )
        ignored: list[IgnoredField] = []
        return card._complete(params, ignored), tuple(ignored)

    def _complete(
        self, params: OmniDiffusionSamplingParams, ignored: list[IgnoredField]
    ) -> OmniDiffusionSamplingParams:
        """The request's parameters for this pipeline, completed. A field that tunes something the pipeline does not
        have (guidance it does not run, a second expert, a fixed shift, an image it does not noise) is dropped into
        ``ignored``: the answer is what the request makes without it, which is what diffusers would silently make,
        and the caller reports the field (or refuses it in strict mode). A request the pipeline cannot answer as
        asked (more outputs than it makes, a size it cannot make, an image it lacks, a video from an image model)
        is refused."""
        name = self.pipeline_name
        params = self._drop_unused(params, ignored)
        if "max_sequence_length" in params.extra_args:
            params = self._check_sequence_length(params, ignored)
        for arg in params.extra_args:
            if arg in RESERVED_ARGS:
                raise SamplingParamsError(
                    f"extra_args.{arg}",
                    f"extra_args may not set {arg!r}: it is a sampling parameter or set by vllm-omni",
                )
            if arg not in self.call_args and arg not in self.config_args and arg not in ENGINE_ARGS:
                raise SamplingParamsError(
                    f"extra_args.{arg}", f"extra_args key {arg!r} is not an argument of {name}.__call__"
                )
        params = self._check_guidance(params, ignored)
        steps = params.num_inference_steps or self.default_steps
        guidance = (
            params.guidance_scale if params.guidance_scale is not None else self.call_defaults.get("guidance_scale")
        )
        if self.audio is not None:
            params = self._complete_audio(params, ignored)
            return params.model_copy(update={"num_inference_steps": steps, "guidance_scale": guidance})
        for asked in [f for f in ("audio_length", "audio_start") if getattr(params, f) is not None]:
            raise SamplingParamsError(asked, f"{asked} applies to audio pipelines; {name} makes {self.output}s")
        return params.model_copy(
            update={
                **self._complete_size(params),
                **self._complete_video(params),
                **self._complete_strength(params, steps),
                "num_inference_steps": steps,
                "guidance_scale": guidance,
            }
        )

    def _complete_size(self, params: OmniDiffusionSamplingParams) -> dict[str, int]:
        """An image or video request's height and width: given, else its input's (a video-to-video request keeps its
        video's size, an edit its first image's), else the pipeline's default; checked against its multiple."""
        name, size = self.pipeline_name, self.default_size
        if params.video is not None:  # a video-to-video request keeps its video's size by default
            size = (params.video[0].height, params.video[0].width)
        if params.image is not None and self.output == "image":  # an edit keeps the first image's size by default
            width, height = params.image[0].size
            size = (height - height % self.size_multiple, width - width % self.size_multiple)
            if min(size) == 0:
                why = f"the image is {width}x{height}; {name} needs sides of at least {self.size_multiple}"
                raise SamplingParamsError("image", why)
        if params.height is not None and params.width is not None:
            height, width = params.height, params.width
        elif size is None:
            raise SamplingParamsError("height", f"{name} has no default size: give height and width")
        else:
            height, width = params.height or size[0], params.width or size[1]
        for side, value in (("height", height), ("width", width)):
            if value % self.size_multiple:
                raise SamplingParamsError(
                    side, f"{side}={value} is not a multiple of {self.size_multiple}, which {name} requires"
                )
        return {"height": height, "width": width}

    def _complete_audio(
        self, params: OmniDiffusionSamplingParams, ignored: list[IgnoredField]
    ) -> OmniDiffusionSamplingParams:
        """An audio request: the picture fields dropped into ``ignored`` (it makes no picture), its clip's start and
        length filled in and checked against the longest clip the pipeline makes: a clip it cannot make as asked is
        refused, where diffusers would fail the batch or crop or clamp the clip without a word."""
        name, audio = self.pipeline_name, self.audio
        assert audio is not None, "an audio pipeline's card"
        for unused in [f for f in ("height", "width", "num_frames", "fps") if getattr(params, f) is not None]:
            why = f"{unused} applies to image and video pipelines; {name} makes audio (audio_length sets its length)"
            params = _drop(params, ignored, unused, why)
        start, longest = params.audio_start or 0.0, audio.longest
        if start and audio.start_arg is None:
            raise SamplingParamsError("audio_start", f"{name} makes clips from 0 s: leave audio_start out, or 0")
        if start < 0 or (longest is not None and start >= longest):
            bound = "" if longest is None else f" and below {longest:g} (its longest clip)"
            raise SamplingParamsError("audio_start", f"audio_start must be 0 or more{bound} for {name}, not {start:g}")
        if params.audio_length is not None and audio.length_arg is None:
            why = f"{name} makes clips of its own length: vllm-omni knows no argument of its call to set it"
            raise SamplingParamsError("audio_length", why + "; leave audio_length out")
        room = None if longest is None else longest - start
        length = params.audio_length
        if length is None:
            length = room if audio.start_arg is not None else audio.default_length
        if length is not None and (length <= 0 or (room is not None and length > room + 1e-9)):
            allowed = "more than 0" if room is None else f"more than 0 and at most {room:g} s"
            if room is not None:
                allowed += f" ({name} makes clips up to {longest:g} s" + (
                    f", from audio_start={start:g})" if start else ")"
                )
            raise SamplingParamsError("audio_length", f"audio_length must be {allowed}, not {length:g}")
        return params.model_copy(
            update={"audio_length": length, "audio_start": start if audio.start_arg is not None else None}
        )

    def _drop_unused(
        self, params: OmniDiffusionSamplingParams, ignored: list[IgnoredField]
    ) -> OmniDiffusionSamplingParams:
        """``params`` without the fields that tune something this pipeline does not have, each dropped into
        ``ignored`` (`_complete`); more outputs per prompt than it makes are refused."""
        name = self.pipeline_name
        if params.negative_prompt is not None and "negative_prompt" not in self.call_args:
            params = _drop(params, ignored, "negative_prompt", f"negative_prompt is not accepted by {name}")
        if params.guidance_scale is not None and "guidance_scale" not in self.call_args:
            params = _drop(params, ignored, "guidance_scale", f"guidance_scale is not accepted by {name}")
        if params.guidance_scale is not None and self.ignores_guidance_scale:
            why = f"guidance_scale does nothing on this {name}: its transformer has no guidance embedding (a timestep-"
            why += "distilled model such as FLUX.1-schnell); guide it with true_cfg_scale and a negative_prompt"
            params = _drop(params, ignored, "guidance_scale", why)
        for speech_field in SPEECH_FIELDS:
            if getattr(params, speech_field) is not None:
                params = _drop(params, ignored, speech_field, f"{speech_field} is for speech models; {name} is not one")
        if params.num_outputs_per_prompt > 1 and self.outputs_arg is None:
            raise SamplingParamsError(
                "num_outputs_per_prompt", f"num_outputs_per_prompt > 1 is not supported by {name}"
            )
        if "boundary_ratio" not in self.config_args:
            for arg in [arg for arg in TWO_EXPERT_ARGS if arg in params.extra_args]:
                params = _drop(
                    params,
                    ignored,
                    f"extra_args.{arg}",
                    f"{arg} applies to two-expert Wan 2.2 folders (a transformer_2 and a boundary_ratio in "
                    f"model_index.json); this {name} has one expert",
                )
        if "flow_shift" in params.extra_args and self.flow_shift_key is None:
            params = _drop(
                params,
                ignored,
                "extra_args.flow_shift",
                f"flow_shift applies to flow-matching schedulers with a fixed shift; this {name}'s scheduler "
                + (
                    "shifts by image size (use_dynamic_shifting)"
                    if self.flow_matching
                    else "is not a flow-matching one"
                ),
            )
        # true_cfg_scale is a field of every Images and Videos request, not a key of some pipelines' own: one
        # without true classifier-free guidance has nothing to apply it to.
        if "true_cfg_scale" in params.extra_args and "true_cfg_scale" not in self.call_args:
            params = _drop(
                params,
                ignored,
                "extra_args.true_cfg_scale",
                f"true_cfg_scale applies to pipelines with true classifier-free guidance (Flux, Qwen-Image); {name} "
                "guides with guidance_scale",
            )
        if params.strength is not None and not self.noises_its_image:
            params = _drop(params, ignored, "strength", f"strength is not accepted by {name}: it noises no input image")
        return params

    def _check_sequence_length(
        self, params: OmniDiffusionSamplingParams, ignored: list[IgnoredField]
    ) -> OmniDiffusionSamplingParams:
        """A ``max_sequence_length`` within what the pipeline's text encoder takes: refused before the call, where
        diffusers' own check would fail the whole batch; dropped into ``ignored`` where the call takes none."""
        name, limit, length = self.pipeline_name, self.max_sequence_length, params.extra_args["max_sequence_length"]
        if limit is None:
            why = f"max_sequence_length is not accepted by {name}: its call takes none (its text encoders have a fixed "
            return _drop(params, ignored, "extra_args.max_sequence_length", why + "length)")
        if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= limit:
            raise SamplingParamsError(
                "extra_args.max_sequence_length",
                f"max_sequence_length must be an integer from 1 to {limit} for {name} (what its text encoder takes), "
                f"not {length!r}",
            )
        return params

    def _check_guidance(
        self, params: OmniDiffusionSamplingParams, ignored: list[IgnoredField]
    ) -> OmniDiffusionSamplingParams:
        """A negative prompt acts only through classifier-free guidance, and true CFG only with a negative prompt:
        either one given without what makes it act is dropped into ``ignored``. Pipelines with a ``true_cfg_scale``
        (Flux, Qwen-Image) guide with it when it is above 1; the others with ``guidance_scale`` above 1."""
        name, negative = self.pipeline_name, params.negative_prompt is not None
        if "true_cfg_scale" in self.call_args:
            given = params.extra_args.get("true_cfg_scale")
            scale = given if given is not None else self.call_defaults.get("true_cfg_scale", 1.0)
            if negative and scale <= 1:
                return _drop(
                    params,
                    ignored,
                    "negative_prompt",
                    f"negative_prompt does nothing on {name} unless true_cfg_scale > 1 (it is {scale:g}): set "
                    "true_cfg_scale above 1 to use it, or leave negative_prompt out",
                )
            if given is not None and given > 1 and not negative:
                return _drop(
                    params,
                    ignored,
                    "extra_args.true_cfg_scale",
                    f"true_cfg_scale={given:g} does nothing on {name} without a negative_prompt: give one, or leave "
                    "true_cfg_scale out",
                )
            return params
        scale = params.guidance_scale if params.guidance_scale is not None else self.call_defaults.get("guidance_scale")
        second = params.extra_args.get("guidance_scale_2")  # a two-expert Wan's low-noise expert guides with it
        if isinstance(scale, int | float) and isinstance(second, int | float):
            scale = max(scale, second)
        if negative and isinstance(scale, int | float) and scale <= 1:
            return _drop(
                params,
                ignored,
                "negative_prompt",
                f"negative_prompt does nothing on {name} unless guidance_scale > 1 (it is {scale:g}): set "
                "guidance_scale above 1 to use it, or leave negative_prompt out",
            )
        return params

    def scheduler_overrides(self, params: OmniDiffusionSamplingParams) -> dict[str, Any]:
        """The request's settings of its noise scheduler's config (its ``flow_shift``), for the scheduler that
        runs it alone (step mode) or its batch (request mode: ``flow_shift`` is in the batch key)."""
        key, shift = self.flow_shift_key, params.extra_args.get("flow_shift")
        if shift is None:
            return {}
        assert key is not None, "flow_shift is refused where the scheduler has no shift to set"
        return {key: float(shift)}

    def strength_offset(self, steps: int, strength: float) -> int:
        """The first of ``steps`` that an image task of ``strength`` runs, as its image pipeline's ``get_timesteps``
        counts: the UNet pipelines keep ``int(steps * strength)`` steps, the flow-matching ones drop
        ``int(steps - steps * strength)``."""
        kept = steps * strength if self.flow_matching else int(steps * strength)
        return int(max(steps - min(kept, steps), 0))

    def _complete_strength(self, params: OmniDiffusionSamplingParams, steps: int) -> dict[str, float]:
        """``strength`` for a pipeline that noises its input image (checked: it leaves at least one step)."""
        if not self.noises_its_image:
            return {}
        strength = params.strength if params.strength is not None else DEFAULT_STRENGTH[params.task]
        if self.strength_offset(steps, strength) >= steps:
            why = (
                f"strength={strength} with num_inference_steps={steps} leaves no denoising step "
                f"for {self.pipeline_name}"
            )
            raise SamplingParamsError("strength", why + ": raise either")
        return {"strength": strength}

    def _complete_video(self, params: OmniDiffusionSamplingParams) -> dict[str, int]:
        """num_frames and fps for a video pipeline (checked against its temporal VAE factor); none for images."""
        if self.output != "video":
            for field in [f for f in ("num_frames", "fps") if getattr(params, f) is not None]:
                why = f"{field} applies to video pipelines; {self.pipeline_name} makes images"
                raise SamplingParamsError(field, why)
            return {}
        if params.video is not None and params.num_frames not in (None, len(params.video)):
            why = f"num_frames={params.num_frames}, but the input video has {len(params.video)} frames"
            raise SamplingParamsError("num_frames", why)
        num_frames = len(params.video) if params.video else params.num_frames or self.call_defaults.get("num_frames")
        assert num_frames is not None, f"{self.pipeline_name} has no default num_frames"  # video calls all have one
        if (num_frames - 1) % self.frame_multiple:
            why = f"num_frames={num_frames} must be 1 more than a multiple of {self.frame_multiple} for "
            raise SamplingParamsError("num_frames", why + self.pipeline_name)
        return {"num_frames": num_frames, "fps": params.fps or DEFAULT_VIDEO_FPS}


def _drop(
    params: OmniDiffusionSamplingParams, ignored: list[IgnoredField], param: str, reason: str
) -> OmniDiffusionSamplingParams:
    """``params`` without ``param`` (a field, or ``extra_args.KEY``), which is recorded in ``ignored``."""
    ignored.append(IgnoredField(param, reason))
    key = param.removeprefix("extra_args.")
    if key == param:
        return params.model_copy(update={param: None})
    return params.model_copy(update={"extra_args": {k: v for k, v in params.extra_args.items() if k != key}})
