"""Quantized denoisers through `Omni` on tiny Flux, SD3 and Wan: ``int8`` and ``fp8_storage`` each equal stock
diffusers loaded with the same quantization config (`stock_quantized_pipeline`: as diffusers' documentation writes
it), alone and in a batch of four, in request and step mode; the denoiser's parameter bytes shrink against
``none``; Flux's T5 quantized beside the transformer; a split pipeline quantizes the denoiser in its denoise stage;
a step cache on a quantized denoiser."""

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.diffusion.features.quantization import parameter_bytes
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.testing.checks.faults import run_together
from vllm_omni.testing.checks.stock import stock_quantized_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["a red cube", "a blue sphere", "a green cone", "a cat on a mat"]
TOLERANCE = 2 / 255


def _call(family: str) -> dict:
    if family == "wan":
        return dict(num_inference_steps=2, height=32, width=32, num_frames=5, output_type="np")
    return dict(num_inference_steps=2, height=64, width=64, output_type="np")


def _pixels(output) -> np.ndarray:
    """The one image (or video) of an `Omni` output or of a stock pipeline output, as floats in [0, 1]."""
    if hasattr(output, "frames"):
        return np.asarray(output.frames[0], dtype=np.float32)
    if getattr(output, "videos", None):
        return np.stack([np.asarray(frame, dtype=np.float32) for frame in output.videos[0]])
    return np.asarray(output.images[0], dtype=np.float32)


def _stock_outputs(pipeline, family: str) -> list[np.ndarray]:
    return [
        _pixels(pipeline(prompt, generator=torch.Generator("cpu").manual_seed(seed), **_call(family)))
        for seed, prompt in enumerate(PROMPTS)
    ]


@pytest.fixture(scope="module")
def stock_quantized():
    """``stock_quantized(model, family, mode)``: `stock_quantized_pipeline` and its image of each of `PROMPTS` (seed =
    its index), made once per module (no test changes the pipeline)."""
    made = {}

    def get(model: str, family: str, mode: str) -> tuple[object, list[np.ndarray]]:
        if (model, mode) not in made:
            pipeline = stock_quantized_pipeline(model, mode)
            made[model, mode] = pipeline, _stock_outputs(pipeline, family)
        return made[model, mode]

    return get


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
@pytest.mark.parametrize("mode", ["int8", "fp8_storage"])
def test_each_image_equals_stock_diffusers_quantized_alike_alone_and_in_a_batch_of_four(
    request, stock_quantized, family, mode
):
    model = request.getfixturevalue(f"tiny_{family}")
    stock, want = stock_quantized(model, family, mode)
    base = parameter_bytes(load_pipeline(model, torch.float32, torch.device("cpu")).transformer)
    assert parameter_bytes(stock.transformer) < base
    params = [OmniDiffusionSamplingParams(seed=seed, **_call(family)) for seed in range(len(PROMPTS))]
    for execution_mode in ("request", "step"):
        with Omni(model, max_num_seqs=4, execution_mode=execution_mode, quantization=mode) as omni:
            runner = omni.engine.stages[0].replicas[0].engine.runner
            assert list(runner.quantization.quantized) == ["transformer"]
            assert parameter_bytes(runner.pipeline.transformer) == parameter_bytes(stock.transformer) < base
            alone = [omni.generate([prompt], [p])[0] for prompt, p in zip(PROMPTS, params, strict=True)]
            batched = run_together(omni, list(zip(PROMPTS, params, strict=True)), f"{family}-{mode}")
        assert [o.metrics["batch_size"] for o in batched] == [4.0] * 4
        for output, expected in zip(alone + batched, want + want, strict=True):
            assert output.error is None
            assert np.abs(_pixels(output) - expected).max() <= TOLERANCE, (family, mode, execution_mode)


