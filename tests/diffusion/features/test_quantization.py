"""`QuantizationPlan`: what a stage quantizes, refused where the device cannot run it, for components the model lacks,
and where a folder saved quantized contradicts it (a folder that agrees loads as saved, as stock diffusers loads
it); LoRA adapters served per row on an int8 and an fp8-storage denoiser, each row as the stock pipeline alone;
what sleep level 2 and weight updates refuse."""

import shutil

import numpy as np
import pytest
import torch

from vllm_omni.config import StageDeployConfig, resolve_stage_configs
from vllm_omni.diffusion.features.quantization import QuantizationPlan, parameter_bytes
from vllm_omni.diffusion.lora.adapters import LoraAdapters
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.errors import WeightUpdateError
from vllm_omni.sampling_params import LoraSelection
from vllm_omni.testing.checks.stock import stock_quantized_pipeline
from vllm_omni.testing.models.lora import write_random_lora

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
CALL = dict(height=64, width=64, num_inference_steps=2, output_type="np")


def _stage(global_source: str = "cli", **knobs) -> StageDeployConfig:
    return resolve_stage_configs(global_knobs=knobs, global_source=global_source)[0]


def _plan(model: str, skips: tuple[str, ...] = (), **knobs) -> QuantizationPlan:
    return QuantizationPlan.of(model, _stage(**knobs), CPU, torch.float32, skips)


def _images(pipeline, prompts: list[str], seeds: list[int]) -> np.ndarray:
    generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    return pipeline(prompts, generator=generators, **CALL).images


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("fp8", r"--quantization 'fp8' \(cli\): torchao's float8 matmuls run on CUDA .* this stage runs on cpu"),
        ("nf4", r"--quantization 'nf4' \(cli\): bitsandbytes' 4-bit kernels run on CUDA, and this stage runs on cpu"),
    ],
)
def test_cuda_modes_are_refused_on_the_cpu_naming_the_device_and_the_flag(tiny_flux, mode, message):
    with pytest.raises(ValueError, match=message):
        _plan(tiny_flux, quantization=mode)


def test_a_component_the_model_lacks_is_refused_naming_it_and_those_it_has(tiny_flux):
    with pytest.raises(
        ValueError,
        match=r"names text_encoder_3, tokenizer, which FluxPipeline in .* does not have; "
        r"its components: text_encoder, text_encoder_2, transformer, vae",
    ):
        _plan(tiny_flux, quantization="int8", quantize_components="transformer,text_encoder_3,tokenizer")


def test_a_stage_quantizes_the_components_it_loads_by_default_its_denoisers(tiny_flux, tiny_wan22):
    assert _plan(tiny_flux, quantization="int8").quantize == {"transformer": "diffusers"}
    assert _plan(tiny_wan22, quantization="fp8_storage").quantize == {
        "transformer": "diffusers",
        "transformer_2": "diffusers",
    }
    both = "transformer,text_encoder_2"
    assert _plan(tiny_flux, quantization="int8", quantize_components=both).quantize == {
        "text_encoder_2": "transformers",
        "transformer": "diffusers",
    }
    encode = ("transformer", "vae")  # the encode stage's role skips these
    assert _plan(tiny_flux, encode, quantization="int8", quantize_components=both).quantize == {
        "text_encoder_2": "transformers"
    }
    assert _plan(tiny_flux, encode, quantization="int8").quantized == {}
    assert _plan(tiny_flux).pipeline_config() is None and _plan(tiny_flux).describe() == "none"


@pytest.fixture(scope="module")
def saved_int8(tiny_flux, tmp_path_factory) -> str:
    """Tiny Flux with its transformer saved quantized (torchao int8 weight-only, safetensors), as a user saves one."""
    from diffusers import FluxTransformer2DModel, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    folder = tmp_path_factory.mktemp("flux-int8") / "model"
    shutil.copytree(tiny_flux, folder, ignore=shutil.ignore_patterns("transformer"))
    transformer = FluxTransformer2DModel.from_pretrained(
        tiny_flux, subfolder="transformer", quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
    )
    transformer.save_pretrained(folder / "transformer")
    return str(folder)


