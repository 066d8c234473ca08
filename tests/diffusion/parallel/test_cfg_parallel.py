"""`CfgParallelHook` in one process: which rank computes which call of classifier-free guidance, and what each
answers, with the two ranks' exchange (``all_gather``) played by the test."""

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.hooks import HookRegistry

from vllm_omni.diffusion.parallel import cfg as cfg_parallel
from vllm_omni.diffusion.parallel.cfg import HOOK, CfgParallelHook

pytestmark = pytest.mark.slow


@pytest.fixture
def transformer(tiny_flux):
    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer", dtype=torch.float32)
    model.forwards = 0
    model.proj_out.register_forward_pre_hook(lambda *_: setattr(model, "forwards", model.forwards + 1))
    return model


def _inputs(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 16, 16, generator=generator),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=generator),
        pooled_projections=torch.randn(1, 32, generator=generator),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(8, 3),
        return_dict=False,
    )


def _step(model, cond_inputs, uncond_inputs):
    with model.cache_context("cond"):
        cond = model(**cond_inputs)[0]
    with model.cache_context("uncond"):
        uncond = model(**uncond_inputs)[0]
    return cond, uncond


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_computes_one_branch_and_answers_the_other_with_the_exchange(transformer, monkeypatch, rank):
    cond_inputs, uncond_inputs = _inputs(0), _inputs(1)
    with torch.no_grad():
        expected = _step(transformer, cond_inputs, uncond_inputs)
        transformer.forwards = 0
        exchanged = []

        def all_gather(both, mine, group=None):  # the other rank's prediction is the one computed above
            exchanged.append(mine.clone())
            both[0].copy_(mine if rank == 0 else expected[0])
            both[1].copy_(expected[1] if rank == 0 else mine)

        monkeypatch.setattr(cfg_parallel.dist, "all_gather", all_gather)
        HookRegistry.check_if_exists_or_initialize(transformer).register_hook(CfgParallelHook(rank), HOOK)
        cond, uncond = _step(transformer, cond_inputs, uncond_inputs)
    assert transformer.forwards == 1  # its own branch only
    torch.testing.assert_close(exchanged[0], expected[rank], rtol=0, atol=0)
    torch.testing.assert_close(cond, expected[0], rtol=0, atol=0)  # rank 1: its zeros filled in place
    torch.testing.assert_close(uncond, expected[1], rtol=0, atol=0)
    with torch.no_grad():  # a call outside the cond / uncond contexts runs as it would without the hook
        alone = transformer(**cond_inputs)[0]
    torch.testing.assert_close(alone, expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_call_over_both_branches_is_split_by_rows(tiny_sd3, monkeypatch, rank):
    """SD3 batches the unconditional rows, then the conditional ones, into one call outside any cache context: each
    rank computes its half of the rows and returns the whole prediction from the exchange."""
    model = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer", dtype=torch.float32)
    config, generator = model.config, torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(2, config.in_channels, 8, 8, generator=generator),
        encoder_hidden_states=torch.randn(2, 6, config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(2, config.pooled_projection_dim, generator=generator),
        timestep=torch.tensor([500.0, 500.0]),
        return_dict=False,
    )
    with torch.no_grad():
        expected = model(**inputs)[0]
    rows = []
    model.proj_out.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[0]))

    def all_gather(both, mine, group=None):  # the other rank computed the other half of the rows
        both[rank].copy_(mine)
        both[1 - rank].copy_(expected[1 - rank : 2 - rank])

    monkeypatch.setattr(cfg_parallel.dist, "all_gather", all_gather)
    HookRegistry.check_if_exists_or_initialize(model).register_hook(CfgParallelHook(rank), HOOK)
    with torch.no_grad():
        got = model(**inputs)[0]
    assert rows == [1]  # its own half only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
