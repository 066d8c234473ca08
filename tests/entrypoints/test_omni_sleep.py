"""`Omni.sleep` / `wake_up` / `is_sleeping` and `AsyncOmni`'s, inline, on real tiny pipelines (docs/rl.md, "Sleep
and wake"): the same image after a round trip at each level, requests that arrive while asleep wait and run after
wake-up, sleep waits for the running batch, vLLM's tags, and on this CPU the process's resident memory falls by at
least the denoiser's size at level 2."""

import asyncio
import threading

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.processes.server import came_true

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PARAMS = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=7)


def _pixels(output) -> np.ndarray:
    assert output.error is None, output.error
    return np.asarray(output.images[0])


def _engine(omni):
    return omni.engine.stages[0].replicas[0].engine


def _sleeping_gauge() -> float | None:
    return REGISTRY.get_sample_value("vllm_omni:engine_sleeping", {"stage": "0", "replica": "0"})


@pytest.fixture(scope="module")
def omni(tiny_flux):
    with Omni(model=tiny_flux, max_num_seqs=2, request_batch_max_wait_ms=0) as omni:
        yield omni


@pytest.fixture(scope="module")
def reference(omni) -> np.ndarray:
    return _pixels(omni.generate(["a red cube"], PARAMS)[0])


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_round_trip_at_each_level_gives_the_same_image(omni, reference, level):
    omni.sleep(level)
    assert omni.is_sleeping() and _sleeping_gauge() == 1
    assert [h.status for h in omni.health()] == ["sleeping"]
    transformer = _engine(omni).runner.pipeline.transformer
    assert all(p.is_meta for p in transformer.parameters()) == (level == 2)
    omni.wake_up()
    assert not omni.is_sleeping() and _sleeping_gauge() == 0
    assert [h.status for h in omni.health()] == ["ok"]
    assert not any(p.is_meta for p in transformer.parameters())
    assert np.array_equal(_pixels(omni.generate(["a red cube"], PARAMS)[0]), reference)


def test_a_request_that_arrives_while_asleep_waits_and_runs_after_wake_up(omni, reference):
    omni.sleep(2)
    future = omni.engine.add_request("while-asleep", "a red cube", PARAMS)
    assert omni.progress("while-asleep") == ("waiting", 0.0) and omni.num_waiting == 1
    assert not future.done()
    omni.wake_up()
    assert np.array_equal(_pixels(future.result(timeout=120)), reference)
    assert omni.num_waiting == 0


def test_sleep_returns_once_the_running_batch_has_finished(omni, reference):
    """The running batch is held inside its denoiser forward until the sleep is pending: it finishes on its
    weights, and the sleep only then."""
    entered, release = threading.Event(), threading.Event()

    def hold(*_):
        entered.set()
        assert release.wait(120)

    handle = _engine(omni).runner.pipeline.transformer.register_forward_pre_hook(hold)
    try:
        future = omni.engine.add_request("running", "a red cube", PARAMS)
        assert entered.wait(120)
        sleeper = threading.Thread(target=omni.sleep, args=(2,))
        sleeper.start()
        assert came_true(lambda: _engine(omni).scheduler._calls)  # the sleep waits on the engine
        assert omni.progress("running")[0] == "running" and not omni.is_sleeping()
        handle.remove()
        release.set()
        sleeper.join(120)
        assert not sleeper.is_alive() and omni.is_sleeping()
        assert future.done() and np.array_equal(_pixels(future.result()), reference)
    finally:
        handle.remove()
        release.set()
        omni.wake_up()


def test_vllms_tags_wake_in_parts_and_repeated_calls_are_harmless(omni, reference):
    omni.wake_up()  # awake already
    omni.sleep(1)
    omni.sleep(1)
    omni.sleep(0)  # shallower: nothing changes
    omni.wake_up(["weights"])
    assert omni.is_sleeping()  # its kv_cache (nothing, for diffusion) still sleeps, as on vLLM
    omni.wake_up(["kv_cache"])
    assert not omni.is_sleeping()
    with pytest.raises(ValueError, match="level must be one of 0, 1, 2; got 3"):
        omni.sleep(3)
    with pytest.raises(ValueError, match="tags must be among weights, kv_cache, scheduling; got 'gpu'"):
        omni.wake_up(["gpu"])
    assert not omni.is_sleeping()
    assert np.array_equal(_pixels(omni.generate(["a red cube"], PARAMS)[0]), reference)


