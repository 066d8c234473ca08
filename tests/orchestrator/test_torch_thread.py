"""One thread owns each engine's torch work: loading, warm-up, every encode, forward and decode, and the conversion
to images all run on the engine's own thread, and no other thread of the process runs a torch op.

With libgomp, a second thread that runs torch ops gets its own OpenMP team, and every forward after it slows down
(docs/performance.md). The profiler below records the ops of every thread of the process, with the thread that
ran each one.
"""

import asyncio
import os
from collections import defaultdict

import pytest
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig, engine_torch_threads, resolve_stage_configs

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MARK = "vllm-omni-test-main-thread"
PARAMS = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=0)


def _ops_by_thread(run) -> tuple[dict[int, set[str]], int]:
    """The torch ops each thread ran during ``run()`` (profiler thread ids), and the id of this (main) thread."""
    config = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        with record_function(MARK):  # an event (not an op) that gives this thread's id
            pass
        run()
    ops: dict[int, set[str]] = defaultdict(set)
    for event in prof.events():
        if event.name != MARK and not event.name.startswith("profiler::"):
            ops[event.thread].add(event.name)
    main = next(event.thread for event in prof.events() if event.name == MARK)
    return dict(ops), main


def _three_stages() -> DeployConfig:
    return DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )


@pytest.mark.parametrize(
    "engine_kwargs, engines",
    [
        pytest.param({}, 1, id="request-mode"),
        pytest.param({"execution_mode": "step", "max_num_seqs": 2}, 1, id="step-mode"),
        pytest.param({"deploy_config": _three_stages()}, 3, id="three-inline-stages"),
    ],
)
def test_load_and_requests_run_torch_only_on_the_engine_threads(tiny_flux, engine_kwargs, engines):
    def run():
        with Omni(model=tiny_flux, **engine_kwargs) as omni:
            outputs = omni.generate(["a red cube", "a blue ball"], [PARAMS, PARAMS.model_copy(update={"seed": 1})])
            assert all(output.error is None and len(output.images) == 1 for output in outputs)

    ops, main = _ops_by_thread(run)
    assert main not in ops, f"the main thread ran torch ops: {sorted(ops.get(main, ()))[:10]}"
    # One thread per engine, and each of them loaded its part and ran it (a load alone runs no forward).
    assert len(ops) == engines, {thread: sorted(names)[:5] for thread, names in ops.items()}
    assert any("aten::linear" in names or "aten::addmm" in names for names in ops.values())


def test_async_omni_warm_up_and_requests_stay_on_the_engine_thread(tiny_flux):
    async def serve():
        async with AsyncOmni(model=tiny_flux, max_num_seqs=2) as omni:
            await omni.warm_up()
            results = await asyncio.gather(
                *(_one(omni, f"prompt {i}", PARAMS.model_copy(update={"seed": i})) for i in range(2))
            )
            assert all(len(output.images) == 1 for output in results)

    ops, main = _ops_by_thread(lambda: asyncio.run(serve()))
    assert main not in ops and len(ops) == 1


def test_sleep_and_wake_up_run_torch_only_on_the_engine_thread(tiny_flux):
    """Dropping the weights, reloading them from the files and moving them all happen on the engine's thread."""
    with Omni(model=tiny_flux) as omni:

        def run():
            for level in (2, 1):
                omni.sleep(level)
                omni.wake_up()
            assert omni.generate(["a red cube"], PARAMS)[0].error is None

        ops, main = _ops_by_thread(run)
    assert main not in ops and len(ops) == 1
    assert any("aten::empty_like" in names for names in ops.values())  # the level-2 drop ran, and was recorded


async def _one(omni: AsyncOmni, prompt: str, params: OmniDiffusionSamplingParams):
    async for output in omni.generate(prompt, params):
        return output


def test_inline_stages_split_the_cores_and_ray_replicas_run_their_num_cpus():
    cores = len(os.sched_getaffinity(0))
    three = resolve_stage_configs(_three_stages())
    assert engine_torch_threads(three) == dict.fromkeys((0, 1, 2), max(1, cores // 3))
    assert engine_torch_threads(resolve_stage_configs()) == {0: cores}
    mixed = resolve_stage_configs(_three_stages(), stage_overrides={0: {"num_replicas": 2, "num_cpus": 3}})
    assert engine_torch_threads(mixed) == {0: 3, 1: max(1, cores // 2), 2: max(1, cores // 2)}
