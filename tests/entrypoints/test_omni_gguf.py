"""GGUF files through `Omni` (``Omni(model="FILE.gguf", model_config=BASE)``, docs/configuration.md "GGUF files"):
each image equals stock diffusers with the denoiser from ``from_single_file(..., GGUFQuantizationConfig)``, alone and
in a batch of four, in both execution modes, on tiny Flux, SD3 and Wan at Q8_0 and Q4_0; split stages, LoRA adapters
and step caches on a GGUF denoiser; a repo's file by name and by quantization type; what is refused, and why."""

import os

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.config.cache import cache_hook_config
from vllm_omni.config.model_source import ModelSourceError
from vllm_omni.diffusion.features.gguf import GgufError, is_gguf_module
from vllm_omni.errors import WeightUpdateError
from vllm_omni.testing.checks.faults import run_together
from vllm_omni.testing.models.gguf_files import stock_gguf_pipeline, write_gguf
from vllm_omni.testing.models.lora import write_random_lora
from vllm_omni.testing.models.single_file import flux_converter_for_any_width
from vllm_omni.testing.processes.hub import populate_cache

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOLERANCE = 2 / 255
PROMPTS = ["a red cube", "a blue sphere", "a green cone", "a cat on a mat"]
FAMILIES = ("flux", "sd3", "wan")
CASES = [(family, qtype) for family in FAMILIES for qtype in ("Q8_0", "Q4_0")]


def _call(family: str) -> dict:
    size = dict(height=32, width=32, num_frames=5) if family == "wan" else dict(height=64, width=64)
    return dict(num_inference_steps=2, output_type="np", **size)


def _params(family: str, seed: int, **extra) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(seed=seed, **_call(family), **extra)


def _pixels(output) -> np.ndarray:
    """The one image (or video) of an `Omni` output or of a stock pipeline output, as floats in [0, 1]."""
    if hasattr(output, "frames"):
        return np.asarray(output.frames[0], dtype=np.float32)
    assert getattr(output, "error", None) is None, output.error
    if getattr(output, "videos", None):
        return np.stack([np.asarray(frame, dtype=np.float32) for frame in output.videos[0]])
    return np.asarray(output.images[0], dtype=np.float32)


def _stock(pipeline, family: str, prompt: str, seed: int) -> np.ndarray:
    return _pixels(pipeline(prompt, generator=torch.Generator("cpu").manual_seed(seed), **_call(family)))


def _assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape
    difference = np.abs(got - want).max()
    assert difference <= TOLERANCE, f"{what}: {difference * 255:.2f}/255 from stock"


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _runner(omni: Omni, stage: int = 0):
    return omni.engine.stages[stage].replicas[0].engine.runner


