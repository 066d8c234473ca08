"""Stage replicas as Ray actors on the run's real 2-node Ray cluster (``ray_cluster``: one CPU per node), on tiny
Flux."""

import gzip
import json
import os
import signal
import socket
import time
from collections import Counter

import numpy as np
import pytest
from prometheus_client import REGISTRY

from vllm_omni import Omni, OmniDiffusionSamplingParams, RequestAbortedError
from vllm_omni.testing.models.lora import stock_lora_images, write_random_lora
from vllm_omni.testing.processes.server import came_true

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _loaded_model(replica) -> str:
    """The folder the replica's engine loaded."""
    return ray.get(replica._actor.__ray_call__.remote(lambda actor: actor.replica.engine.od_config.model))


@pytest.fixture(scope="module")
def omni(ray_cluster, hf_cache):
    """Two replicas of max_num_seqs 2, one per node, with one torch thread each; LoRA on (no adapter until a test
    adds one). The model is the tiny Flux by repo id, from the Hugging Face cache."""
    cache, repo, _ = hf_cache
    with Omni(
        repo,
        download_dir=cache,
        num_replicas=2,
        max_num_seqs=2,
        placement_strategy="STRICT_SPREAD",
        ray_address=ray_cluster.address,
        enable_lora=True,
    ) as omni:
        yield omni


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(f"vllm_omni:{name}", labels) or 0.0


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.int16)


def _wait_all_alive(omni, timeout_s: float = 600.0) -> float:
    started = time.monotonic()
    while omni.engine.health()[0].status != "ok":
        assert time.monotonic() - started < timeout_s, f"replicas not back: {omni.engine.health()}"
        time.sleep(0.2)
    return time.monotonic() - started


