"""What step mode needs from a model family: a `Stepper` turns a request into denoising state and runs one
denoising step for many requests at once.

The same adapters split a pipeline into stages (docs/stages.md): `Stepper.encode` is the ``encode`` stage (a
batch of prompts, and each image task's input image → one `Conditioning` per request), `Stepper.start` plus the
denoising steps the ``denoise`` stage (→ `Latents`), and `Stepper.decode` the ``decode`` stage.

The engine never calls the pipeline's ``__call__`` in step mode: it keeps state on the pipeline object
(``_guidance_scale``, ``_interrupt``, the shared scheduler) that requests at different steps cannot share.
Each request gets its own scheduler instance and its own generator instead, so multistep history (DPM++,
UniPC), second-order schedulers (Heun) and ancestral noise behave as in a run of the stock pipeline alone.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, overload

import numpy as np
import torch
from diffusers.configuration_utils import FrozenDict
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.steppers.images import ImageTasks, encode_image
from vllm_omni.diffusion.families.steppers.state import Conditioning, Latents, StepState
from vllm_omni.diffusion.features.step_cache import CallCache, StepCache
from vllm_omni.diffusion.lora.adapters import LoraAdapters, Selection
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import ImageTask, OmniDiffusionSamplingParams

PreviewMethod = Literal["latent_rgb", "vae"]
"""How a stepper's previews become RGB (diffusion/features/previews.py)."""


@overload
def split_rows(tensor: torch.Tensor, n: int, count: int) -> list[torch.Tensor]: ...
@overload
def split_rows(tensor: None, n: int, count: int) -> list[None]: ...
@overload
def split_rows(tensor: torch.Tensor | None, n: int, count: int) -> list[torch.Tensor | None]: ...
def split_rows(tensor: torch.Tensor | None, n: int, count: int) -> list[Any]:
    """A batch-encoded ``[count * n, ...]`` tensor as ``count`` views of ``n`` rows (one per request)."""
    return [None] * count if tensor is None else list(tensor.split(n))


def guidance_scale(params: OmniDiffusionSamplingParams) -> float:
    """The ``guidance_scale`` of complete ``params`` (the model's default filled in)."""
    assert params.guidance_scale is not None, "complete params"
    return params.guidance_scale


def negative_prompts(params: list[OmniDiffusionSamplingParams]) -> list[str]:
    """The negative prompts of requests encoded together with negative rows: each has one (the encode key)."""
    prompts = []
    for q in params:
        assert q.negative_prompt is not None, "encoded together with a request that has a negative prompt"
        prompts.append(q.negative_prompt)
    return prompts


def generators_for(seed: int, n: int) -> list[torch.Generator]:
    """The request's CPU generator, once per output: what the request-mode runner passes, so both modes draw
    the same noise for the same seed."""
    return [torch.Generator("cpu").manual_seed(seed)] * n


_UNUSED_SCHEDULERS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
"""Per pipeline's noise scheduler, one made from its config per set of overrides and never stepped: what
`fresh_noise_scheduler` copies."""


def fresh_noise_scheduler(pipeline, overrides: Mapping[str, Any] | None = None) -> Any:
    """A noise scheduler of the pipeline's class and config that belongs to one request (or one request-mode
    batch) only, with ``overrides`` set in its config (`ModelCard.scheduler_overrides`)."""
    shared, key = pipeline.scheduler, tuple(sorted((overrides or {}).items()))
    unused = _UNUSED_SCHEDULERS.setdefault(shared, {})
    if key not in unused:
        # With every value: from_config resets the keys the config lists as defaulted (_use_default_values), which
        # would undo what a pipeline's __init__ set on them (SD's clip_sample fix of a DDIM config).
        config = {k: v for k, v in shared.config.items() if k != "_use_default_values"}
        unused[key] = type(shared).from_config(config | dict(key))
    # A copy of an unused one: from_config parses the config and builds the schedule again each time, many times
    # a copy's cost, once per request in step mode.
    return scheduler_copy(unused[key])


_SHARED_STATE = (torch.Tensor, np.ndarray, int, float, complex, str, bytes, tuple, type(None), FrozenDict)
"""What a copy of a noise scheduler shares with it: diffusers' schedulers rebind these attributes (``set_timesteps``
builds new tensors, ``step`` moves ``_step_index`` on) and never write into them."""


def scheduler_copy(scheduler: Any) -> Any:
    """A noise scheduler that steps on its own from where ``scheduler`` is: a shallow copy whose lists and dicts
    (the history a multistep scheduler fills in place, UniPC's ``model_outputs``) are copies, and whose other
    attributes but those of `_SHARED_STATE` (a noise sampler, say) are deep copies. ``copy.deepcopy`` of the
    whole, which copies its tensors and frozen config too, cost 0.26 ms a request on tiny Qwen-Image."""
    copied = copy.copy(scheduler)
    for name, value in vars(scheduler).items():
        if type(value) in (list, dict):
            setattr(copied, name, copy.copy(value))
        elif not isinstance(value, _SHARED_STATE):
            setattr(copied, name, copy.deepcopy(value))
    return copied


