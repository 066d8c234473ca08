"""Weight updates through `Omni` and `AsyncOmni` on the tiny Flux (docs/rl.md, "Weight updates"): the outputs
after an update are the stock pipeline's with the same weights, the version in each output, refusals that apply
nothing, a request running in step mode when an update is issued, LoRA adapters given as tensors, and a trainer
in another process broadcasting over a gloo group."""

import multiprocessing
import os
import socket
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.diffusion.features.weights import named_tensors
from vllm_omni.errors import WeightUpdateError
from vllm_omni.testing.models.lora import write_lora_with_config
from vllm_omni.testing.processes.trainer import broadcast_from_file, trainer_specs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TIMEOUT_S = 300
"""A backstop for waits on another thread or process; no test depends on it."""


def _params(seed: int = 1, **kw) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(
        **{"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "np"} | kw, seed=seed
    )


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.float32)


def _engine(omni):
    return omni.engine.stages[0].replicas[0].engine


def _transformer_state(omni) -> dict[str, torch.Tensor]:
    """A copy of the served transformer's weights, as its ``state_dict()`` names them (read on the test's thread: a
    test may run torch ops)."""
    return {k: v.detach().clone() for k, v in named_tensors(_engine(omni).runner.pipeline.transformer).items()}


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with noise of a fifth of each tensor's spread added: images change visibly."""
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.2 * (v.float().std() if v.numel() > 1 else 1.0) * torch.randn(v.shape, generator=generator)
        for k, v in state.items()
    }


@pytest.fixture(scope="module")
def omni(tiny_flux):
    """Request mode, LoRA on (two adapters resident at most)."""
    with Omni(tiny_flux, enable_lora=True, max_loras=2) as omni:
        yield omni


@pytest.fixture(scope="module")
def original(omni) -> dict[str, torch.Tensor]:
    return _transformer_state(omni)


@pytest.fixture
def restore(omni, original):
    """Serve the model's own transformer weights again after the test."""
    yield
    omni.update_weights(original)