def _wait_until(predicate, what: str, timeout_s: float = 600.0):
    """Poll ``predicate`` until it holds (a state change, never a fixed sleep); the deadline is only a backstop."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


def _wait_restarted(replica, old_pid: int, restarts_before: float) -> None:
    """Wait for the two state changes of a restart, in order: the replica marked down (the driver counts
    ``replica_restarts`` as it marks it down), then alive again in a new process."""
    labels = {"stage": "0", "replica": str(replica.info.index)}
    _wait_until(lambda: _sample("replica_restarts_total", **labels) > restarts_before, "the replica marked down")
    _wait_until(lambda: replica.is_alive and replica.info.pid != old_pid, "the replica alive in a new process")


def _hold_batches(replica, then_break: bool = False) -> None:
    """`hold_batches` in the replica's process, until `_release_batches` (the loads the stage routes by only grow
    until then)."""

    def hold(actor):  # runs in the replica's process
        from vllm_omni.testing.checks.faults import hold_batches

        actor.release_batches = hold_batches(actor.replica.engine.scheduler, then_break)

    ray.get(replica._actor.__ray_call__.remote(hold))


def _release_batches(replica) -> None:
    ray.get(replica._actor.__ray_call__.remote(lambda actor: actor.release_batches()))


def test_replicas_run_on_different_nodes_and_share_the_requests(omni):
    replicas = omni.engine.stages[0].replicas
    assert [_loaded_model(replica) for replica in replicas] == [omni.model] * 2  # one snapshot, on both nodes
    nodes = {replica.info.node_id for replica in replicas}
    assert nodes == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert omni.stage_configs[0].capacity == 4
    # On the CPU a replica runs num_cpus (here 1) torch threads.
    threads = [r._actor.__ray_call__.remote(lambda actor: __import__("torch").get_num_threads()) for r in replicas]
    assert ray.get(threads) == [1, 1]

    batches_before = {r: _sample("batch_num_requests_sum", stage="0", replica=r, task="image") for r in "01"}
    # Placed alternately: each replica gets both seeds.
    params = [
        OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=8, seed=i // 2 % 2) for i in range(8)
    ]
    for replica in replicas:  # no request finishes before all are placed, however slow the placing is
        _hold_batches(replica)
    try:
        futures = [omni.engine.add_request(f"share-{i}", "a red car", p) for i, p in enumerate(params)]
    finally:
        for replica in replicas:
            _release_batches(replica)
    outputs = [future.result(timeout=600) for future in futures]

    assert [o.error for o in outputs] == [None] * 8
    served = Counter(o.metrics["replica"] for o in outputs)
    assert set(served) == {0, 1}, served
    # Each replica's engine metrics reach this process's /metrics under its own label.
    for replica in "01":
        observed = _sample("batch_num_requests_sum", stage="0", replica=replica, task="image") - batches_before[replica]
        assert observed == served[int(replica)]
    # The same seed gives the same image on either replica.
    for seed in (0, 1):
        images = [_pixels(o) for o, p in zip(outputs, params, strict=True) if p.seed == seed]
        assert {o.metrics["replica"] for o, p in zip(outputs, params, strict=True) if p.seed == seed} == {0, 1}
        # Within the tolerance of a batch of another size (which of them share a batch depends on timing).
        assert all(np.abs(images[0] - image).max() <= 2 for image in images[1:])


def test_an_added_lora_adapter_loads_on_every_replica_and_both_serve_it_as_stock(omni, tiny_flux, tmp_path):
    path = write_random_lora(tiny_flux, str(tmp_path / "ink"), seed=1)
    call = {"height": 32, "width": 32, "num_inference_steps": 4}
    expected = np.asarray(
        stock_lora_images(tiny_flux, {"ink": path}, {"ink": 0.7}, "a red car", seed=3, **call).images[0],
        dtype=np.int16,
    )
    omni.add_lora("ink", path)
    try:
        assert [_sample("lora_adapters_resident", stage="0", replica=r) for r in "01"] == [1, 1]
        params = [OmniDiffusionSamplingParams(seed=3, lora={"name": "ink", "scale": 0.7}, **call) for _ in range(4)]
        replicas = omni.engine.stages[0].replicas
        for replica in replicas:  # placed alternately: each replica runs two of them
            _hold_batches(replica)
        try:
            futures = [omni.engine.add_request(f"lora-{i}", "a red car", p) for i, p in enumerate(params)]
        finally:
            for replica in replicas:
                _release_batches(replica)
        outputs = [future.result(timeout=600) for future in futures]
        assert {o.metrics["replica"] for o in outputs} == {0, 1}
        for output in outputs:
            assert np.abs(_pixels(output) - expected).max() <= 2
    finally:
        omni.remove_lora("ink")
    assert [_sample("lora_adapters_resident", stage="0", replica=r) for r in "01"] == [0, 0]


def test_a_tie_goes_to_the_replica_that_holds_the_same_batch_key(omni):
    engine = omni.engine
    # Two steps: a held replica resolves none of its requests, however fast it runs them (`_hold_batches`).
    small = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=0)
    large = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=0)
    # Loads when each is routed: (0,0) -> 0; (1,0) -> 1; tie (1,1): 1 holds the small key; (1,2) -> 0;
    # tie (2,2): 1 holds the small key; (2,3) -> 0. Index order alone would send the ties to replica 0.
    order = [("a", large), ("b", small), ("c", small), ("d", large), ("e", small), ("f", large)]
    for replica in engine.stages[0].replicas:  # the loads above hold only if no request finishes meanwhile
        _hold_batches(replica)
    try:
        futures = {name: engine.add_request(f"tie-{name}", "a cat", params) for name, params in order}
    finally:
        for replica in engine.stages[0].replicas:
            _release_batches(replica)
    placed = {name: future.result(timeout=600).metrics["replica"] for name, future in futures.items()}
    assert placed == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1, "f": 0}


def test_progress_and_abort_reach_the_replica_that_holds_the_request(omni):
    engine = omni.engine
    long = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1000, seed=0)
    futures = {f"long-{i}": engine.add_request(f"long-{i}", "a cat", long) for i in range(2)}  # one per replica

    def running(request_id):
        found = engine.progress(request_id)
        return found is not None and found[0] == "running" and 0 < found[1] < 1

    deadline = time.monotonic() + 60
    while not all(running(request_id) for request_id in futures):
        assert time.monotonic() < deadline, [engine.progress(request_id) for request_id in futures]
        time.sleep(0.05)
    assert all(engine.abort(request_id) for request_id in futures)
    for future in futures.values():
        with pytest.raises(RequestAbortedError):
            future.result(timeout=120)
    assert engine.progress("long-0") is None and not engine.abort("long-0")


def test_every_replica_sleeps_and_wakes_and_a_request_that_arrives_meanwhile_waits(omni):
    """Sleep at level 2 reaches each actor (its weights dropped in its own process); the driver counts what a
    sleeping replica holds as waiting, and the request runs once they wake (weights reloaded from the files)."""
    engine = omni.engine
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=11)
    before = omni.generate(["a cat"], params)[0]
    omni.sleep(2)
    assert omni.is_sleeping() and [h.status for h in omni.health()] == ["sleeping"]
    assert [_sample("engine_sleeping", stage="0", replica=r) for r in "01"] == [1, 1]
    future = engine.add_request("ray-asleep", "a cat", params)
    assert engine.num_waiting == 1
    assert came_true(lambda: engine.progress("ray-asleep") == ("waiting", 0.0))  # held by its actor, not started
    assert not future.done()
    omni.wake_up()
    assert not omni.is_sleeping() and [h.status for h in omni.health()] == ["ok"]
    assert np.abs(_pixels(future.result(timeout=600)) - _pixels(before)).max() <= 2
    assert [_sample("engine_sleeping", stage="0", replica=r) for r in "01"] == [0, 0]


def test_a_profile_writes_one_trace_per_replica_process_with_its_engine_work(omni, tmp_path):
    """vLLM's start_profile / stop_profile over Ray: each actor records its own process and writes its trace, named
    after its host, pid and replica. This process runs no engine and ``ignore_frontend`` leaves it out."""
    from vllm_omni.config.profiler import profiler_config
    from vllm_omni.orchestrator.engine_profiler import EngineProfiler

    config = profiler_config({"profiler": "torch", "torch_profiler_dir": str(tmp_path), "ignore_frontend": True})
    profiler = EngineProfiler(omni.engine.stages, config)
    profiler.start("ray")
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=5)
    assert all(output.error is None for output in omni.generate(["a", "b"], params))  # one on each replica
    traces = profiler.stop()
    replicas = {replica.info.pid: replica.info.index for replica in omni.engine.stages[0].replicas}
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(path) for path in traces) and len(traces) == 2
    for path in traces:
        pid = int(os.path.basename(path).split("_pid")[1].split("_")[0])
        assert os.path.basename(path).startswith(f"ray_{socket.gethostname()}_pid{pid}_stage0-replica{replicas[pid]}.")
        with gzip.open(path, "rt") as trace:
            ops = [e for e in json.load(trace)["traceEvents"] if e.get("name", "").startswith("aten::")]
        assert ops and {e["pid"] for e in ops} == {pid}


def test_killing_a_replica_mid_load_loses_no_request_and_it_comes_back(omni, capsys):
    stage = omni.engine.stages[0]
    victim = stage.replicas[0]
    old_pid = victim.info.pid
    retries_before = _sample("request_retries_total", stage="0")
    restarts_before = _sample("replica_restarts_total", stage="0", replica="0")
    _hold_batches(victim)  # never released: it still holds its requests when it is killed, however fast it is
    params = [OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=100 + i) for i in range(12)]
    futures = [omni.engine.add_request(f"kill-{i}", f"prompt {i}", p) for i, p in enumerate(params)]

    _wait_until(  # the victim is running a batch
        lambda: any((victim.progress(f"kill-{i}") or ("",))[0] == "running" for i in range(12)), "a batch running"
    )
    os.kill(old_pid, signal.SIGKILL)
    outputs = [future.result(timeout=600) for future in futures]  # nothing hangs, nothing fails
    finished = time.monotonic()

    retried = _sample("request_retries_total", stage="0") - retries_before
    counts = {"ok": sum(o.error is None for o in outputs), "retried": int(retried), "failed": 12 - len(outputs)}
    with capsys.disabled():
        print(f"\nreplica kill mid-load: {counts}")
    assert counts["ok"] == 12 and counts["retried"] >= 1

    _wait_restarted(victim, old_pid, restarts_before)
    with capsys.disabled():
        back_after = time.monotonic() - finished
        print(f"replica 0 back {back_after:.1f} s after the last request finished (new pid {victim.info.pid})")
    # The restarted replica serves again, and every request, retried or not, gave the image its seed gives.
    again = omni.generate([f"prompt {i}" for i in range(12)], params)
    assert {o.metrics["replica"] for o in again} == {0, 1}
    # (Within the tolerance of a batch of another size: which requests share a batch depends on timing.)
    assert all(np.abs(_pixels(a) - _pixels(b)).max() <= 2 for a, b in zip(outputs, again, strict=True))


def test_a_replica_whose_engine_loop_dies_is_restarted_and_its_requests_rerun(omni):
    _wait_all_alive(omni)
    survivor, victim = omni.engine.stages[0].replicas
    old_pid = victim.info.pid
    restarts = _sample("replica_restarts_total", stage="0", replica="1")
    retries = _sample("request_retries_total", stage="0")
    # Both replicas hold their batches while the six requests are placed, three on each, so the victim holds
    # more than one batch (max_num_seqs 2); once released, its engine loop dies after its first batch.
    _hold_batches(survivor)
    _hold_batches(victim, then_break=True)
    params = [OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=i) for i in range(6)]
    try:
        futures = [omni.engine.add_request(f"loop-{i}", "a blue house", p) for i, p in enumerate(params)]
    finally:
        _release_batches(victim)
        _release_batches(survivor)
    outputs = [future.result(timeout=600) for future in futures]
    assert [o.error for o in outputs] == [None] * 6  # those the dying loop held were re-run on replica 0
    assert _sample("request_retries_total", stage="0") > retries
    # Marked down (not just "all alive", which also holds before the driver has noticed), then back.
    _wait_restarted(victim, old_pid, restarts)
