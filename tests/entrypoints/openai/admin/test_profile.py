"""vLLM's profiler routes (``POST /start_profile``, ``POST /stop_profile``) on a real ``vllm serve --omni
--profiler-config`` server: a profiled request's engine work is in the trace the server process writes (one file: its
engine is inline), the routes refuse a second start and a stop without a start, and without profiling they are 404."""

import gzip
import json
import os
import re
import socket

import httpx
import pytest
from fastapi.testclient import TestClient

from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KEY = "sk-profile"
AUTH = {"Authorization": f"Bearer {KEY}"}
IMAGE = {"prompt": "a red cube", "size": "64x64", "num_inference_steps": 2, "seed": 3, "response_format": "b64_json"}


@pytest.fixture(scope="module")
def server(tiny_flux, tmp_path_factory):
    """``(server, trace folder)``: profiling on, in vLLM's dotted flag form."""
    traces = tmp_path_factory.mktemp("traces")
    args = ["--api-key", KEY, "--profiler-config.profiler=torch", f"--profiler-config.torch_profiler_dir={traces}"]
    with RemoteOmniServer(tiny_flux, args) as server:
        yield server, traces
    assert server.returncode == 0


def _post(server: RemoteOmniServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for(path), headers=AUTH, timeout=300, **kwargs)


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def test_a_profiled_request_is_in_the_trace_of_the_server_process(server):
    server, traces = server
    earlier = set(os.listdir(traces))  # the module's other tests' traces, in whatever order they ran
    started = _post(server, "start_profile", json={"profile_prefix": "flux-run"})
    assert started.status_code == 200 and started.json() == {"status": "profiling"}, started.text
    answer = _post(server, "v1/images/generations", json=IMAGE)
    assert answer.status_code == 200, answer.text
    stopped = _post(server, "stop_profile")
    assert stopped.status_code == 200, stopped.text
    [path] = stopped.json()["traces"]  # one process: the server, its one engine inline
    assert os.path.dirname(path) == str(traces) and set(os.listdir(traces)) - earlier == {os.path.basename(path)}
    name = f"flux-run_{socket.gethostname()}_pid{server.process.pid}_server_stage0-replica0"
    assert re.fullmatch(re.escape(name) + r"\.\d+\.pt\.trace\.json\.gz", os.path.basename(path)), path
    assert os.path.getsize(path) > 0
    events = _events(path)
    ops = [event for event in events if event.get("name", "").startswith("aten::")]
    forwards = [event for event in events if re.search(r"transformer_flux\.py\(\d+\): forward", event.get("name", ""))]
    assert ops and forwards, "the denoiser's forward and its ops are in the trace"
    assert {event["tid"] for event in forwards} <= {event["tid"] for event in ops}
    assert {event["pid"] for event in ops} == {server.process.pid}


def test_a_second_start_and_a_stop_without_start_are_refused(server):
    server, _ = server
    assert _post(server, "start_profile").status_code == 200
    again = _post(server, "start_profile")
    assert again.status_code == 409 and again.json()["error"]["code"] == "profiler_active"
    assert "stop it first (POST /stop_profile)" in again.json()["error"]["message"]
    assert _post(server, "stop_profile").status_code == 200
    never = _post(server, "stop_profile")
    assert never.status_code == 409 and never.json()["error"]["code"] == "profiler_not_active"
    assert "start one first (POST /start_profile)" in never.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"profile_prefix": "../x"}, "profile_prefix", "profile_prefix must be 1-128 ASCII characters"),
        ({"delay_iterations": 2}, "delay_iterations", "Unrecognized request argument supplied: delay_iterations"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(server, body, param, message):
    server, _ = server
    answer = _post(server, "start_profile", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param and message in answer.json()["error"]["message"]
    assert _post(server, "stop_profile").status_code == 409  # nothing started


def test_the_routes_need_the_api_key(server):
    server, _ = server
    assert httpx.post(server.url_for("start_profile"), timeout=60).status_code == 401
    assert httpx.post(server.url_for("stop_profile"), timeout=60).status_code == 401


def test_without_profiling_the_routes_do_not_exist(tiny_flux):
    from vllm_omni.config import resolve_stage_configs
    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.entrypoints.openai.app import build_app

    serving = ServingConfig(host="127.0.0.1", port=0, served_model_names=["tiny"])
    client = TestClient(build_app(tiny_flux, resolve_stage_configs(), serving, on_fatal=print))  # no model load
    assert client.post("/start_profile").status_code == 404
    assert client.post("/stop_profile").status_code == 404
