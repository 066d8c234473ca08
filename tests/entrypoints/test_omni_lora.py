"""LoRA adapters through `Omni` on real tiny pipelines: each request of a mixed batch equals the stock diffusers
pipeline run alone with its adapters; the Python API; residency bounded by ``max_loras``."""

import os

import numpy as np
import pytest
from pydantic import ValidationError

from vllm_omni import Omni, OmniDiffusionSamplingParams, SamplingParamsError
from vllm_omni.config import LoRAModulePath
from vllm_omni.errors import LoraLoadError, UnknownLoraError
from vllm_omni.testing.models.lora import stock_lora_images, write_random_lora

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAMILIES = ("sd", "sdxl", "sd3", "flux", "wan")
CLIP_TEXT_ENCODER = {"sd", "sdxl", "sd3", "flux"}
"""Families whose ``text_encoder`` is CLIP: their adapter ``a`` carries text-encoder weights too."""
TOLERANCE = 2 / 255


def _call(family: str) -> dict:
    if family == "wan":
        return dict(num_inference_steps=2, height=32, width=32, num_frames=5)
    return dict(num_inference_steps=2, height=64, width=64)


# (prompt, seed, adapters and scales): a alone at 0.8; a and b stacked, b at 0.5; the base model. The base request
# has the first request's prompt and seed, so the first two references differ by the adapter alone.
REQUESTS = (
    ("a cat", 5, {"a": 0.8}),
    ("a dog", 6, {"a": 1.0, "b": 0.5}),
    ("a cat", 5, {}),
)


def _lora(weights: dict[str, float]) -> list[dict]:
    return [{"name": name, "scale": scale} for name, scale in weights.items()]


def _pixels(output) -> np.ndarray:
    """The one image (or video) of an `Omni` output or of a stock pipeline output, as floats in [0, 1]."""
    if hasattr(output, "frames"):
        return np.asarray(output.frames[0], dtype=np.float32)
    if getattr(output, "videos", None):
        return np.stack([np.asarray(frame, dtype=np.float32) for frame in output.videos[0]])
    return np.asarray(output.images[0], dtype=np.float32)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """A family's tiny model, its adapters a and b, and the stock reference of each of `REQUESTS` (built once,
    for both execution modes)."""
    name = request.param
    model = request.getfixturevalue(f"tiny_{name}")
    root = tmp_path_factory.mktemp(f"lora-{name}")
    paths = {
        "a": write_random_lora(model, str(root / "a"), seed=1, text_encoder=name in CLIP_TEXT_ENCODER),
        "b": write_random_lora(model, str(root / "b"), seed=2),
    }
    references = [
        _pixels(
            stock_lora_images(
                model,
                {n: paths[n] for n in weights},
                weights,
                prompt,
                seed=seed,
                output_type="np",
                **_call(name),
            )
        )
        for prompt, seed, weights in REQUESTS
    ]
    assert np.abs(references[0] - references[2]).max() > 10 / 255, "adapter a hardly changes the image"
    return name, model, paths, references


@pytest.mark.parametrize("mode", ["request", "step"])
def test_mixed_adapters_in_one_batch_equal_stock_alone(family, mode):
    name, model, paths, references = family
    wait = {"request_batch_max_wait_ms": 600_000} if mode == "request" else {}  # full at 3: starts at once
    with Omni(
        model,
        max_num_seqs=3,
        execution_mode=mode,
        lora_modules=[f"{n}={p}" for n, p in paths.items()],
        **wait,
    ) as omni:
        params = [
            OmniDiffusionSamplingParams(seed=seed, lora=_lora(weights), output_type="np", **_call(name))
            for _, seed, weights in REQUESTS
        ]
        outputs = omni.generate([prompt for prompt, _, _ in REQUESTS], params)
    for output, reference, (_, _, weights) in zip(outputs, references, REQUESTS, strict=True):
        assert output.error is None
        if mode == "request":
            assert output.metrics.batch_size == 3
        got = _pixels(output)
        assert got.shape == reference.shape
        difference = np.abs(got - reference).max()
        assert difference <= TOLERANCE, f"{name} {mode} {weights}: {difference * 255:.2f}/255 from stock"


