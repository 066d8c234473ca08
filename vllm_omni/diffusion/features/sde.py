"""Stochastic sampling for RL rollouts on flow-matching schedulers: the one place of its math (docs/rl.md).

A request that sets ``sde_type``, ``noise_level``, ``sde_window_size`` / ``sde_window_range`` or ``logprobs`` in
``extra_args`` (verl-omni's names) gets an `SdeSampler`: its own generator, its window, and the `Trajectory` it
records. Each of its steps is `SdeSampler.step`, per request and in float32, wherever the step is taken: around
the pipeline's ``scheduler.step`` in request mode (`sde_sampling`), and in `FlowMatchStepper.advance` and
`ModularStepper.advance` in step mode and in a split ``denoise`` stage. So a request's trajectory depends on its
seed and settings alone, not on the batch it ran in or the mode.

With σ the current sigma, σ' the next, Δ = σ' − σ, v the guided velocity, x the latents and ε ~ N(0, I):

- ``sde`` (Flow-GRPO, arXiv:2505.05470): s = a·sqrt(σ / (1 − σ)) (σ = 1: the schedule's second sigma in the
  denominator), μ = x·(1 + s²Δ/(2σ)) + v·(1 + s²(1 − σ)/(2σ))·Δ, std = s·sqrt(−Δ);
- ``cps`` (coefficients-preserving sampling, arXiv:2509.05952): std = σ'·sin(aπ/2), x̂₀ = x − σv,
  x̂₁ = x + (1 − σ)v, μ = x̂₀(1 − σ') + x̂₁·sqrt(σ'² − std²);
- ``dance_sde`` (DanceGRPO, arXiv:2505.07818): std = a·sqrt(−Δ), score = −(x − x̂₀(1 − σ))/σ²,
  μ = x + Δv − ½a²·score·Δ;

then x' = μ + std·ε. The log-probability of the transition is the mean over the latent's elements of the Gaussian
log-density −(x' − μ)²/(2·std²) − log std − ½·log 2π; for ``cps`` it is the papers' −(x' − μ)² (their reference
code drops the constants and the scale, and trainers compare with that). Steps outside the window use noise 0,
which is the plain Euler step x + Δv.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from vllm_omni.diffusion.families.pipeline_facts import schedule_index
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.errors import SamplingParamsError
from vllm_omni.outputs import Trajectory

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.request import DiffusionRequest, PipelineCall
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

SdeType = Literal["sde", "cps", "dance_sde"]
SDE_TYPES: tuple[str, ...] = get_args(SdeType)
SDE_ARGS = frozenset({"sde_type", "noise_level", "sde_window_size", "sde_window_range", "logprobs"})
"""The ``extra_args`` keys of stochastic sampling; the engine applies them, no pipeline sees them."""
DEFAULT_NOISE_LEVEL = 0.7
"""Flow-GRPO's default ``noise_level``."""

EMBEDDING_NAMES = {
    "encoder_hidden_states": "prompt_embeds",
    "pooled_projections": "pooled_prompt_embeds",
    "encoder_hidden_states_mask": "prompt_embeds_mask",
}
"""The denoiser's text inputs, by the name of the pipeline argument that takes them (`Trajectory.prompt_embeds`)."""