def test_a_lora_adapter_loads_at_level_1_but_not_while_the_weights_are_dropped(tiny_sd, tmp_path):
    from vllm_omni.testing.models.lora import write_random_lora

    path = write_random_lora(tiny_sd, str(tmp_path / "lora"))
    with Omni(model=tiny_sd, enable_lora=True) as omni:
        omni.sleep(2)
        with pytest.raises(ValueError, match="sleeps at level 2 .* wake it up to load 'style'"):
            omni.add_lora("style", path)
        omni.wake_up()
        omni.sleep(1)
        omni.add_lora("style", path)  # the weights stay in memory at level 1
        omni.wake_up()
        params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, lora=[{"name": "style"}])
        assert omni.generate(["a red cube"], params)[0].error is None


def test_step_mode_sleeps_and_wakes_with_a_request_waiting(tiny_flux):
    with Omni(model=tiny_flux, execution_mode="step", max_num_seqs=2) as omni:
        before = _pixels(omni.generate(["a red cube"], PARAMS)[0])
        omni.sleep(2)
        future = omni.engine.add_request("step", "a red cube", PARAMS)
        assert omni.progress("step") == ("waiting", 0.0) and omni.is_sleeping()
        omni.wake_up()
        assert np.array_equal(_pixels(future.result(timeout=120)), before)


def test_async_omni_sleeps_and_wakes(tiny_flux):
    async def run():
        async with AsyncOmni(model=tiny_flux) as omni:

            async def one():
                return [output async for output in omni.generate("a red cube", PARAMS, request_id="async")][-1]

            before = _pixels(await one())
            await omni.sleep(2)
            assert await omni.is_sleeping()
            waiting = asyncio.create_task(one())
            while omni.num_waiting == 0:  # until the engine holds it
                await asyncio.sleep(0.01)
            assert not waiting.done() and omni.progress("async") == ("waiting", 0.0)
            await omni.wake_up()
            assert not await omni.is_sleeping()
            assert np.array_equal(_pixels(await waiting), before)

    asyncio.run(run())


# Resident memory: a denoiser big enough to measure.


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory) -> str:
    """The tiny Flux with a 512-wide transformer (72 MiB in float32), stored in bfloat16: loaded as float32, its
    weights are memory the process allocated (as any dtype conversion makes them), not pages of the file."""
    from diffusers import FluxTransformer2DModel

    from vllm_omni.testing.models.tiny_models import build_tiny_flux

    pipeline = build_tiny_flux()
    pipeline.transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=128,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[32, 48, 48],
    ).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("wide-flux")
    pipeline.save_pretrained(path)
    return str(path)


def test_level_2_frees_at_least_the_denoisers_size_of_resident_memory(wide_flux):
    params = PARAMS.model_copy(update={"height": 64, "width": 64})
    with Omni(model=wide_flux, dtype="float32") as omni:
        before = _pixels(omni.generate(["a red cube"], params)[0])
        transformer = _engine(omni).runner.pipeline.transformer
        denoiser = sum(p.numel() * p.element_size() for p in transformer.parameters())
        assert denoiser >= 64 * 2**20
        awake = _resident_bytes()
        omni.sleep(2)
        asleep = _resident_bytes()
        omni.wake_up()
        woken = _resident_bytes()
        print(
            f"denoiser {denoiser / 2**20:.1f} MiB; resident: awake {awake / 2**20:.1f} MiB, asleep "
            f"{asleep / 2**20:.1f} MiB (fell {(awake - asleep) / 2**20:.1f} MiB), woken {woken / 2**20:.1f} MiB"
        )
        # The text encoders and the VAE are dropped too: the fall exceeds the denoiser alone.
        assert awake - asleep >= denoiser
        assert np.array_equal(_pixels(omni.generate(["a red cube"], params)[0]), before)