def _stock_images(model: str, transformer: dict[str, torch.Tensor], prompt: str, seed: int) -> np.ndarray:
    """The stock diffusers pipeline with ``transformer`` loaded into it, called alone as `_params` asks."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    pipeline.transformer.load_state_dict(transformer)
    call = _params(seed)
    out = pipeline(
        prompt,
        height=call.height,
        width=call.width,
        num_inference_steps=call.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    )
    return np.asarray(out.images[0], dtype=np.float32)


def test_updated_weights_make_the_stock_pipelines_images_with_them_and_each_output_says_its_version(
    omni, tiny_flux, original, restore
):
    (before,) = omni.generate("a cat", _params())
    version = before.metrics.weights_version
    new = _perturbed(original, seed=0)
    omni.update_weights(new)
    (after,) = omni.generate("a cat", _params())
    assert after.metrics.weights_version == version + 1 and after.metrics["weights_version"] == version + 1
    assert np.abs(_pixels(after) - _pixels(before)).max() > 10 / 255, "the update hardly changed the image"
    np.testing.assert_allclose(_pixels(after), _stock_images(tiny_flux, new, "a cat", seed=1), atol=1e-5)
    omni.update_weights((name, tensor) for name, tensor in original.items())  # an iterable of pairs, read once
    (back,) = omni.generate("a cat", _params())
    assert back.metrics.weights_version == version + 2
    np.testing.assert_array_equal(_pixels(back), _pixels(before))


def test_a_partial_update_casts_to_the_parameters_dtype_and_keeps_the_rest(omni, original, restore):
    name = "x_embedder.weight"
    (before,) = omni.generate("a cat", _params())
    omni.update_weights({name: (original[name] * 1.5).to(torch.float64)})
    transformer = _engine(omni).runner.pipeline.transformer
    assert transformer.x_embedder.weight.dtype == torch.float32
    torch.testing.assert_close(transformer.x_embedder.weight.detach(), original[name] * 1.5)
    torch.testing.assert_close(transformer.proj_out.weight.detach(), original["proj_out.weight"])
    (after,) = omni.generate("a cat", _params())
    assert after.metrics.weights_version == before.metrics.weights_version + 1


@pytest.mark.parametrize(
    "bad, param, message",
    [
        ({"x_embedder.weigth": None}, "x_embedder.weigth", "has no parameter 'x_embedder.weigth'; did you mean "),
        ({"x_embedder.weight": (3, 16)}, "x_embedder.weight", r"has shape \[32, 16\]; the update gives \[3, 16\]"),
    ],
)
def test_an_unknown_name_or_a_wrong_shape_is_refused_naming_it_and_nothing_is_applied(
    omni, original, bad, param, message
):
    (before,) = omni.generate("a cat", _params())
    ((name, shape),) = bad.items()
    given = original["x_embedder.weight"] if shape is None else torch.zeros(shape)
    # Valid tensors come first: they are not applied either.
    update = {k: v * 2 for k, v in original.items() if k != "x_embedder.weight"} | {name: given}
    with pytest.raises(WeightUpdateError, match=message) as info:
        omni.update_weights(update)
    assert info.value.param == param and isinstance(info.value, ValueError)
    (after,) = omni.generate("a cat", _params())
    assert after.metrics.weights_version == before.metrics.weights_version
    np.testing.assert_array_equal(_pixels(after), _pixels(before))


def test_a_component_no_stage_holds_is_refused_naming_those_there_are(omni, original):
    with pytest.raises(WeightUpdateError, match="no stage holds a component 'unet'; the stages hold: text_encoder, "):
        omni.update_weights({"x": original["x_embedder.weight"]}, component="unet")
    with pytest.raises(WeightUpdateError, match="weight 'x' is a str, not a torch.Tensor"):
        omni.update_weights({"x": "tensor"})


def test_a_component_other_than_the_transformer_updates_too(omni, restore):
    vae = _engine(omni).runner.pipeline.vae
    name = "decoder.conv_out.bias"
    old = vae.state_dict()[name].clone()
    (before,) = omni.generate("a cat", _params())
    omni.update_weights({name: old + 0.5}, component="vae")
    (after,) = omni.generate("a cat", _params())
    assert np.abs(_pixels(after) - _pixels(before)).max() > 0.1
    omni.update_weights({name: old}, component="vae")


def test_update_weights_runs_its_torch_ops_on_the_engine_thread_only(omni, original, restore):
    """tests/orchestrator/test_torch_thread.py's check, around an update: its copies run where the engine's work
    does."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, record_function

    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        with record_function("test-main-thread"):
            pass
        omni.update_weights(original)
    main = next(e.thread for e in prof.events() if e.name == "test-main-thread")
    threads = {e.thread for e in prof.events() if e.name.startswith("aten::copy_")}
    assert threads and main not in threads


def test_a_request_running_in_step_mode_when_an_update_is_issued_finishes_on_the_old_weights(tiny_flux):
    """The update is issued from the request's preview callback, on the engine's thread, between its steps: the
    request finishes on the weights it started with, and one given after the update was issued runs on the new."""
    with Omni(tiny_flux, execution_mode="step", max_num_seqs=2) as omni:
        engine = _engine(omni)
        params = _params(seed=4, num_inference_steps=4, partial_images=1)
        new = _perturbed(_transformer_state(omni), seed=1)

        def run(request_id: str, on_preview=None):
            return omni.engine.add_request(request_id, "a cat", params, on_preview)

        old_reference = run("old-reference").result(TIMEOUT_S)
        queued, issued = threading.Event(), []
        call = engine.scheduler.call

        def spy(fn, *, drain=False):  # tells the test when the update is queued
            future = call(fn, drain=drain)
            queued.set()
            return future

        engine.scheduler.call = spy
        later = []

        def on_preview(preview):  # the engine's thread, between the running request's steps
            updating = threading.Thread(target=omni.update_weights, args=(new,))
            updating.start()
            assert queued.wait(TIMEOUT_S)
            issued.append(updating)
            later.append(run("after"))  # waits for the update

        running = run("running", on_preview).result(TIMEOUT_S)
        engine.scheduler.call = call
        issued[0].join(TIMEOUT_S)
        after = later[0].result(TIMEOUT_S)
        assert running.metrics.weights_version == 0 and after.metrics.weights_version == 1
        np.testing.assert_array_equal(_pixels(running), _pixels(old_reference))
        assert np.abs(_pixels(after) - _pixels(old_reference)).max() > 10 / 255
        new_reference = run("new-reference").result(TIMEOUT_S)
        np.testing.assert_array_equal(_pixels(after), _pixels(new_reference))