# The Python API, on tiny SD.


@pytest.fixture(scope="module")
def sd_adapters(tiny_sd, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sd-api")
    return {n: write_random_lora(tiny_sd, str(root / n), seed=seed) for n, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def omni(tiny_sd, sd_adapters):
    with Omni(tiny_sd, lora_modules=[f"a={sd_adapters['a']}"], max_loras=2) as omni:
        yield omni


def _params(**kw) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, output_type="np", **kw)


def test_an_added_adapter_serves_requests_as_stock_and_is_listed(omni, tiny_sd, sd_adapters):
    assert omni.lora_adapters == [LoRAModulePath(name="a", path=sd_adapters["a"])]
    omni.add_lora("added", sd_adapters["b"])
    try:
        assert [(m.name, m.path) for m in omni.lora_adapters] == [("a", sd_adapters["a"]), ("added", sd_adapters["b"])]
        (output,) = omni.generate(["a cat"], _params(seed=3, lora={"name": "added", "scale": 0.7}))
        assert output.error is None
        reference = stock_lora_images(
            tiny_sd, {"added": sd_adapters["b"]}, {"added": 0.7}, "a cat", seed=3, output_type="np", **_call("sd")
        )
        assert np.abs(_pixels(output) - _pixels(reference)).max() <= TOLERANCE
        with pytest.raises(ValueError, match="The LoRA adapter 'added' has already been loaded"):
            omni.add_lora("added", sd_adapters["c"])
    finally:
        omni.remove_lora("added")


def test_a_removed_adapter_is_unknown_to_later_requests(omni, sd_adapters):
    omni.add_lora("temporary", sd_adapters["c"])
    (output,) = omni.generate(["a cat"], _params(seed=1, lora={"name": "temporary"}))
    assert output.error is None
    omni.remove_lora("temporary")
    assert [m.name for m in omni.lora_adapters] == ["a"]
    with pytest.raises(UnknownLoraError) as info:
        omni.generate(["a cat"], _params(seed=1, lora={"name": "temporary"}))
    assert isinstance(info.value, SamplingParamsError) and info.value.param == "lora"
    assert str(info.value) == "The LoRA adapter 'temporary' does not exist; adapters: a"
    with pytest.raises(UnknownLoraError, match="The LoRA adapter 'temporary' does not exist; adapters: a"):
        omni.remove_lora("temporary")


def test_an_adapter_that_cannot_load_is_refused_naming_its_file(omni, tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(LoraLoadError, match=f"LoRA adapter 'bad': {missing} does not exist"):
        omni.add_lora("bad", missing)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(LoraLoadError) as info:
        omni.add_lora("bad", str(garbage))
    assert str(garbage) in str(info.value)
    assert [m.name for m in omni.lora_adapters] == ["a"]  # neither was registered
    (output,) = omni.generate(["a cat"], _params(seed=1, lora={"name": "a"}))
    assert output.error is None  # the engine still serves


def test_an_adapter_can_be_added_after_a_request_reloaded_an_evicted_one(tiny_sd, sd_adapters, tmp_path):
    extra = write_random_lora(tiny_sd, str(tmp_path / "d"), seed=4)
    with Omni(tiny_sd, lora_modules=[f"{n}={p}" for n, p in sd_adapters.items()], max_loras=2) as omni:
        (output,) = omni.generate(["a cat"], _params(seed=1, lora={"name": "a"}))  # evicted at start-up: reloaded
        assert output.error is None
        omni.add_lora("d", extra)  # evicts the other one; a, loaded in inference mode, takes part in both
        (output,) = omni.generate(["a cat"], _params(seed=1, lora={"name": "d"}))
        assert output.error is None
        omni.remove_lora("d")
        omni.add_lora("d", extra)  # loaded again, evicting under the loader's requires_grad pass once more


@pytest.mark.parametrize(
    "lora,message",
    [
        ({"name": "nope"}, "The LoRA adapter 'nope' does not exist; adapters: a"),
        ({"name": "a", "path": "/elsewhere"}, r"lora\[0\].path is set by the engine"),
        ([{"name": "a"}, {"name": "x"}, {"name": "y"}], "lora stacks 3 adapters; at most --max-loras 2"),
    ],
)
def test_bad_selections_are_refused_before_anything_runs(omni, lora, message):
    with pytest.raises(SamplingParamsError, match=message) as info:
        omni.generate(["a cat"], _params(seed=1, lora=lora))
    assert info.value.param == "lora"
    assert omni.num_waiting == 0


def test_lora_on_a_model_served_without_lora_is_refused(tiny_sd):
    with Omni(tiny_sd) as plain:
        assert plain.lora_adapters == []
        with pytest.raises(SamplingParamsError, match="serves no LoRA adapters") as info:
            plain.generate(["a cat"], _params(seed=1, lora={"name": "a"}))
        assert info.value.param == "lora"
        with pytest.raises(ValueError, match="serves no LoRA adapters"):
            plain.add_lora("a", "/x")


@pytest.mark.parametrize(
    "lora,message",
    [
        ({"name": "a", "scale": 9}, "less than or equal to 8"),
        ({"name": "a", "scale": -9}, "greater than or equal to -8"),
        ({"name": "a", "scale": float("inf")}, "finite number"),
        ({"name": "a", "scale": float("nan")}, "finite number"),
        ({"name": ""}, "at least 1 character"),
        ({"name": "a", "weight": 1}, "Extra inputs are not permitted"),
        ([{"name": "a"}, {"name": "a", "scale": 0.5}], "lora names adapter\\(s\\) a more than once"),
    ],
)
def test_bad_lora_params_are_validation_errors(lora, message):
    with pytest.raises(ValidationError, match=message):
        OmniDiffusionSamplingParams(lora=lora)


def test_one_adapter_or_none_is_a_tuple():
    assert [s.name for s in OmniDiffusionSamplingParams(lora={"name": "a"}).lora] == ["a"]
    assert OmniDiffusionSamplingParams(lora=None).lora == ()
    assert OmniDiffusionSamplingParams(lora={"name": "a"}).lora[0].scale == 1.0


# Memory: at most max_loras adapters are ever resident.


def _lora_layers(pipeline):
    from peft.tuners.lora import LoraLayer

    return [m for c in (pipeline.unet, pipeline.text_encoder) for m in c.modules() if isinstance(m, LoraLayer)]


def test_only_max_loras_adapters_stay_resident(tiny_sd, tmp_path):
    from safetensors.torch import load_file

    paths = [write_random_lora(tiny_sd, str(tmp_path / f"l{i}"), seed=i, text_encoder=True) for i in range(10)]
    per_adapter = sum(t.numel() for t in load_file(os.path.join(paths[0], "pytorch_lora_weights.safetensors")).values())
    with Omni(tiny_sd, enable_lora=True, max_loras=2) as omni:
        runner = omni.engine.stages[0].replicas[0].engine.runner
        for i, path in enumerate(paths):
            omni.add_lora(f"l{i}", path)
            (output,) = omni.generate(["a cat"], _params(seed=i, lora={"name": f"l{i}"}))
            assert output.error is None
            assert len(runner.lora.resident) <= 2
        assert list(runner.lora.resident) == ["l8", "l9"]
        layers = _lora_layers(runner.pipeline)
        assert {name for layer in layers for name in layer.lora_A} == {"l8", "l9"}
        assert {name for layer in layers for name in layer.lora_B} == {"l8", "l9"}
        parameters = sum(p.numel() for layer in layers for d in (layer.lora_A, layer.lora_B) for p in d.parameters())
        assert parameters == 2 * per_adapter
        assert [m.name for m in omni.lora_adapters] == [f"l{i}" for i in range(10)]  # all still servable
        (output,) = omni.generate(["a cat"], _params(seed=0, lora={"name": "l0"}))  # reloaded on demand
        assert output.error is None and list(runner.lora.resident) == ["l9", "l0"]
