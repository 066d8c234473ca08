"""Per-row LoRA adapters (`LoraAdapters`) on the tiny pipelines: one call mixing requests with different adapters,
scales or none gives each request the stock diffusers image (``load_lora_weights`` + ``set_adapters``, the request
alone); bad files are refused naming them; residency is least recently used first."""

import os

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.lora.adapters import LoraAdapters
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.errors import LoraLoadError
from vllm_omni.sampling_params import LoraSelection
from vllm_omni.testing.models.lora import CLIP_TEXT_ENCODER_FAMILIES, stock_lora_images, write_random_lora

FAMILIES = ["sd", "sdxl", "sd3", "flux", "wan"]
PROMPTS = ["a cat", "a dog", "a cow"]
SEEDS = [5, 6, 7]
IMAGE = {"num_inference_steps": 2, "output_type": "np", "height": 64, "width": 64}
CALLS = {family: IMAGE for family in FAMILIES} | {"wan": {**IMAGE, "height": 32, "width": 32, "num_frames": 5}}
TOLERANCE = 2  # /255, per pixel (measured: under 0.001/255 in every family)
VISIBLE = 10  # /255: the least an adapter must move some pixel by


def S(name: str, scale: float = 1.0) -> LoraSelection:
    return LoraSelection(name=name, scale=scale)


def _outputs(result) -> np.ndarray:
    """Per request: its image (H, W, 3) or its video (frames, H, W, 3), in [0, 1]."""
    return np.asarray(result.frames if hasattr(result, "frames") else result.images)


def _generate(pipeline, family: str, prompts: list[str], seeds: list[int]) -> np.ndarray:
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    return _outputs(pipeline(prompts, generator=generators, **CALLS[family]))


def _stock(model: str, family: str, adapters: dict, weights: dict, i: int) -> np.ndarray:
    """The stock pipeline's output for request ``i`` (``PROMPTS[i]``, ``SEEDS[i]``) alone."""
    return _outputs(stock_lora_images(model, adapters, weights, PROMPTS[i], seed=SEEDS[i], **CALLS[family]))[0]


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() * 255)


def _lora_layers(pipeline, *names: str) -> list:
    """The PEFT LoRA layers of the pipeline's components ``names`` (all of them by default)."""
    from peft.tuners.lora import LoraLayer

    modules = [c for n, c in pipeline.components.items() if isinstance(c, torch.nn.Module) and n in (names or [n])]
    return [m for module in modules for m in module.modules() if isinstance(m, LoraLayer)]


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    """``lora_file(model, name, **kwargs)``: a random adapter for ``model``, written once per module."""
    folder = tmp_path_factory.mktemp("loras")
    written = {}

    def write(model: str, name: str, **kwargs) -> str:
        path = str(folder / f"{os.path.basename(model)}-{name}")
        if path not in written:
            written[path] = (write_random_lora(model, path, **kwargs), kwargs)
        assert written[path][1] == kwargs, f"adapter {name} written twice with different arguments"
        return written[path][0]

    return write


@pytest.fixture(scope="module")
def sd_adapters(tiny_sd):
    """An sd pipeline's adapters: at most 2, rank at most 4."""
    return LoraAdapters(load_pipeline(tiny_sd, torch.float32, torch.device("cpu")), max_loras=2, max_lora_rank=4)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_one_mixed_call_gives_each_request_the_stock_image(request, lora_file, family):
    model = request.getfixturevalue(f"tiny_{family}")
    a = lora_file(model, "a", seed=1, text_encoder=family in CLIP_TEXT_ENCODER_FAMILIES)
    b = lora_file(model, "b", seed=2)
    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    adapters = LoraAdapters(pipeline, max_loras=4, max_lora_rank=4)
    adapters.load("a", a)
    adapters.load("b", b)

    rows = [(S("a", 0.8),), (S("a"), S("b", 0.5)), ()]
    with adapters.rows(text=rows, denoiser=rows):
        got = _generate(pipeline, family, PROMPTS, SEEDS)

    expected = [
        _stock(model, family, {"a": a}, {"a": 0.8}, 0),
        _stock(model, family, {"a": a, "b": b}, {"a": 1.0, "b": 0.5}, 1),
        _stock(model, family, {}, {}, 2),
    ]
    for i, (mine, stock) in enumerate(zip(got, expected, strict=True)):
        assert _diff(mine, stock) <= TOLERANCE, f"request {i}"
    assert _diff(got[0], _stock(model, family, {}, {}, 0)) > VISIBLE, "adapter a does not change the image"