async def test_async_omni_updates_weights_and_sleeping_weights_come_back_from_an_update(tiny_flux):
    """A sleep at level 2 drops the weights (meta tensors); an update then materialises the transformer, and
    `wake_up` reloads only what it did not set."""
    async with AsyncOmni(tiny_flux) as omni:
        new = _perturbed(_transformer_state(omni), seed=2)

        async def one(seed: int):
            return [o async for o in omni.generate("a cat", _params(seed))][-1]

        await omni.update_weights(new)
        reference = await one(5)
        assert reference.metrics.weights_version == 1
        await omni.sleep(level=2)
        transformer = _engine(omni).runner.pipeline.transformer
        assert transformer.proj_out.weight.is_meta
        await omni.update_weights(new)
        assert not transformer.proj_out.weight.is_meta
        with pytest.raises(WeightUpdateError, match=r"has shape \[32, 16\]; the update gives \[2\]"):
            await omni.update_weights({"x_embedder.weight": torch.zeros(2)})  # checked against the meta tensor
        await omni.wake_up()
        woken = await one(5)
        assert woken.metrics.weights_version == 2
        np.testing.assert_array_equal(_pixels(woken), _pixels(reference))


def test_a_split_pipeline_updates_the_stages_that_hold_the_component_and_reports_the_denoisers_version(tiny_flux):
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    with Omni(tiny_flux, deploy_config=deploy) as omni:
        engines = [stage.replicas[0].engine for stage in omni.engine.stages]
        (before,) = omni.generate("a cat", _params())
        transformer = named_tensors(engines[1].runner.pipeline.transformer)
        omni.update_weights(_perturbed(transformer, seed=4))
        text_encoder = named_tensors(engines[0].runner.pipeline.text_encoder)
        name = "final_layer_norm.bias"
        omni.update_weights({name: text_encoder[name] + 1}, component="text_encoder")
        assert [engine.weights_version for engine in engines] == [1, 1, 0]
        omni.update_weights({"decoder.conv_out.bias": torch.zeros(3)}, component="vae")  # all three hold the VAE
        assert [engine.weights_version for engine in engines] == [2, 2, 1]
        (after,) = omni.generate("a cat", _params())
        assert after.metrics.weights_version == 2
        assert [stage.weights_version for stage in after.metrics.stages] == [2, 2, 1]
        assert np.abs(_pixels(after) - _pixels(before)).max() > 10 / 255


# LoRA adapters given as tensors.


@pytest.fixture(scope="module")
def adapter(tiny_flux, tmp_path_factory):
    """A random adapter on the transformer at lora_alpha = 2 · rank, written with its config as diffusers' adapter
    metadata (its scaling is 2, not the 1 diffusers infers without it): its folder, the same file without the
    config, its tensors and its config."""
    path, tensors, config = write_lora_with_config(tiny_flux, str(tmp_path_factory.mktemp("lora-tensors")), seed=7)
    return path, os.path.join(path, "plain"), tensors, config


def test_an_adapter_given_as_tensors_makes_the_images_of_the_same_adapter_from_its_file(omni, adapter):
    path, plain, tensors, config = adapter
    omni.add_lora("file", path)
    omni.add_lora("tensors", tensors, config)
    omni.add_lora("unprefixed", {k.removeprefix("transformer."): v for k, v in tensors.items()}, config.to_dict())
    omni.add_lora("inferred", plain)  # the file without its config: alpha = rank
    try:
        names = ["file", "tensors", "unprefixed", "inferred"]
        outputs = omni.generate(["a cat"] * 5, [_params(lora={"name": n}) for n in names] + [_params()])
        file, given, unprefixed, inferred, base = map(_pixels, outputs)
        assert np.abs(file - base).max() > 10 / 255, "the adapter hardly changes the image"
        np.testing.assert_array_equal(given, file)
        np.testing.assert_array_equal(unprefixed, file)
        assert np.abs(inferred - file).max() > 1 / 255, "lora_alpha was not read from the config"
        listed = {m.name: m.path for m in omni.lora_adapters}
        assert listed["tensors"].startswith("tensors://tensors/") and listed["file"] == path
        # Evicted (two resident at most), then loaded again from the kept tensors.
        (again,) = omni.generate("a cat", _params(lora={"name": "tensors"}))
        np.testing.assert_array_equal(_pixels(again), file)
    finally:
        for name in ("file", "tensors", "unprefixed", "inferred"):
            omni.remove_lora(name)
    assert "tensors" not in _engine(omni).runner.lora._tensors


