"""``vllm serve --omni --num-replicas 2``: a real server whose stage runs as two Ray actors (a local Ray it starts
itself, and stops on SIGTERM: the suite's one server without a Ray address; the other Ray tests join the run's
``ray_cluster``). Losing a replica under load loses no request and ``/health`` reports the degraded stage; with no
live replica requests get 503 envelopes until Ray brings one back."""

import os
import pathlib
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vllm_omni.testing.processes.server import RemoteOmniServer

pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Long enough that a replica killed once both run still holds work (its batch of two and two more behind it).
BODY = {"size": "32x32", "num_inference_steps": 80, "response_format": "b64_json"}


@pytest.fixture(scope="module")
def server(tiny_flux):
    with RemoteOmniServer(tiny_flux, ["--num-replicas", "2", "--max-num-seqs", "2", "--num-cpus", "1"]) as server:
        # As the server started, before any test of the module served requests or restarted a replica (they run in
        # any order).
        server.metrics_at_start = httpx.get(server.url_for("metrics"), timeout=60).text
        yield server
    assert server.returncode == 0
    assert _replica_pids(server) == []  # SIGTERM stopped the replicas and the Ray it started


def _replica_pids(server) -> list[int]:
    """The replica actors' processes: Ray names them ``ray::_ReplicaActor``; they are in the server's session."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and b"ray::_ReplicaActor" in (proc / "cmdline").read_bytes()
                and os.getsid(int(proc.name)) == server.process.pid
            ):
                pids.append(int(proc.name))
        except OSError:
            continue
    return sorted(pids)


def _health(server) -> tuple[int, dict]:
    response = httpx.get(server.url_for("health"), timeout=60)
    return response.status_code, response.json()


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while (value := predicate()) is None or value is False:
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout} s"
        time.sleep(0.1)
    return value


def _post(server, seed: int, **fields) -> httpx.Response:
    body = {"prompt": f"prompt {seed}", "seed": seed, **BODY, **fields}
    return httpx.post(server.url_for("v1", "images", "generations"), json=body, timeout=180)


def _retries(server) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith('vllm_omni:request_retries_total{stage="0"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _running(server) -> list[float]:
    """``num_requests_running`` of replicas 0 and 1 (from /metrics)."""
    lines = httpx.get(server.url_for("metrics"), timeout=60).text.splitlines()
    prefixes = [f'vllm_omni:num_requests_running{{replica="{replica}",stage="0"}} ' for replica in "01"]
    return [next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(p)), 0.0) for p in prefixes]


def test_health_lists_every_live_replica(server):
    assert _health(server) == (
        200,
        {"status": "ok", "stages": [{"stage_id": 0, "status": "ok", "num_replicas": 2, "alive_replicas": [0, 1]}]},
    )
    assert len(_replica_pids(server)) == 2
    metrics = httpx.get(server.url_for("metrics")).text
    assert 'vllm_omni:stage_replicas{stage="0",state="alive"} 2.0' in metrics
    # The warm-up ran one request on each replica.
    for replica in "01":
        count = f'vllm_omni:batch_num_requests_count{{replica="{replica}",stage="0",task="image"}} 1.0'
        assert count in server.metrics_at_start


def test_losing_a_replica_under_load_loses_no_request_and_health_reports_the_degraded_stage(server):
    victim, survivor = _replica_pids(server)
    retries = _retries(server)
    with ThreadPoolExecutor(8) as pool:
        responses = [pool.submit(_post, server, seed) for seed in range(8)]
        # Under load: both replicas run a batch, and each holds more requests behind it.
        _wait(lambda: all(_running(server)), 120, "both replicas running")
        os.kill(victim, signal.SIGKILL)
        status, body = _wait(lambda: (h := _health(server))[1]["status"] == "degraded" and h, 30, "degraded health")
        results = [r.result() for r in responses]
    assert status == 200 and body["stages"][0]["status"] == "degraded" and len(body["stages"][0]["alive_replicas"]) == 1
    assert [r.status_code for r in results] == [200] * 8, [r.text for r in results if r.status_code != 200]
    assert _retries(server) > retries
    _wait(lambda: _health(server)[1]["status"] == "ok", 120, "replica back")
    assert survivor in _replica_pids(server) and victim not in _replica_pids(server)


def test_with_no_live_replica_requests_get_503_envelopes_until_one_is_back(server):
    _wait(lambda: _health(server)[1]["status"] == "ok", 120, "both replicas alive")
    with ThreadPoolExecutor(4) as pool:
        responses = [pool.submit(_post, server, seed) for seed in range(4)]
        _wait(lambda: all(_running(server)), 120, "both replicas running")  # each holds its requests when it dies
        for pid in _replica_pids(server):
            os.kill(pid, signal.SIGKILL)
        status, body = _wait(lambda: (h := _health(server))[0] == 503 and h, 30, "health 503")
        results = [r.result() for r in responses]
    assert (
        body["error"]["code"] == "service_unavailable" and "no replica of stage 0 is alive" in body["error"]["message"]
    )
    # In flight when both died: each is re-run once, and answers a 503 envelope, never a hang; or 200 when Ray
    # brought a replica back in time for the re-run (how fast a restart is depends on the machine).
    for response in results:
        assert response.status_code in (200, 503), response.text
        if response.status_code == 503:
            assert response.json()["error"]["code"] == "service_unavailable"
    # Two steps: these two only ask whether a replica serves, and none is killed under them.
    refused = _post(server, 99, num_inference_steps=2)  # 503 while no replica is back yet, as the health check said
    assert refused.status_code == 200 or refused.json()["error"]["type"] == "server_error"
    _wait(lambda: _health(server)[0] == 200, 120, "a replica back")
    assert _post(server, 100, num_inference_steps=2).status_code == 200
    # The server as this module's other tests expect it, in whatever order they run: both replicas live (a SIGTERM
    # while Ray still restarts one also made the server abort instead of exiting 0).
    _wait(lambda: _health(server)[1]["status"] == "ok", 120, "both replicas back")
