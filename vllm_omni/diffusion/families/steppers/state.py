"""What step mode keeps of a request between steps (`StepState`, and its size: `kept_nbytes`) and what one stage of a
split pipeline hands the next (`Conditioning`, `Latents`): the data the steppers work on, apart from the steppers that
work on it."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline
from diffusers.modular_pipelines import ModularPipeline

from vllm_omni.diffusion.features.sde import SdeSampler
from vllm_omni.diffusion.features.step_cache import RequestCache
from vllm_omni.outputs import Trajectory
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def _compact(value: Any) -> Any:
    """``value`` with each tensor that is a view into a larger buffer copied out: for pickling to another process
    (a Ray replica), which would otherwise carry the whole buffer of a batch with every request."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.untyped_storage().nbytes() > value.nbytes else value
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


class _Payload:
    """What one stage hands the next for one request. In-process it is passed by reference; pickled (to a Ray
    replica) each tensor carries only its own rows."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: _compact(v) for k, v in vars(self).items()}


@dataclass(eq=False)
class Conditioning(_Payload):
    """A request's encoded prompt: the ``encode`` stage's output, the ``denoise`` stage's input."""

    cond: dict[str, torch.Tensor]
    """Per-row denoiser inputs of its conditional rows, each ``[n, ...]``."""
    uncond: dict[str, torch.Tensor] | None
    """The same for its unconditional (negative) rows, ``None`` without classifier-free guidance."""
    shared: dict[str, torch.Tensor]
    """Text inputs shared by every row (Flux's ``txt_ids``)."""
    image: dict[str, torch.Tensor] | None = None
    """An image task's input image, VAE-encoded (`images.encode_image`): ``moments``, ``[1, 2C, h, w]``, the mean
    and log-variance of its latent distribution, from which `Stepper.start` draws each output's sample, and for
    inpainting ``mask``, ``[1, 1, h, w]`` at latent size (1: repaint). ``None`` for a text request."""
    blocks: dict[str, Any] | None = None
    """A family stepped by its modular blocks (`ModularStepper`): what its text-encoder blocks made, by name
    (``prompt_embeds``, ``negative_prompt_embeds``, masks); ``cond`` and ``uncond`` are then empty."""


@dataclass(eq=False)
class Latents(_Payload):
    """A request's denoised latents: the ``denoise`` stage's output, the ``decode`` stage's input. A `StepState`
    has the same two fields, so `Stepper.decode` takes either."""

    latents: torch.Tensor
    """``[n, ...]``: the final latents of its ``n`` outputs."""
    params: OmniDiffusionSamplingParams
    """Its complete sampling parameters (size, frames, output type)."""
    trajectory: Trajectory | None = None
    """What its stochastic sampling recorded, for the final stage's output; ``None``: plain sampling."""
    blocks: dict[str, Any] | None = None
    """A family decoded by its modular blocks: what they read besides the latents (`Stepper.decode_inputs`)."""


@dataclass(eq=False)
class Inpainting:
    """What an inpainting request keeps of its image: after each step its latents outside the mask are replaced by
    its image's latents noised to its next timestep, as the stock inpaint pipelines do (4-channel UNets and
    16-channel transformers). Each tensor is ``[n, ...]`` in its latents' layout."""

    image_latents: torch.Tensor
    noise: torch.Tensor
    """Its initial noise, which each step noises the image with again."""
    mask: torch.Tensor
    """1 where it repaints, 0 where it keeps the image."""


@dataclass(eq=False)
class StepState:
    """One request's denoising state between steps."""

    params: OmniDiffusionSamplingParams
    """Its complete sampling parameters."""
    latents: torch.Tensor
    """``[n, ...]``: the latents of its ``n = num_outputs_per_prompt`` outputs."""
    noise_scheduler: Any
    """Its own diffusers noise scheduler instance: timesteps, sigmas, multistep history."""
    timesteps: torch.Tensor
    """The steps it runs; one engine step is one entry (second-order schedulers list ``2N - 1``). An image task
    runs the tail its strength leaves of its scheduler's schedule."""
    cond: dict[str, torch.Tensor]
    """Per-row denoiser inputs of its conditional rows, each ``[n, ...]``."""
    uncond: dict[str, torch.Tensor] | None
    """The same for its unconditional rows when it uses classifier-free guidance, else ``None``."""
    shared: dict[str, Any]
    """Denoiser inputs shared by a whole forward; equal for every request of a batch key (e.g. position ids)."""
    guidance: float = 1.0
    """Scale that combines the unconditional and conditional predictions."""
    guidance_rescale: float = 0.0
    """``guidance_rescale`` of the stock SD pipelines (0: off)."""
    step_kwargs: dict[str, Any] | None = None
    """Further arguments of its scheduler's ``step`` (``generator``, ``eta``)."""
    step: int = 0
    """Index of its next timestep."""
    offset: int = 0
    """Index of ``timesteps[0]`` in its scheduler's schedule (and ``sigmas``)."""
    inpaint: Inpainting | None = None
    """An inpainting request's image, noise and mask, blended into its latents after each step."""
    forwards: int = 0
    """Engine steps it took part in."""
    batch_total: int = 0
    """Sum over those steps of the requests in the forward (for its mean batch size)."""
    cache: RequestCache = field(default_factory=RequestCache)
    """Its step-cache state (``cache_backend``), its own across its steps."""
    sde: SdeSampler | None = None
    """Its stochastic sampling (``extra_args.sde_type`` ...): its steps replace the scheduler's; ``None``: plain."""

    def __post_init__(self):
        self.cache.enabled = self.params.cache

    @property
    def timestep(self) -> torch.Tensor:
        return self.timesteps[self.step]

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)


_SHARED = (torch.nn.Module, DiffusionPipeline, ModularPipeline)
"""What a request's state refers to but the stage owns: the models and pipelines (a modular request's components view
holds the pipeline)."""

_NOT_DATA = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType, logging.Logger)
"""Values with no tensors of the request's own in them (or, as a module, whose attributes are not its state)."""

_SKIPPED = _SHARED + _NOT_DATA


def kept_nbytes(state: Any) -> int:
    """The bytes of the tensors and arrays ``state`` holds, each counted once, on any device: what a preempted request
    keeps (its latents, encoded prompt, noise scheduler's sigmas and history, step-cache states, SDE record, a modular
    family's block states). What it shares with the stage (`_SHARED`) is not counted; anything else that is not a
    tensor (its generator's few kilobytes) neither."""
    total, seen, tensors = 0, set(), set()
    pending = [state]
    while pending:
        value = pending.pop()
        if id(value) in seen or isinstance(value, _SKIPPED):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta" and (key := (value.data_ptr(), value.nbytes)) not in tensors:
                tensors.add(key)  # the same memory under two names (a loop state's latents and the state's)
                total += value.nbytes
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, dict):
            pending += value.values()
        elif isinstance(value, list | tuple | set | frozenset):
            pending += value
        elif hasattr(value, "__dict__"):
            pending += vars(value).values()
    return total
