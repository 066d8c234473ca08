"""Brownian SDE noise per request: a scheduler that draws it (Stable Audio's ``CosineDPMSolverMultistepScheduler``)
seeds one tree per generator, and the runner hands a request's rows one generator; `noise_per_request` gives each
request of a call the noise diffusers gives it alone (docs/models.md, "Audio models")."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch

from vllm_omni.diffusion.engine.request import PipelineCall


def draws_brownian_noise(scheduler) -> bool:
    """Whether ``scheduler``'s step draws its SDE noise from a ``BrownianTreeNoiseSampler`` seeded by the generators
    it is given: its module imports the sampler and its step takes a generator (it has no ``noise_sampler`` before
    its first ``set_timesteps``, so the attribute cannot tell)."""
    module = sys.modules.get(type(scheduler).__module__)
    step = getattr(scheduler, "step", None)
    return (
        hasattr(module, "BrownianTreeNoiseSampler")
        and step is not None
        and ("generator" in inspect.signature(step).parameters)
    )


class RequestNoise:
    """Brownian noise for a call's latent rows: one tree per request over its ``n`` rows, seeded with its seed
    (`noise_per_request`)."""

    def __init__(self, sample: torch.Tensor, sigma_min: float, sigma_max: float, seeds: list[int]):
        from diffusers.schedulers.scheduling_dpmsolver_sde import BrownianTreeNoiseSampler

        rows = sample.chunk(len(seeds))
        self.samplers = [
            BrownianTreeNoiseSampler(part, sigma_min, sigma_max, seed=seed)
            for part, seed in zip(rows, seeds, strict=True)
        ]

    def __call__(self, sigma, sigma_next) -> torch.Tensor:
        return torch.cat([sampler(sigma, sigma_next) for sampler in self.samplers])


@contextlib.contextmanager
def noise_per_request(call: PipelineCall) -> Iterator[None]:
    """A scheduler whose SDE steps draw Brownian noise (diffusers' ``BrownianTreeNoiseSampler``: Stable Audio's
    ``CosineDPMSolverMultistepScheduler``) seeds one tree per generator of a list, with the generator's
    ``initial_seed``. The runner hands a request's ``n`` rows the same generator (so that their initial noise is
    drawn from it in turn, as diffusers draws it for one request called alone with one generator): their trees
    would share a seed, and their noise would be the same. Here each request of the call gets the tree diffusers
    makes for that request alone with one generator, one over its ``n`` rows, seeded with its seed: a request's
    noise does not depend on its batch, and its ``n`` outputs do not share it."""
    scheduler = call.pipeline.scheduler
    if not draws_brownian_noise(scheduler):
        yield
        return
    step, seeds = scheduler.step, [request.seed for request in call.batch]

    def stepping(model_output, timestep, sample, *args, **kwargs):
        first = getattr(scheduler, "noise_sampler", None) is None  # set_timesteps resets it: the call's first step
        if first and len(model_output) == len(seeds) * call.n:
            config = scheduler.config
            scheduler.noise_sampler = RequestNoise(model_output, config.sigma_min, config.sigma_max, seeds)
        return step(model_output, timestep, sample, *args, **kwargs)

    scheduler.step = stepping
    try:
        yield
    finally:
        scheduler.__dict__.pop("step", None)  # the class's own again (an extension may have popped it already)