def test_a_split_pipeline_quantizes_the_denoiser_in_its_denoise_stage(tiny_flux, stock_quantized):
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], max_num_seqs=2),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    want = stock_quantized(tiny_flux, "flux", "int8")[1][:2]
    params = [OmniDiffusionSamplingParams(seed=seed, **_call("flux")) for seed in range(2)]
    with Omni(tiny_flux, deploy_config=deploy, quantization="int8") as omni:
        held = {
            s.stage_config.stage_type: s.replicas[0].engine.runner.quantization.quantized for s in omni.engine.stages
        }
        outputs = omni.generate(PROMPTS[:2], params)
    assert held == {"encode": {}, "denoise": {"transformer": "torchao int8 weight-only"}, "decode": {}}
    for output, expected in zip(outputs, want, strict=True):
        assert output.error is None and np.abs(_pixels(output) - expected).max() <= TOLERANCE


def test_quantize_components_adds_flux_t5(tiny_flux):
    components = ("transformer", "text_encoder_2")
    stock = stock_quantized_pipeline(tiny_flux, "int8", components)
    want = _stock_outputs(stock, "flux")[:2]
    params = [OmniDiffusionSamplingParams(seed=seed, **_call("flux")) for seed in range(2)]
    with Omni(tiny_flux, max_num_seqs=2, quantization="int8", quantize_components=components) as omni:
        pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
        assert parameter_bytes(pipeline.text_encoder_2) == parameter_bytes(stock.text_encoder_2)
        outputs = omni.generate(PROMPTS[:2], params)
    assert parameter_bytes(stock.text_encoder_2) < parameter_bytes(
        load_pipeline(tiny_flux, torch.float32, torch.device("cpu")).text_encoder_2
    )
    for output, expected in zip(outputs, want, strict=True):
        assert output.error is None and np.abs(_pixels(output) - expected).max() <= TOLERANCE
    with Omni(tiny_flux, quantization="fp8_storage", quantize_components=components) as omni:
        pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
        assert pipeline.text_encoder_2.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float8_e4m3fn
        assert pipeline.text_encoder_2.dtype == torch.float32  # what the pipeline makes T5's tensors in
        (output,) = omni.generate(PROMPTS[:1], params[:1])
    assert output.error is None


CACHE_OPTIONS = {"threshold": 0.5}


@pytest.fixture(scope="module")
def stock_int8_cached(tiny_flux) -> list[np.ndarray]:
    """Each of `PROMPTS` (seed = its index) alone through stock int8 diffusers with first_block's cache hooks, a
    fresh pipeline each; one set for both execution modes."""
    from vllm_omni.config.cache import cache_hook_config

    want = []
    for seed, prompt in enumerate(PROMPTS):
        stock = stock_quantized_pipeline(tiny_flux, "int8")
        stock.transformer.enable_cache(
            cache_hook_config("first_block", CACHE_OPTIONS, lambda stock=stock: stock.current_timestep)
        )
        want.append(_pixels(stock(prompt, generator=torch.Generator("cpu").manual_seed(seed), **_call("flux"))))
    return want


@pytest.mark.parametrize("execution_mode", ["request", "step"])
def test_a_step_cache_runs_on_a_quantized_denoiser_per_request(tiny_flux, stock_int8_cached, execution_mode):
    """first_block on an int8 transformer: each request of a batch equals stock int8 diffusers with the same cache
    hooks, run alone."""
    want = stock_int8_cached
    params = [OmniDiffusionSamplingParams(seed=seed, **_call("flux")) for seed in range(len(PROMPTS))]
    with Omni(
        tiny_flux,
        max_num_seqs=4,
        execution_mode=execution_mode,
        quantization="int8",
        cache_backend="first_block",
        cache_config=CACHE_OPTIONS,
    ) as omni:
        outputs = run_together(omni, list(zip(PROMPTS, params, strict=True)), "cached")
    for output, expected in zip(outputs, want, strict=True):
        assert output.error is None and np.abs(_pixels(output) - expected).max() <= TOLERANCE