@pytest.mark.slow
def test_a_kohya_file_loads_and_matches_stock(tiny_sd, lora_file):
    path = lora_file(tiny_sd, "kohya.safetensors", seed=3, text_encoder=True, kohya=True)
    pipeline = load_pipeline(tiny_sd, torch.float32, torch.device("cpu"))
    adapters = LoraAdapters(pipeline, max_loras=1, max_lora_rank=4)
    adapters.load("k", path)
    assert any("k" in layer.lora_A for layer in _lora_layers(pipeline, "text_encoder"))

    rows = [(), (S("k", 0.7),)]
    with adapters.rows(text=rows, denoiser=rows):
        got = _generate(pipeline, "sd", PROMPTS[:2], SEEDS[:2])

    assert _diff(got[0], _stock(tiny_sd, "sd", {}, {}, 0)) <= TOLERANCE
    stock = _stock(tiny_sd, "sd", {"k": path}, {"k": 0.7}, 1)
    assert _diff(got[1], stock) <= TOLERANCE
    assert _diff(stock, _stock(tiny_sd, "sd", {}, {}, 1)) > VISIBLE


def _garbage(tmp_path, lora_file, request) -> str:
    path = tmp_path / "x.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return str(path)


BAD_FILES = {
    "missing": (lambda tmp_path, lora_file, request: str(tmp_path / "nowhere"), "does not exist"),
    "garbage": (_garbage, "cannot be loaded"),
    "other-family": (
        lambda tmp_path, lora_file, request: lora_file(request.getfixturevalue("tiny_sd3"), "b", seed=2),
        "targets no layer",
    ),
    # Its CLIP text-encoder layers fit sd's, its transformer layers nothing.
    "partly-other-family": (
        lambda tmp_path, lora_file, request: lora_file(
            request.getfixturevalue("tiny_sd3"), "a", seed=1, text_encoder=True
        ),
        "transformer layers",
    ),
    "rank-above-max": (
        lambda tmp_path, lora_file, request: lora_file(request.getfixturevalue("tiny_sd"), "rank8", rank=8),
        "rank 8 is above --max-lora-rank 4",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_adapter_is_refused_naming_its_file(request, tmp_path, lora_file, sd_adapters, case):
    make, reason = BAD_FILES[case]
    path = make(tmp_path, lora_file, request)
    with pytest.raises(LoraLoadError) as refused:
        sd_adapters.load("bad", path)
    assert path in str(refused.value) and reason in str(refused.value)
    assert "bad" not in sd_adapters.resident
    assert not any("bad" in layer.lora_A for layer in _lora_layers(sd_adapters.pipeline))


@pytest.mark.slow
def test_residency_is_least_recently_used_first(tiny_sd, lora_file):
    a = lora_file(tiny_sd, "a", seed=1, text_encoder=True)
    b, c = lora_file(tiny_sd, "b", seed=2), lora_file(tiny_sd, "c", seed=3)
    pipeline = load_pipeline(tiny_sd, torch.float32, torch.device("cpu"))
    base = _generate(load_pipeline(tiny_sd, torch.float32, torch.device("cpu")), "sd", PROMPTS[:1], SEEDS[:1])
    adapters = LoraAdapters(pipeline, max_loras=2, max_lora_rank=4)
    adapters.load("a", a)
    adapters.load("b", b)
    adapters.load("c", c)
    assert list(adapters.resident) == ["b", "c"]
    adapters.load("b", b)  # already resident: now the most recently used
    assert list(adapters.resident) == ["c", "b"]
    adapters.load("a", a, keep=["c"])  # b is evicted: c is in use
    assert list(adapters.resident) == ["c", "a"]
    with pytest.raises(LoraLoadError, match="in use"):
        adapters.load("b", b, keep=["c", "a"])
    assert list(adapters.resident) == ["c", "a"]

    assert adapters.unload("a") and adapters.unload("c")
    assert not adapters.unload("a") and not adapters.unload("never-loaded")
    assert adapters.resident == {}
    assert all(not layer.lora_A for layer in _lora_layers(pipeline))
    with adapters.rows(text=[()], denoiser=[()]):
        assert np.array_equal(_generate(pipeline, "sd", PROMPTS[:1], SEEDS[:1]), base)


def test_rows_that_do_not_fit_the_batch_are_an_error(tiny_sd, lora_file, sd_adapters):
    sd_adapters.load("a", lora_file(tiny_sd, "a", seed=1, text_encoder=True))
    try:
        with sd_adapters.rows(text=[(S("a"),), ()]), pytest.raises(RuntimeError, match="3 rows for 2 row selections"):
            _generate(sd_adapters.pipeline, "sd", PROMPTS, SEEDS)
    finally:
        sd_adapters.unload("a")


def test_an_adapter_may_load_more_layers_than_its_file_has(tiny_wan_i2v, lora_file):
    """diffusers adds zero layers where the model has modules the adapter's base model lacks (Wan image-to-video's
    image cross-attention): not a sign of an adapter for another model."""
    adapters = LoraAdapters(load_pipeline(tiny_wan_i2v, torch.float32, torch.device("cpu")), 2, 64)
    adapters.load("a", lora_file(tiny_wan_i2v, "a", seed=1))
    assert list(adapters.resident) == ["a"]