def test_a_folder_saved_quantized_loads_as_saved_and_equals_stock(saved_int8):
    plan = _plan(saved_int8)
    assert (plan.quantize, plan.saved) == ({}, {"transformer": "torchao Int8WeightOnlyConfig"})
    assert plan.describe() == "transformer torchao Int8WeightOnlyConfig (as saved)"
    ours = load_pipeline(saved_int8, torch.float32, CPU, quantization=plan)
    stock = stock_quantized_pipeline(saved_int8, "none")
    assert type(ours.transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
    assert parameter_bytes(ours.transformer) == parameter_bytes(stock.transformer)
    assert np.array_equal(_images(ours, ["a cat"], [1]), _images(stock, ["a cat"], [1]))
    assert _plan(saved_int8, quantization="int8").saved == plan.saved  # the same method: loaded as saved


@pytest.mark.parametrize("mode", ["fp8_storage", "nf4"])
def test_a_knob_the_folder_contradicts_is_refused_naming_both(saved_int8, mode):
    with pytest.raises(
        ValueError,
        match=rf"--quantization '{mode}' \(cli\) would quantize transformer, "
        r"which .*transformer/config.json holds quantized already \(torchao Int8WeightOnlyConfig\)",
    ):
        _plan(saved_int8, quantization=mode)
    plan = _plan(saved_int8, quantization="fp8_storage", quantize_components="text_encoder_2")  # another component
    assert plan.quantize == {"text_encoder_2": "transformers"} and "transformer" in plan.saved


def test_sleep_level_2_and_weight_updates_are_refused_where_the_files_cannot_give_the_weights_back(
    tiny_flux, saved_int8
):
    for plan in (_plan(tiny_flux, quantization="int8"), _plan(saved_int8)):
        with pytest.raises(
            ValueError, match=r"level 2 drops the weights .* do not hold transformer as it runs .*: use level 1"
        ):
            plan.check_sleep(2)
        plan.check_sleep(1)
        with pytest.raises(WeightUpdateError, match=r"transformer runs quantized \(.*\), and an update copies"):
            plan.check_update("transformer")
        plan.check_update("vae")
    storage = _plan(tiny_flux, quantization="fp8_storage")  # float8 of the files' weights: reloaded, cast alike
    storage.check_sleep(2)
    storage.check_update("transformer")


@pytest.fixture(scope="module")
def adapter(tiny_flux, tmp_path_factory) -> str:
    return write_random_lora(tiny_flux, str(tmp_path_factory.mktemp("lora") / "a"), seed=1)


@pytest.mark.parametrize("mode", ["int8", "fp8_storage"])
def test_lora_rows_on_a_quantized_denoiser_equal_the_stock_pipeline_alone(tiny_flux, adapter, mode):
    """A batch of two rows, one with the adapter at 0.8 and one without, each as the stock pipeline quantized alike
    and run alone. Stock diffusers cannot run an adapter on a layerwise-cast layer (PEFT makes the adapter's
    weights in the layer's float8), so its fp8-storage reference casts them to the compute dtype, as the engine
    does."""
    plan = QuantizationPlan.of(tiny_flux, StageDeployConfig(quantization=mode), CPU, torch.float32, ())
    pipeline = load_pipeline(tiny_flux, torch.float32, CPU, quantization=plan)
    adapters = LoraAdapters(pipeline, max_loras=2, max_lora_rank=8, dtype=torch.float32)
    adapters.load("a", adapter)
    chosen = (LoraSelection(name="a", path=adapter, scale=0.8),)
    with adapters.rows(text=[chosen, ()], denoiser=[chosen, ()]):
        ours = _images(pipeline, ["a cat", "a dog"], [5, 6])
    stock = stock_quantized_pipeline(tiny_flux, mode)
    base = [_images(stock, [prompt], [seed])[0] for prompt, seed in (("a cat", 5), ("a dog", 6))]
    stock.load_lora_weights(adapter, adapter_name="a")
    for layer in stock.transformer.modules():
        for name in ("lora_A", "lora_B"):
            if "a" in getattr(layer, name, {}):
                getattr(layer, name)["a"].to(torch.float32)
    stock.set_adapters(["a"], [0.8])
    adapted = _images(stock, ["a cat"], [5])[0]
    assert np.abs(ours[0] - adapted).max() <= 2 / 255 and np.abs(ours[1] - base[1]).max() <= 2 / 255
    assert np.abs(adapted - base[0]).max() > 10 / 255, "the adapter hardly changes the image"