class Stepper(ImageTasks):
    """Per-family adapter; `predict` (one forward for many requests) is shared by all families."""

    pipeline_classes: ClassVar[tuple[str, ...]] = ()
    """Pipeline class names this stepper serves (exact names: an img2img or inpaint pipeline class is not one; the
    image tasks of these classes are in `tasks`)."""
    extra_args: ClassVar[frozenset[str]] = frozenset()
    """``extra_args`` keys it honours; any other key is refused in step mode."""
    tasks: ClassVar[frozenset[ImageTask]] = frozenset({"text"})
    """The tasks it steps (`OmniDiffusionSamplingParams.task`): image tasks as its class's image-to-image and
    inpainting pipelines (``from_pipe``) run them."""
    preview_method: ClassVar[PreviewMethod] = "latent_rgb"
    """How its previews become RGB (`PreviewMethod`): ``latent_rgb`` projects what `to_vae` gives,
    ``vae`` decodes in full (a stepper without `to_vae`)."""

    def __init__(self, pipeline, device: torch.device):
        self.pipeline = pipeline
        self.device = device
        self.denoiser = getattr(pipeline, "transformer", None) or getattr(pipeline, "unet", None)
        """The denoising network; ``None`` in an encode or decode stage, which does not load it."""
        self.card = ModelCard.of(pipeline)
        """What the admission classmethods below read of the pipeline."""
        self.lora: LoraAdapters | None = None
        """The stage's LoRA adapters (set by its role); each request's own apply to its rows."""
        self.step_cache: StepCache | CallCache | None = None
        """The stage's step cache (set by its role); each request's own state serves its rows."""

    @classmethod
    def request_mode_previews_refusal(cls, pipeline_name: str) -> str | None:
        """Why it cannot make the previews of a request that the stock pipeline runs (request mode), or ``None``."""
        return None

    @classmethod
    def check_pipeline(cls, pipeline) -> None:
        """Raise ValueError naming a configuration of a supported class that cannot be stepped (or split)."""

    # Admission (check and batch keys) reads only the model's card, so a stage admits requests without its
    # pipeline, on the driver of Ray replicas (`roles.StageAdmission`).

    @classmethod
    def check_params(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> None:
        if params.task not in cls.tasks:
            name = {"inpaint": "mask_image", "video": "video"}.get(params.task, "image")
            raise SamplingParamsError(
                name,
                f"{name} is not supported by {card.pipeline_name} in execution_mode 'step' or split into stages "
                f"(it steps {', '.join(sorted(cls.tasks))} requests)",
            )
        for arg in params.extra_args:
            if arg not in cls.extra_args:
                supported = ", ".join(sorted(cls.extra_args)) or "none"
                raise SamplingParamsError(
                    "extra_args",
                    f"extra_args key {arg!r} is not supported by {card.pipeline_name} in execution_mode "
                    f"'step' or split into stages (supported: {supported}); serve it as one diffusion stage with "
                    "execution_mode 'request' for it",
                )

    @classmethod
    def key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        """What must be equal for requests to share one forward."""
        raise NotImplementedError

    @classmethod
    def negative_rows(cls, params: OmniDiffusionSamplingParams) -> bool:
        """Whether the request has unconditional rows: classifier-free guidance (``guidance_scale > 1``)."""
        assert params.guidance_scale is not None, "complete params"
        return params.guidance_scale > 1

    @classmethod
    def encode_key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        """What must be equal for prompts to be encoded in one call: outputs per prompt, whether negative rows
        are encoded, and whether a negative prompt was given (SDXL encodes none as zeros, not as "")."""
        return (params.num_outputs_per_prompt, cls.negative_rows(params), params.negative_prompt is not None)

    @classmethod
    def decode_key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        """What must be equal for latents to be decoded in one call."""
        return (params.height, params.width, params.num_frames, params.output_type)

    def encode(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        """Encode a batch of prompts whose params share an `encode_key`, in one call per text encoder, and the input
        image of each image task, in one VAE call per request (the stock pipelines encode it alone)."""
        with self._adapters(text=[p.lora for p in params]):
            conditionings = self.encode_prompts(prompts, params)
        for conditioning, request in zip(conditionings, params, strict=True):
            if request.task != "text":
                dtype = conditioning.cond["encoder_hidden_states"].dtype
                conditioning.image = encode_image(self.pipeline, request, dtype, self.device)
        return conditionings

    def encode_prompts(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        """`encode` of the prompts alone."""
        raise NotImplementedError

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        """Draw the initial noise and set up the request's own schedule around its encoded prompt."""
        raise NotImplementedError

    def start_all(
        self, conditionings: list[Conditioning], params: list[OmniDiffusionSamplingParams], seeds: list[int]
    ) -> list[StepState]:
        """`start` of the requests that join at one engine step (a stepper may start some of them in one call)."""
        return [self.start(c, p, seed) for c, p, seed in zip(conditionings, params, seeds, strict=True)]

    def prepare(self, prompt: str, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        """Encode the prompt, draw the initial noise and set up the request's own schedule."""
        return self.start(self.encode([prompt], [params])[0], params, seed)

    @overload
    def on_device(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    @overload
    def on_device(self, rows: None) -> None: ...
    @overload
    def on_device(self, rows: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None: ...
    def on_device(self, rows: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """Encoded rows on this stepper's device and dtype (the encode stage may run on another device or dtype;
        on the same ones nothing is copied)."""
        if rows is None:
            return None
        assert self.denoiser is not None, "the stage that denoises takes encoded rows"
        dtype = self.denoiser.dtype
        return {k: v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device) for k, v in rows.items()}

    def model_input(self, state: StepState) -> torch.Tensor:
        """The denoiser input of the request's rows at its current step."""
        return state.latents

    def forward(self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], shared: dict) -> torch.Tensor:
        """One denoiser call on ``x`` with a per-row timestep ``t``."""
        raise NotImplementedError

    def to_vae(self, latents: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        """A request's rows of denoiser latents as its VAE decodes them (unpacked, unscaled): ``[n, C, h, w]``, or
        ``[n, C, f, h, w]`` for video."""
        raise NotImplementedError

    def decode_inputs(self, state: StepState) -> dict[str, Any] | None:
        """What its decode reads of a request's state besides the latents (`Latents.blocks`); ``None``: nothing."""
        return None

    def decode(self, states: list[Latents] | list[StepState]) -> list[list[Any]]:
        """Each request's ``n`` outputs (images, or videos as frame lists) from its final latents."""
        latents = torch.cat([self.to_vae(s.latents, s.params) for s in states])
        return self.postprocess_images(self.pipeline.vae.decode(latents, return_dict=False)[0], states)

    def predict(self, states: list[StepState]) -> list[torch.Tensor]:
        """One forward over every row of ``states``; each request's guided prediction. Changes no state."""
        inputs, timesteps, rows, spans, adapters, caches = [], [], defaultdict(list), [], [], []
        start = 0
        for state in states:
            x = self.model_input(state)
            if self.step_cache is not None:  # the hooks that skip by timestep range read each request's own
                state.cache.timestep = float(state.timestep)
            groups = (state.cond,) if state.uncond is None else (state.uncond, state.cond)  # stock order
            spans.append((start, len(x)))
            for group in groups:
                inputs.append(x)
                timesteps.append(state.timestep.expand(len(x)))
                adapters += [state.params.lora] * len(x)
                caches += [state.cache] * len(x)
                for name, value in group.items():
                    rows[name].append(value)
                start += len(x)
        cached = contextlib.nullcontext() if self.step_cache is None else self.step_cache.rows(caches)
        with self._adapters(denoiser=adapters), cached:
            output = self.forward(
                torch.cat(inputs), torch.cat(timesteps), {k: torch.cat(v) for k, v in rows.items()}, states[0].shared
            )
        predictions = []
        for state, (begin, n) in zip(states, spans, strict=True):
            if state.uncond is None:
                predictions.append(output[begin : begin + n])
                continue
            uncond, cond = output[begin : begin + n], output[begin + n : begin + 2 * n]
            prediction = uncond + state.guidance * (cond - uncond)
            if state.guidance_rescale > 0.0:
                prediction = rescale_noise_cfg(prediction, cond, guidance_rescale=state.guidance_rescale)
            predictions.append(prediction)
        return predictions

    def _adapters(self, **rows: list[Selection]) -> contextlib.AbstractContextManager:
        """Each row's LoRA adapters applied to the calls inside (`LoraAdapters.rows`); nothing without LoRA."""
        return contextlib.nullcontext() if self.lora is None else self.lora.rows(**rows)

    def advance(self, states: list[StepState], predictions: list[torch.Tensor]) -> None:
        """Move each request one step along its own schedule."""
        for state, prediction in zip(states, predictions, strict=True):
            state.latents = state.noise_scheduler.step(
                prediction, state.timestep, state.latents, **(state.step_kwargs or {}), return_dict=False
            )[0]
            state.step += 1
            if state.inpaint is not None:
                self.blend(state)

    def postprocess_images(
        self, images: torch.Tensor, states: Sequence[Latents | StepState], **kwargs
    ) -> list[list[Any]]:
        """Split a decoded batch per request and convert each to its ``output_type``."""
        outputs, start = [], 0
        for state in states:
            n = len(state.latents)
            extra = {k: v[start : start + n] for k, v in kwargs.items()}
            chunk = images[start : start + n]
            outputs.append(
                list(self.pipeline.image_processor.postprocess(chunk, output_type=state.params.output_type, **extra))
            )
            start += n
        return outputs