@dataclass(frozen=True)
class SdeSettings:
    """A request's stochastic sampling, read and checked from its ``extra_args`` (`SdeSettings.of`)."""

    sde_type: SdeType = "sde"
    noise_level: float = DEFAULT_NOISE_LEVEL
    window_size: int | None = None
    """SDE steps per request (``sde_window_size``); ``None``: every step."""
    window_range: tuple[int, int] | None = None
    """``(lo, hi)``: the window lies within steps ``[lo, hi)``; ``None``: all steps."""
    logprobs: bool = False

    @classmethod
    def of(cls, params: OmniDiffusionSamplingParams, steps: int | None = None) -> SdeSettings | None:
        """The settings of ``params``, ``None`` when it sets none of `SDE_ARGS` (or only ``logprobs`` false);
        `SamplingParamsError` naming the key for a value out of range (``steps``: the steps the request runs, when
        known)."""
        given = {k: v for k, v in params.extra_args.items() if k in SDE_ARGS}
        if not given or given == {"logprobs": False}:
            return None
        sde_type = given.get("sde_type", "sde")
        if sde_type not in SDE_TYPES:
            raise _error("sde_type", f"sde_type must be one of {', '.join(SDE_TYPES)}, got {sde_type!r}")
        level = given.get("noise_level", DEFAULT_NOISE_LEVEL)
        if isinstance(level, bool) or not isinstance(level, int | float) or not 0 <= level <= 10:
            raise _error("noise_level", f"noise_level must be a number in [0, 10], got {level!r}")
        if sde_type == "cps" and level > 1:
            raise _error("noise_level", f"noise_level of sde_type 'cps' must be in [0, 1] (sin(aπ/2)), got {level}")
        logprobs = given.get("logprobs", False)
        if not isinstance(logprobs, bool):
            raise _error("logprobs", f"logprobs must be true or false, got {logprobs!r}")
        size, window = given.get("sde_window_size"), given.get("sde_window_range")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise _error("sde_window_size", f"sde_window_size must be an integer >= 1, got {size!r}")
        if window is not None:
            if size is None:
                raise _error("sde_window_range", "sde_window_range needs sde_window_size (the window's length)")
            if (
                not isinstance(window, list | tuple)
                or len(window) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in window)
                or not 0 <= window[0] < window[1]
                or window[1] - window[0] < size
            ):
                raise _error(
                    "sde_window_range",
                    f"sde_window_range must be [lo, hi] with 0 <= lo < hi and hi - lo >= sde_window_size ({size}), "
                    f"got {window!r}",
                )
            window = (int(window[0]), int(window[1]))
        settings = cls(sde_type, float(level), size, window, logprobs)
        if steps is not None:
            settings.check_steps(steps)
        return settings

    def check_steps(self, steps: int) -> None:
        """Refuse a window that does not fit the ``steps`` the request runs."""
        hi = steps if self.window_range is None else self.window_range[1]
        if self.window_size is not None and (hi > steps or self.window_size > steps):
            param = "sde_window_size" if self.window_range is None else "sde_window_range"
            raise _error(
                param,
                f"the SDE window ({self.window_size} steps in {self.window_range or [0, steps]}) "
                f"does not fit the {steps} denoising steps this request runs",
            )

    def window(self, generator: torch.Generator, steps: int) -> range:
        """The steps that are stochastic: a window of ``window_size`` whose start is drawn from ``generator`` as
        ``randint(lo, hi - W + 1)``, or every step."""
        if self.window_size is None:
            return range(steps)
        lo, hi = self.window_range or (0, steps)
        start = int(torch.randint(lo, hi - self.window_size + 1, (1,), generator=generator).item())
        return range(start, start + self.window_size)


def _error(key: str, message: str) -> SamplingParamsError:
    return SamplingParamsError(f"extra_args.{key}", message)


