"""torch.compile of the denoiser (``compile: regional``) on the CPU: the same images as eager within tolerance;
``compile_sizes`` compiled at warm-up, and a size outside them compiled on first use, which the log says."""

import numpy as np
import pytest

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["a red cube", "a blue sphere"]


def _params(size: int) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=size, width=size, num_inference_steps=2, seed=3)


async def _last(omni: AsyncOmni, prompt: str, params: OmniDiffusionSamplingParams, request_id: str):
    outputs = [output async for output in omni.generate(prompt, params, request_id=request_id)]
    return outputs[-1]


async def test_regional_compile_matches_eager_and_warms_up_its_compile_sizes(tiny_flux, caplog):
    with Omni(tiny_flux, max_num_seqs=2) as eager:
        want = [np.asarray(o.images[0], dtype=np.int16) for o in eager.generate(PROMPTS, _params(64))]
    with caplog.at_level("INFO", logger="vllm_omni.diffusion.pipeline.runner"):
        async with AsyncOmni(tiny_flux, max_num_seqs=2, compile="regional", compile_sizes=["64x64"]) as omni:
            runner = omni.engine.stages[0].replicas[0].engine.runner
            blocks = runner.pipeline.transformer.transformer_blocks
            assert all(block._compiled_call_impl is not None for block in blocks)  # nn.Module.compile, in place
            await omni.warm_up()
            assert (64, 64, None) in runner.compiled
            assert "for 64x64 on first use" not in caplog.text  # compiled during warm-up
            outputs = [await _last(omni, prompt, _params(64), f"c{i}") for i, prompt in enumerate(PROMPTS)]
            small = await _last(omni, PROMPTS[0], _params(32), "small")
    assert "Compiling transformer (regional) of stage 0" in caplog.text
    assert "Stage compiles the denoiser for 32x32 on first use (not in compile_sizes)" in caplog.text
    assert small.error is None and small.images[0].size == (32, 32)
    for output, expected in zip(outputs, want, strict=True):
        assert np.abs(np.asarray(output.images[0], dtype=np.int16) - expected).max() <= 2


def test_regional_compile_of_a_denoiser_without_repeated_blocks_fails_naming_the_knob(tiny_sd3):
    with pytest.raises(ValueError, match=r"compile='regional': SD3Transformer2DModel lists no repeated blocks"):
        Omni(tiny_sd3, compile="regional")
