"""What a diffusion request is inside the engine: its batch key and its engine-side state (its sampling parameters
are in `vllm_omni.sampling_params`, its output in `vllm_omni.outputs`, how it fails in `vllm_omni.errors`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm_omni.diffusion.pipeline.timings import ComponentTimes
from vllm_omni.outputs import Preview, Trajectory
from vllm_omni.sampling_params import MAX_SEED, OmniDiffusionSamplingParams


class BatchKey(NamedTuple):
    """Requests batch together only when every field is equal: one pipeline call takes one value of each."""

    height: int | None
    """``None`` for audio, as ``width``."""
    width: int | None
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
    audio_length: float | None
    """An audio pipeline's call takes one clip length (and start) for all its rows."""
    audio_start: float | None

    @classmethod
    def of(cls, params: OmniDiffusionSamplingParams) -> BatchKey:
        """The key of complete ``params`` (no ``None`` left in the fields it reads, but an audio request's size)."""
        steps = params.num_inference_steps
        assert steps is not None, "incomplete params"
        return cls(
            height=params.height,
            width=params.width,
            num_inference_steps=steps,
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
            audio_length=params.audio_length,
            audio_start=params.audio_start,
        )


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
    preempted: bool = False
    """Step mode: it left the running batch for a better request and waits, its ``state`` kept, to rejoin at the step
    it left (`StepBatchScheduler`)."""
    kept_bytes: int = 0
    """While preempted: the bytes of its kept state (`kept_nbytes`), which count against the stage's
    ``max_preempted_state_mb``; else 0."""
    payload: Any = None
    """A split pipeline's previous stage output for it (`Conditioning` or `Latents`); ``None`` for the first."""
    on_preview: Callable[[Preview], None] | None = None
    """Where its partial images go (``params.partial_images`` of them), on the engine's thread; ``None``: nowhere."""
    previews_sent: int = 0
    """Previews made so far."""
    trajectory: Trajectory | None = None
    """What its stochastic sampling recorded (`sde.SdeSampler`), once its denoising is done; ``None``: none."""
    timings: ComponentTimes = field(default_factory=ComponentTimes)
    """The time of each pipeline component on the work it took part in (`timings.ComponentTimer`)."""

    @property
    def started(self) -> float:
        """`started_time`, read once the engine has started the request."""
        assert self.started_time is not None, f"request {self.request_id} has not started"
        return self.started_time

    @property
    def pixels(self) -> int:
        """``width × height × frames × n``: what the stage's ``max_batch_pixels`` budget counts (an audio request, which
        has no size: ``n``)."""
        p = self.params
        return (p.width or 1) * (p.height or 1) * (p.num_frames or 1) * p.num_outputs_per_prompt

    @property
    def progress(self) -> float:
        """Fraction of its denoising steps done."""
        total = self.total_steps or self.params.num_inference_steps
        assert total is not None, "incomplete params"
        return self.steps_done / total

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        key: Hashable,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> DiffusionRequest:
        """The request of complete ``params``, under its role's batch ``key``; its seed is drawn if ``params``
        gives none."""
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


@dataclass(eq=False)
class PipelineCall:
    """One request-mode pipeline call of a batch, as `DiffusionRunner.run` built it: what each extension around
    the call reads, and the little it may change (`invoke`, `callback`; `vllm_omni.diffusion.pipeline.extensions`)."""

    batch: list[DiffusionRequest]
    pipeline: Any
    """The pipeline called: the loaded one, or an image variant built on its components."""
    variant: bool
    """Whether ``pipeline`` is an image variant (`ModelCard.variants`), not the loaded pipeline."""
    kwargs: dict[str, Any]
    """The call's arguments."""
    config: dict[str, Any]
    """The batch's pipeline config (`ModelCard.config_args`), set for this call only."""
    scheduler_overrides: dict[str, Any]
    """The batch's noise-scheduler settings (`ModelCard.scheduler_overrides`), on a scheduler of its own."""
    rows: int
    """Prompt rows per request (text encoders' rows): 1, or ``n`` where each output has its own input image."""
    n: int
    """Outputs per request (the denoiser's latent rows)."""
    previews: Any = None
    """The stage's `previews.Previews`, which makes the partial images its requests ask for; ``None``: none."""
    invoke: Callable[..., Any] | None = None
    """What runs the call with ``kwargs`` (the ranks' group replaces the pipeline); ``None``: the pipeline."""
    callback: bool = True
    """Whether the call may take the runner's step callback (the ranks call none)."""