def sde_generator(seed: int) -> torch.Generator:
    """A request's generator of its window and step noise: seeded from its seed, but another stream than its
    initial noise (requests whose seeds differ by one must not share noise)."""
    digest = hashlib.blake2b(f"vllm-omni sde {seed}".encode(), digest_size=8).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def transition(
    settings: SdeSettings, x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, sigma_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and standard deviation of one stochastic step from float32 ``x`` with velocity ``v`` (module
    docstring); ``std`` is a 0-d tensor."""
    a, v = settings.noise_level, v.float()
    s_, s1 = torch.tensor(sigma, dtype=torch.float32), torch.tensor(sigma_next, dtype=torch.float32)
    dt = s1 - s_
    if settings.sde_type == "sde":
        denominator = 1 - (torch.tensor(sigma_max, dtype=torch.float32) if sigma == 1.0 else s_)
        s = torch.sqrt(s_ / denominator) * a
        mean = x * (1 + s**2 / (2 * s_) * dt) + v * (1 + s**2 * (1 - s_) / (2 * s_)) * dt
        return mean, s * torch.sqrt(-dt)
    if settings.sde_type == "cps":
        std = s1 * math.sin(a * math.pi / 2)
        mean = (x - s_ * v) * (1 - s1) + (x + v * (1 - s_)) * torch.sqrt(s1**2 - std**2)
        return mean, std
    std = a * torch.sqrt(-dt)
    score = -(x - (x - s_ * v) * (1 - s_)) / s_**2
    return x + dt * v - 0.5 * a**2 * score * dt, std


def log_prob(settings: SdeSettings, sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``[n]``: each row's log-probability of ``sample`` given the step's ``mean`` and ``std`` (module docstring)."""
    if settings.sde_type == "cps":
        density = -((sample - mean) ** 2)
    else:
        density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return density.mean(dim=tuple(range(1, density.dim())))


@dataclass(eq=False)
class SdeSampler:
    """One request's stochastic sampling: its settings, generator and window, and the trajectory it records."""

    settings: SdeSettings
    generator: torch.Generator
    steps: int
    """The denoising steps the request runs."""
    window: range = field(init=False)
    taken: int = 0
    """Steps taken so far."""
    latents: list[torch.Tensor] = field(default_factory=list)
    timesteps: list[float] = field(default_factory=list)
    sigmas: list[float] = field(default_factory=list)
    log_probs: list[torch.Tensor] = field(default_factory=list)
    prompt_embeds: dict[str, torch.Tensor] = field(default_factory=dict)
    _exact: torch.Tensor | None = None
    """The float32 latents of its last stochastic step, of which the pipeline holds a copy in the model's dtype."""

    def __post_init__(self):
        self.window = self.settings.window(self.generator, self.steps)

    @classmethod
    def of(cls, params: OmniDiffusionSamplingParams, seed: int, steps: int) -> SdeSampler | None:
        """The sampler of a request that asks for stochastic sampling, else ``None``."""
        settings = SdeSettings.of(params, steps)
        return None if settings is None else cls(settings, sde_generator(seed), steps)

    def step(
        self, x: torch.Tensor, v: torch.Tensor, timestep: Any, sigmas: torch.Tensor, index: int
    ) -> torch.Tensor | None:
        """The request's next latents from ``x`` (``[n, ...]``) and guided velocity ``v`` at position ``index`` of
        the schedule ``sigmas``, in ``v``'s dtype; ``None`` outside its window (the caller takes the plain Euler
        step)."""
        k, self.taken = self.taken, self.taken + 1
        if k not in self.window:
            self._exact = None
            return None
        exact = self._exact if self._exact is not None and self._exact.shape == x.shape else x.float()
        sigma, sigma_next = float(sigmas[index]), float(sigmas[index + 1])
        mean, std = transition(self.settings, exact, v, sigma, sigma_next, float(sigmas[1]))
        noise = torch.randn(exact.shape, generator=self.generator, dtype=torch.float32).to(exact.device)
        sample = mean + std * noise
        if k == self.window.start:
            self.latents.append(exact.cpu())
            self.sigmas.append(sigma)
        self.latents.append(sample.cpu())
        self.timesteps.append(float(timestep))
        self.sigmas.append(sigma_next)
        if self.settings.logprobs:
            self.log_probs.append(log_prob(self.settings, sample, mean, std).cpu())
        self._exact = sample
        return sample.to(v.dtype)

    def record_embeds(self, cond: dict[str, torch.Tensor], uncond: dict[str, torch.Tensor] | None) -> None:
        """Keep the text inputs of the request's rows that the denoiser sees (unconditional ones as
        ``negative_*``), by the pipeline argument names of `EMBEDDING_NAMES`. A mask that masks nothing is left
        out: it is the same input as none, which stock Qwen-Image passes then and its modular blocks do not."""
        for rows, prefix in ((cond, ""), (uncond or {}, "negative_")):
            for key, name in EMBEDDING_NAMES.items():
                if rows.get(key) is not None and not (key.endswith("_mask") and bool(rows[key].all())):
                    self.prompt_embeds[prefix + name] = rows[key].detach().float().cpu()

    def trajectory(self) -> Trajectory:
        """What it recorded, stacked per output row (`Trajectory`)."""
        return Trajectory(
            latents=torch.stack(self.latents, dim=1),
            timesteps=torch.tensor(self.timesteps, dtype=torch.float32),
            sigmas=torch.tensor(self.sigmas, dtype=torch.float32),
            log_probs=torch.stack(self.log_probs, dim=1) if self.settings.logprobs else None,
            prompt_embeds=dict(self.prompt_embeds),
        )


def samplers(batch: list[DiffusionRequest], steps: int) -> list[SdeSampler | None]:
    """Each request's sampler (``None``: plain sampling) for a request-mode batch of ``steps`` steps."""
    return [SdeSampler.of(r.params, r.seed, r.total_steps or steps) for r in batch]


@contextlib.contextmanager
def sde_sampling(pipeline, batch: list[DiffusionRequest]) -> Iterator[list[SdeSampler | None]]:
    """Request mode: around one pipeline call of ``batch``, each request's rows of the scheduler's ``step`` are
    its sampler's, and the denoiser's text inputs of the first step are recorded per request. Yields the samplers
    (wrapping nothing when no request of the batch samples stochastically)."""
    params = batch[0].params
    assert params.num_inference_steps is not None, "complete params"
    found = samplers(batch, params.num_inference_steps)
    if not any(found):
        yield found
        return
    scheduler, n = pipeline.scheduler, params.num_outputs_per_prompt
    step = scheduler.step
    seen: list[dict[str, torch.Tensor]] = []
    stepped = False

    def stochastic_step(model_output, timestep, sample, *args, **kwargs):
        nonlocal stepped
        if not stepped:
            stepped = True
            record_first_step(found, seen, n)
        index = schedule_index(scheduler, timestep)
        result = step(model_output, timestep, sample, *args, **kwargs)
        prev = result[0] if isinstance(result, tuple) else result.prev_sample
        if len(sample) != len(batch) * n:
            raise RuntimeError(f"{type(pipeline).__name__} stepped {len(sample)} rows for {len(batch)} x {n}")
        rows = list(prev.split(n))
        for i, sampler in enumerate(found):
            if sampler is not None:
                taken = sampler.step(
                    sample[i * n : (i + 1) * n], model_output[i * n : (i + 1) * n], timestep, scheduler.sigmas, index
                )
                if taken is not None:
                    rows[i] = taken.to(prev.dtype)
        prev = torch.cat(rows)
        if isinstance(result, tuple):
            return (prev, *result[1:])
        result.prev_sample = prev
        return result

    def keep_inputs(module, args, kwargs):
        if not stepped:
            seen.append({k: v for k, v in kwargs.items() if k in EMBEDDING_NAMES and isinstance(v, torch.Tensor)})

    hook = _denoiser(pipeline).register_forward_pre_hook(keep_inputs, with_kwargs=True)
    scheduler.step = stochastic_step
    try:
        yield found
    finally:
        del scheduler.step  # the class's own again
        hook.remove()


class SdeExtension(Extension):
    """Stochastic sampling as an extension (`vllm_omni.diffusion.pipeline.extensions`): around a request-mode call,
    `sde_sampling`, then each request's trajectory (step mode's steppers take `SdeSampler.step` in ``advance``)."""

    name = "sde"

    @contextlib.contextmanager
    def around_call(self, call: PipelineCall) -> Iterator[None]:
        with sde_sampling(call.pipeline, call.batch) as found:
            yield None
        for request, sampler in zip(call.batch, found, strict=True):
            request.trajectory = None if sampler is None else sampler.trajectory()


def record_first_step(found: list[SdeSampler | None], seen: list[dict[str, torch.Tensor]], n: int) -> None:
    """Each sampler's text inputs from the denoiser calls of the first step, as diffusers' pipelines make them:
    one call with twice the rows is ``[uncond, cond]`` (SD3's classifier-free guidance), two calls are the
    conditional then the unconditional one (true CFG of Flux and Qwen-Image, Wan), one call of the rows alone has
    no unconditional rows."""
    rows = len(found) * n
    uncond: dict[str, torch.Tensor] | None
    if len(seen) == 1 and seen[0] and len(next(iter(seen[0].values()))) == 2 * rows:
        cond = {k: v[rows:] for k, v in seen[0].items()}
        uncond = {k: v[:rows] for k, v in seen[0].items()}
    else:
        cond, uncond = (seen[0] if seen else {}), (seen[1] if len(seen) > 1 else None)
    for i, sampler in enumerate(found):
        if sampler is not None:
            part = slice(i * n, (i + 1) * n)
            sampler.record_embeds(
                {k: v[part] for k, v in cond.items()},
                None if uncond is None else {k: v[part] for k, v in uncond.items()},
            )


def _denoiser(pipeline) -> torch.nn.Module:
    return getattr(pipeline, "transformer", None) or pipeline.unet


def steps_flow_euler(scheduler) -> bool:
    """Whether a noise scheduler (or ``None``) steps flow matching's Euler, which stochastic sampling replaces."""
    return type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and not scheduler.config.get(
        "stochastic_sampling", False
    )


def check_sde(card, params: OmniDiffusionSamplingParams) -> None:
    """Refuse stochastic sampling of complete ``params`` that the model of ``card`` cannot run, or whose window
    does not fit its steps (`SamplingParamsError` naming the key)."""
    settings = SdeSettings.of(params)
    if settings is None:
        return
    if params.task == "inpaint":
        key = next(k for k in params.extra_args if k in SDE_ARGS)
        raise _error(
            key,
            "stochastic sampling does not take a mask_image: inpainting blends the kept image back into the latents "
            "after each step, so a recorded step's result would not be the next step's input",
        )
    if card.output == "audio":
        key = next(k for k in params.extra_args if k in SDE_ARGS)
        raise _error(
            key,
            f"{card.pipeline_name} makes audio: stochastic sampling for RL rollouts is served on image and video "
            "pipelines, whose steps and trajectories it was checked against (on the audio pipelines' own loops it is "
            "not: LongCat-AudioDiT's inverted sigmas make NaN of it)",
        )
    if not card.flow_euler:
        key = next(k for k in params.extra_args if k in SDE_ARGS)
        raise _error(
            key,
            f"stochastic sampling ({', '.join(sorted(SDE_ARGS))}) replaces the steps of "
            "FlowMatchEulerDiscreteScheduler "
            "(Flux, SD3, Wan, Qwen-Image, Z-Image, FLUX.2, LTX, HunyuanVideo 1.5); "
            f"{card.pipeline_name}'s scheduler is another",
        )
    assert params.num_inference_steps is not None, "complete params"
    settings.check_steps(params.num_inference_steps)