def test_tensors_without_a_config_or_a_config_with_a_path_are_refused(omni, adapter):
    path, _, tensors, config = adapter
    with pytest.raises(ValueError, match="needs its peft_config"):
        omni.add_lora("x", tensors)
    with pytest.raises(ValueError, match="peft_config goes with an adapter given as tensors"):
        omni.add_lora("x", path, config)
    with pytest.raises(ValueError, match="is not a LoraConfig's keywords"):
        omni.add_lora("x", tensors, {"rank": 4})
    assert [m.name for m in omni.lora_adapters] == []


def test_weights_update_by_their_diffusers_names_while_an_adapter_wraps_the_layers(omni, adapter, original, restore):
    _, _, tensors, config = adapter
    omni.add_lora("wrapping", tensors, config)
    try:
        assert (
            "transformer_blocks.0.attn.to_q.base_layer.weight" in _engine(omni).runner.pipeline.transformer.state_dict()
        )
        (before,) = omni.generate("a cat", _params(lora={"name": "wrapping"}))
        omni.update_weights(
            {"transformer_blocks.0.attn.to_q.weight": original["transformer_blocks.0.attn.to_q.weight"] * 3}
        )
        (after,) = omni.generate("a cat", _params(lora={"name": "wrapping"}))
        assert np.abs(_pixels(after) - _pixels(before)).max() > 0
    finally:
        omni.remove_lora("wrapping")


# A trainer in another process, over a gloo group.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(port: int, path: str) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(
        target=broadcast_from_file, args=("127.0.0.1", port, 2, path), daemon=True
    )
    process.start()
    return process


def test_a_trainer_in_another_process_broadcasts_weights_over_gloo(omni, original, tmp_path, restore):
    new = _perturbed(original, seed=3)
    path = str(tmp_path / "new.safetensors")
    save_file({k: v.contiguous() for k, v in new.items()}, path)
    (before,) = omni.generate("a cat", _params())
    port = _free_port()
    trainer = _trainer(port, path)
    assert omni.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2) == 1
    omni.update_weights_from_distributed(trainer_specs(path))
    trainer.join(TIMEOUT_S)
    assert trainer.exitcode == 0
    (after,) = omni.generate("a cat", _params())
    assert after.metrics.weights_version == before.metrics.weights_version + 1
    omni.update_weights(new)  # the same weights by value: the same image
    (by_value,) = omni.generate("a cat", _params())
    np.testing.assert_array_equal(_pixels(after), _pixels(by_value))
    assert np.abs(_pixels(after) - _pixels(before)).max() > 10 / 255


def test_a_refused_distributed_update_receives_every_broadcast_and_applies_nothing(omni, original, tmp_path):
    bad = str(tmp_path / "bad.safetensors")
    save_file({"proj_out.weight": original["proj_out.weight"] * 0, "x_embedder.weight": torch.zeros(3, 16)}, bad)
    (before,) = omni.generate("a cat", _params())
    port = _free_port()
    trainer = _trainer(port, bad)
    omni.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2)
    with pytest.raises(WeightUpdateError, match=r"x_embedder.weight has shape \[32, 16\]; the update gives \[3, 16\]"):
        omni.update_weights_from_distributed(trainer_specs(bad))
    trainer.join(TIMEOUT_S)
    assert trainer.exitcode == 0
    (after,) = omni.generate("a cat", _params())
    assert after.metrics.weights_version == before.metrics.weights_version
    np.testing.assert_array_equal(_pixels(after), _pixels(before))
    with pytest.raises(ValueError, match=r"ranks 2..2 do not fit in world_size 2"):
        omni.init_weight_update_group("127.0.0.1", port, rank_offset=2, world_size=2)
