"""What else a quantized stage does through `Omni`, on the tiny Flux: sleep level 2 and weight updates on a
float8-storage denoiser (its files' weights, cast alike) as stock diffusers with the same weights, and both refused
with the reason on an int8 one; LoRA adapters per row on each; torch.compile of an int8 denoiser as stock."""

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.features.weights import named_tensors
from vllm_omni.errors import WeightUpdateError
from vllm_omni.testing.checks.faults import run_together
from vllm_omni.testing.checks.stock import stock_quantized_pipeline
from vllm_omni.testing.models.lora import write_random_lora

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOLERANCE = 2 / 255
CALL = dict(height=64, width=64, num_inference_steps=2, output_type="np")


def _params(seed: int, **kw) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(seed=seed, **CALL, **kw)


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.float32)


def _stock(pipeline, prompt: str, seed: int) -> np.ndarray:
    return _pixels(pipeline(prompt, generator=torch.Generator("cpu").manual_seed(seed), **CALL))


def _transformer(omni):
    return omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer


def test_fp8_storage_sleeps_at_level_2_and_takes_weight_updates_as_stock(tiny_flux):
    stock = stock_quantized_pipeline(tiny_flux, "none")
    generator = torch.Generator().manual_seed(0)
    perturbed = {
        k: v + 0.2 * v.std() * torch.randn(v.shape, generator=generator) if v.numel() > 1 else v
        for k, v in stock.transformer.state_dict().items()
    }
    stock.transformer.load_state_dict(perturbed)
    stock.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    with Omni(tiny_flux, quantization="fp8_storage") as omni:
        (before,) = omni.generate(["a cat"], _params(1))
        omni.sleep(level=2)
        assert all(t.is_meta for t in _transformer(omni).parameters())
        omni.wake_up()
        (after,) = omni.generate(["a cat"], _params(1))
        assert np.array_equal(_pixels(after), _pixels(before))
        omni.update_weights(perturbed)
        assert named_tensors(_transformer(omni))["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn
        (updated,) = omni.generate(["a cat"], _params(1))
    assert np.abs(_pixels(updated) - _pixels(before)).max() > 10 / 255
    assert np.abs(_pixels(updated) - _stock(stock, "a cat", 1)).max() <= TOLERANCE


def test_int8_refuses_sleep_level_2_and_weight_updates_naming_the_component_and_serves_on(tiny_flux):
    with Omni(tiny_flux, quantization="int8") as omni:
        (before,) = omni.generate(["a cat"], _params(1))
        with pytest.raises(ValueError, match=r"level 2 .* do not hold transformer as it runs \(torchao int8"):
            omni.sleep(level=2)
        state = {k: v.dequantize() for k, v in named_tensors(_transformer(omni)).items() if hasattr(v, "dequantize")}
        with pytest.raises(WeightUpdateError, match=r"transformer runs quantized \(torchao int8 weight-only\)"):
            omni.update_weights(state)
        omni.sleep(level=1)
        omni.wake_up()
        (after,) = omni.generate(["a cat"], _params(1))
    assert np.array_equal(_pixels(after), _pixels(before))


@pytest.mark.parametrize("mode", ["int8", "fp8_storage"])
def test_lora_adapters_serve_per_row_on_a_quantized_denoiser(tiny_flux, tmp_path, mode):
    path = write_random_lora(tiny_flux, str(tmp_path / "a"), seed=1)
    stock = stock_quantized_pipeline(tiny_flux, mode)
    base = _stock(stock, "a dog", 6)
    stock.load_lora_weights(path, adapter_name="a")
    for layer in stock.transformer.modules():  # PEFT made them in the layer's float8 (fp8_storage)
        for name in ("lora_A", "lora_B"):
            if "a" in getattr(layer, name, {}):
                getattr(layer, name)["a"].to(torch.float32)
    stock.set_adapters(["a"], [0.8])
    adapted = _stock(stock, "a cat", 5)
    with Omni(tiny_flux, quantization=mode, max_num_seqs=2, lora_modules=[f"a={path}"]) as omni:
        requests = [("a cat", _params(5, lora={"name": "a", "scale": 0.8})), ("a dog", _params(6))]
        outputs = run_together(omni, requests, f"lora-{mode}")  # queued at one instant: one batch of two
    assert [o.metrics["batch_size"] for o in outputs] == [2.0, 2.0]
    assert np.abs(_pixels(outputs[0]) - adapted).max() <= TOLERANCE
    assert np.abs(_pixels(outputs[1]) - base).max() <= TOLERANCE


def test_compile_of_an_int8_denoiser_makes_the_stock_image(tiny_flux):
    want = _stock(stock_quantized_pipeline(tiny_flux, "int8"), "a cat", 1)
    with Omni(tiny_flux, quantization="int8", compile="regional") as omni:
        (output,) = omni.generate(["a cat"], _params(1))
    assert np.abs(_pixels(output) - want).max() <= TOLERANCE
