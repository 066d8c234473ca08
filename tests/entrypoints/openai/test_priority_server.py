"""``priority`` over HTTP on the shared tiny-Flux server, whose ``--scheduling-policy`` is the default ``fcfs``: a
priority other than 0 is refused as vLLM refuses it, naming the field and the flag; 0 runs, and is counted in the
histograms by priority class. (The order itself is the scheduler's: tests/diffusion/engine/test_scheduler.py.)"""

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AUTH = {"Authorization": "Bearer sk-test"}  # the shared servers' (conftest.py)
FAST = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 2, "seed": 1}


def _post(server, *route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1", *route), json=body, headers=AUTH, timeout=300)


def _count(server, sample: str) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith(f"vllm_omni:{sample} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (("images", "generations"), {**FAST, "priority": 3}),
        (("chat", "completions"), {"messages": [{"role": "user", "content": "a cat"}], "priority": -1}),
    ],
)
def test_a_priority_under_fcfs_is_a_400_naming_the_field_and_the_flag(flux_server, route, body):
    response = _post(flux_server, *route, body=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority", error
    assert f"Got priority {body['priority']} but Priority scheduling is not enabled" in error["message"], error
    assert "--scheduling-policy priority" in error["message"] and "'fcfs' (default)" in error["message"], error


def test_priority_zero_runs_and_is_observed_in_its_class(flux_server):
    sample = 'e2e_request_latency_seconds_count{priority="0"}'
    before = _count(flux_server, sample)
    queued = _count(flux_server, 'request_queue_time_by_priority_seconds_count{priority="0"}')
    response = _post(flux_server, "images", "generations", body={**FAST, "priority": 0})
    assert response.status_code == 200, response.text
    assert _count(flux_server, sample) == before + 1
    assert _count(flux_server, 'request_queue_time_by_priority_seconds_count{priority="0"}') == queued + 1
