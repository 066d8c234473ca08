"""Runner start-up checks: device, dtype and whether a pipeline can batch; the Brownian noise of a batch's
requests."""

import types

import pytest
import torch
from diffusers import CosineDPMSolverMultistepScheduler, DiffusionPipeline, FluxPipeline, StableDiffusionPipeline

from vllm_omni.diffusion.engine.request import PipelineCall
from vllm_omni.diffusion.families.pipeline_facts import check_batchable
from vllm_omni.diffusion.pipeline.noise import noise_per_request
from vllm_omni.diffusion.pipeline.runner import select_device, select_dtype


class SinglePromptPipeline(DiffusionPipeline):
    """A pipeline whose call takes one prompt and one generator only."""

    def __call__(self, prompt: str, generator: torch.Generator | None = None):
        raise NotImplementedError


class ListPipeline(DiffusionPipeline):
    def __call__(self, prompt: str | list[str], generator: torch.Generator | list | None = None):
        raise NotImplementedError


@pytest.mark.parametrize("cls", [FluxPipeline, StableDiffusionPipeline, ListPipeline])
def test_batchable_pipelines_pass(cls):
    check_batchable(cls, max_num_seqs=8)


def test_a_pipeline_that_cannot_batch_fails_naming_class_and_flag():
    with pytest.raises(ValueError, match=r"SinglePromptPipeline cannot batch .*prompt and generator.*--max-num-seqs 1"):
        check_batchable(SinglePromptPipeline, max_num_seqs=2)
    check_batchable(SinglePromptPipeline, max_num_seqs=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_cpu_fallback_and_dtype():
    assert select_device(None).type == "cpu"
    assert select_dtype("auto", torch.device("cpu")) is torch.float32
    assert select_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ValueError, match="devices='0' names CUDA devices, but CUDA is not available"):
        select_device("0")


def _sde_steps(scheduler, sample: torch.Tensor, generator) -> torch.Tensor:
    """Three steps of ``scheduler`` from ``sample`` with a zero prediction: all they add is the SDE noise."""
    scheduler.set_timesteps(3)
    for timestep in scheduler.timesteps:
        sample = scheduler.step(torch.zeros_like(sample), timestep, sample, generator=generator).prev_sample
    return sample


def test_each_request_of_a_call_gets_the_brownian_noise_it_gets_alone_from_a_fresh_scheduler():
    """Stable Audio's scheduler seeds a Brownian tree per generator; a request's two rows share one generator in the
    runner's call. Each request gets diffusers' tree for it alone with one generator (one over its rows), from the
    very first call of a scheduler that has not set its timesteps yet (it has no noise sampler before)."""
    scheduler = CosineDPMSolverMultistepScheduler()
    assert not hasattr(scheduler, "noise_sampler")
    requests = [types.SimpleNamespace(seed=seed) for seed in (5, 6)]
    call = PipelineCall(requests, types.SimpleNamespace(scheduler=scheduler), False, {}, {}, {}, rows=1, n=2)
    start = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    shared = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    with noise_per_request(call):
        batched = _sde_steps(scheduler, start, [g for g in shared for _ in range(2)])
    assert "step" not in vars(scheduler)  # the class's own step again
    for i, seed in enumerate((5, 6)):
        rows = slice(2 * i, 2 * i + 2)
        alone = _sde_steps(CosineDPMSolverMultistepScheduler(), start[rows], torch.Generator().manual_seed(seed))
        assert torch.equal(batched[rows], alone)