@pytest.fixture(scope="module", autouse=True)
def vllm_cache(tmp_path_factory):
    """Where the GGUF's folders go (``$VLLM_CACHE_ROOT/omni/single-file``), one per module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm")))
        yield


@pytest.fixture(scope="module")
def ggufs(request, tmp_path_factory) -> dict[tuple[str, str], tuple[str, str]]:
    """(family, type) -> (its tiny folder, its GGUF file)."""
    out = tmp_path_factory.mktemp("ggufs")
    folders = {family: request.getfixturevalue(f"tiny_{family}") for family in FAMILIES}
    return {(f, q): (folders[f], write_gguf(folders[f], f, str(out / f"{f}-{q}.gguf"), q)) for f, q in CASES}


@pytest.fixture(scope="module")
def stock(ggufs) -> dict[tuple[str, str], tuple[object, list[np.ndarray]]]:
    """(family, type) -> the stock GGUF pipeline and its image of each of `PROMPTS` (seed = its index), alone."""
    found = {}
    for case, (folder, path) in ggufs.items():
        pipeline = stock_gguf_pipeline(folder, path)
        found[case] = pipeline, [_stock(pipeline, case[0], prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    return found


@pytest.mark.parametrize("mode", ["request", "step"])
@pytest.mark.parametrize(("family", "qtype"), CASES)
def test_each_image_equals_stock_alone_and_in_a_batch_of_four(ggufs, stock, family, qtype, mode):
    folder, path = ggufs[(family, qtype)]
    pipeline, want = stock[(family, qtype)]
    with flux_converter_for_any_width(), Omni(path, model_config=folder, max_num_seqs=4, execution_mode=mode) as omni:
        stage = omni.stage_configs[0]
        assert (stage.quantization, stage.provenance["quantization"]) == ("gguf", "model")
        transformer = _runner(omni).pipeline.transformer
        assert is_gguf_module(transformer) and _bytes(transformer) == _bytes(pipeline.transformer)
        alone = omni.generate(PROMPTS[:1], [_params(family, 0)])[0]
        batched = run_together(omni, [(p, _params(family, seed)) for seed, p in enumerate(PROMPTS)], mode)
    assert alone.metrics["batch_size"] == 1 and [o.metrics["batch_size"] for o in batched] == [4.0] * 4
    _assert_close(_pixels(alone), want[0], f"{family} {qtype} {mode} alone")
    for seed, (output, expected) in enumerate(zip(batched, want, strict=True)):
        _assert_close(_pixels(output), expected, f"{family} {qtype} {mode} request {seed} of 4")


def test_split_stages_load_the_denoiser_from_the_gguf_alone(ggufs, stock):
    folder, path = ggufs[("flux", "Q4_0")]
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], max_num_seqs=2),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    with flux_converter_for_any_width(), Omni(path, model_config=folder, deploy_config=deploy) as omni:
        assert [s.quantization for s in omni.stage_configs] == ["gguf"] * 3
        held = [getattr(_runner(omni, i).pipeline, "transformer", None) for i in range(3)]
        assert held[0] is None and held[2] is None and is_gguf_module(held[1])
        outputs = omni.generate(PROMPTS[:2], [_params("flux", seed) for seed in range(2)])
    for output, expected in zip(outputs, stock[("flux", "Q4_0")][1], strict=False):
        _assert_close(_pixels(output), expected, "split stages")


@pytest.fixture(scope="module")
def stock_lora(ggufs, stock, tmp_path_factory) -> tuple[str, np.ndarray, np.ndarray]:
    """A random adapter ``a`` of the tiny Flux, and the stock Q4_0 GGUF pipeline's images, alone, of `PROMPTS` 0
    with ``load_lora_weights`` + ``set_adapters([a], [0.8])`` and of `PROMPTS` 1 without (loaded once per module)."""
    folder, path = ggufs[("flux", "Q4_0")]
    adapter = write_random_lora(folder, str(tmp_path_factory.mktemp("lora") / "a"), seed=1, text_encoder=True)
    with flux_converter_for_any_width():
        pipeline = stock_gguf_pipeline(folder, path)
    base = _stock(pipeline, "flux", PROMPTS[1], 1)
    pipeline.load_lora_weights(adapter, adapter_name="a")
    pipeline.set_adapters(["a"], [0.8])
    with_adapter = _stock(pipeline, "flux", PROMPTS[0], 0)
    assert np.abs(with_adapter - stock[("flux", "Q4_0")][1][0]).max() > 10 / 255, "a hardly changes it"
    return adapter, with_adapter, base


@pytest.mark.parametrize("mode", ["request", "step"])
def test_lora_adapters_apply_per_row_on_a_gguf_denoiser(ggufs, stock_lora, mode):
    """PEFT wraps GGUF's linear layers as any other: a batch of [adapter a at 0.8, the base model] equals the stock
    GGUF pipeline with ``load_lora_weights`` + ``set_adapters``, each request alone."""
    folder, path = ggufs[("flux", "Q4_0")]
    adapter, with_adapter, base = stock_lora
    wait = {"request_batch_max_wait_ms": 600_000} if mode == "request" else {}
    with (
        flux_converter_for_any_width(),
        Omni(
            path, model_config=folder, max_num_seqs=2, execution_mode=mode, lora_modules=[f"a={adapter}"], **wait
        ) as omni,
    ):
        lora = [{"name": "a", "scale": 0.8}]
        outputs = omni.generate(PROMPTS[:2], [_params("flux", 0, lora=lora), _params("flux", 1)])
    _assert_close(_pixels(outputs[0]), with_adapter, f"{mode}: adapter a at 0.8")
    _assert_close(_pixels(outputs[1]), base, f"{mode}: the base model in the same batch")


def test_a_step_cache_on_a_gguf_denoiser_equals_stock_with_the_same_cache(ggufs):
    folder, path = ggufs[("flux", "Q8_0")]
    options = {"threshold": 0.5}
    steps = 8
    pipeline = stock_gguf_pipeline(folder, path)
    pipeline.transformer.enable_cache(cache_hook_config("first_block", options, lambda: pipeline.current_timestep))
    call = dict(height=64, width=64, num_inference_steps=steps, output_type="np")
    want = [
        _pixels(pipeline(p, generator=torch.Generator("cpu").manual_seed(seed), **call))
        for seed, p in enumerate(PROMPTS[:2])
    ]
    params = [OmniDiffusionSamplingParams(seed=seed, **call) for seed in range(2)]
    with (
        flux_converter_for_any_width(),
        Omni(path, model_config=folder, max_num_seqs=2, cache_backend="first_block", cache_config=options) as omni,
    ):
        outputs = run_together(omni, list(zip(PROMPTS[:2], params, strict=True)), "cache")
    for output, expected in zip(outputs, want, strict=True):
        _assert_close(_pixels(output), expected, "first_block cache")


def test_sleep_level_1_serves_on_and_level_2_and_weight_updates_are_refused(ggufs, stock):
    folder, path = ggufs[("sd3", "Q8_0")]
    want = stock[("sd3", "Q8_0")][1][0]
    with Omni(path, model_config=folder) as omni:
        with pytest.raises(ValueError, match="the GGUF denoiser .quantization 'gguf'. has none.*use level 1"):
            omni.sleep(2)
        assert not omni.is_sleeping()
        omni.sleep(1)
        omni.wake_up()
        _assert_close(_pixels(omni.generate(PROMPTS[:1], [_params("sd3", 0)])[0]), want, "after sleep(1)")
        weights = {"proj_out.bias": torch.zeros(64)}
        with pytest.raises(WeightUpdateError, match="transformer is GGUF-quantized .loaded from a .gguf file."):
            omni.update_weights(weights)
        # Another component is plain diffusers weights: it updates as ever.
        vae = _runner(omni).pipeline.vae
        omni.update_weights({"decoder.conv_out.bias": vae.decoder.conv_out.bias.detach().clone()}, component="vae")


def test_a_repo_file_by_name_and_by_quantization_type_from_the_cache(ggufs, stock, tiny_flux, tmp_path):
    """``org/name:FILE.gguf`` and vLLM's ``org/name:QUANT_TYPE``, offline from the cache that ``hf download`` of
    both repos leaves; ``--revision`` picks the GGUF repo's commit, the base is read at main."""
    folder, _ = ggufs[("flux", "Q4_0")]
    files = tmp_path / "flux-gguf"
    files.mkdir()
    for qtype in ("Q8_0", "Q4_0"):
        os.link(ggufs[("flux", qtype)][1], files / f"flux-tiny-{qtype}.gguf")
    (files / "README.md").write_text("tiny GGUFs")
    cache = str(tmp_path / "hub")
    populate_cache("tiny-org/flux", tiny_flux, cache)
    commit = populate_cache("tiny-org/flux-gguf", str(files), cache)
    with flux_converter_for_any_width():
        for model, revision, qtype in (
            ("tiny-org/flux-gguf:Q4_0", None, "Q4_0"),
            ("tiny-org/flux-gguf:flux-tiny-Q8_0.gguf", commit, "Q8_0"),
        ):
            with Omni(model, model_config="tiny-org/flux", download_dir=cache, revision=revision) as omni:
                linked = os.listdir(os.path.join(omni.model, "transformer"))
                assert sorted(linked) == ["config.json", f"flux-tiny-{qtype}.gguf"]
                output = omni.generate(PROMPTS[:1], [_params("flux", 0)])[0]
            _assert_close(_pixels(output), stock[("flux", qtype)][1][0], model)


def test_a_gguf_needs_its_base_model(ggufs):
    _, path = ggufs[("flux", "Q8_0")]
    with pytest.raises(ValueError, match=r"is a GGUF file, which holds the denoiser alone: give --model-config"):
        Omni(path)


def test_a_broken_gguf_file_is_refused_naming_it(ggufs, tiny_flux, tmp_path):
    _, path = ggufs[("flux", "Q8_0")]
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as file:
        cut.write_bytes(file.read(4096))
    for broken in (cut, tmp_path / "text.gguf"):
        if not broken.exists():
            broken.write_text("not a gguf")
        with pytest.raises(ModelSourceError, match=rf"model {str(broken)!r}: {broken} is not a readable GGUF file"):
            Omni(str(broken), model_config=tiny_flux)


def test_a_gguf_of_another_model_fails_at_start_up_naming_the_file_and_the_flag(ggufs, tiny_flux):
    _, path = ggufs[("sd3", "Q8_0")]
    with pytest.raises(GgufError) as info:
        Omni(path, model_config=tiny_flux)
    message = str(info.value)
    assert message.startswith(f"{os.path.realpath(path)}: diffusers could not load it as FluxTransformer2DModel")
    assert message.endswith("check that --model-config names its base model")
