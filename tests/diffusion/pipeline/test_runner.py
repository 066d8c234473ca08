"""Runner start-up checks: device, dtype and whether a pipeline can batch."""

import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionPipeline

from vllm_omni.diffusion.families.pipeline_facts import check_batchable
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
