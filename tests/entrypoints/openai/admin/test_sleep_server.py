"""vLLM's sleep-mode routes (``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``) on a real uvicorn server in
this process, served only with ``VLLM_SERVER_DEV_MODE=1``: a request that arrives while asleep waits and completes
after wake-up, ``/health`` says sleeping (200), and bad arguments are refused naming the field."""

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from vllm_omni.testing.processes.server import came_true, in_process_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KEY = "sk-sleep"
AUTH = {"Authorization": f"Bearer {KEY}"}
IMAGE = {"prompt": "a red cube", "size": "64x64", "num_inference_steps": 2, "seed": 3, "response_format": "b64_json"}


@pytest.fixture(scope="module")
def server(tiny_flux):
    """``(omni, base URL)`` of a dev-mode server with an API key."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # read when the app is built
        with in_process_server(tiny_flux, serving={"api_keys": [KEY]}) as (app, base):
            env.delenv("VLLM_SERVER_DEV_MODE")
            yield app.state.server.omni, base


def _post(base: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}{path}", headers=AUTH, timeout=120, **kwargs)


def _get(base: str, path: str) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers=AUTH, timeout=120)


def test_a_request_that_arrives_while_asleep_waits_and_completes_after_wake_up(server):
    omni, base = server
    first = _post(base, "/v1/images/generations", json=IMAGE)
    assert first.status_code == 200, first.text
    assert _get(base, "/is_sleeping").json() == {"is_sleeping": False}
    asleep = _post(base, "/sleep", params={"level": 2})
    assert asleep.status_code == 200 and asleep.json() == {"status": "sleeping", "level": 2}
    assert _get(base, "/is_sleeping").json() == {"is_sleeping": True}
    health = httpx.get(f"{base}/health", timeout=60)
    assert health.status_code == 200 and health.json()["status"] == "sleeping"
    assert health.json()["stages"][0]["status"] == "sleeping"

    answers = []
    waiting = threading.Thread(target=lambda: answers.append(_post(base, "/v1/images/generations", json=IMAGE)))
    waiting.start()
    assert came_true(lambda: omni.num_waiting == 1)  # held by the sleeping engine, not refused
    assert waiting.is_alive() and not answers
    woken = _post(base, "/wake_up")
    assert woken.status_code == 200 and woken.json() == {"status": "awake", "tags": None}
    waiting.join(120)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["data"] == first.json()["data"]  # the same image as before the sleep
    assert httpx.get(f"{base}/health", timeout=60).json()["status"] == "ok"


def test_level_from_a_json_body_and_tags_wake_in_parts(server):
    _, base = server
    assert _post(base, "/sleep", json={"level": 1}).json() == {"status": "sleeping", "level": 1}
    partial = _post(base, "/wake_up", params={"tags": "weights"})
    assert partial.json() == {"status": "sleeping", "tags": ["weights"]}
    rest = _post(base, "/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
    assert rest.json() == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
    assert _post(base, "/sleep").json() == {"status": "sleeping", "level": 1}  # the default level
    assert _post(base, "/wake_up").json()["status"] == "awake"


@pytest.mark.parametrize(
    "request_args, param, message",
    [
        ({"params": {"level": 3}}, "level", "level must be one of 0, 1, 2; got 3"),
        ({"params": {"level": "deep"}}, "level", "level must be one of 0, 1, 2; got 'deep'"),
        ({"json": {"level": "2"}}, "level", "level must be one of 0, 1, 2; got '2'"),
        ({"json": {"level": 1.5}}, "level", "level must be one of 0, 1, 2; got 1.5"),
        ({"json": {"depth": 1}}, "depth", "Unrecognized request argument supplied: depth"),
        ({"params": {"mode": "abort"}}, "mode", "Unrecognized query parameter: mode"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(server, request_args, param, message):
    omni, base = server
    answer = _post(base, "/sleep", **request_args)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    assert _get(base, "/is_sleeping").json() == {"is_sleeping": False}


def test_an_unknown_tag_is_refused_and_the_routes_need_the_api_key(server):
    _, base = server
    answer = _post(base, "/wake_up", params={"tags": "gpu"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tags"
    assert "weights, kv_cache, scheduling" in answer.json()["error"]["message"]
    assert httpx.post(f"{base}/sleep", timeout=60).status_code == 401
    assert httpx.get(f"{base}/is_sleeping", timeout=60).status_code == 401


def _app(model: str):
    from vllm_omni.config import resolve_stage_configs
    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.entrypoints.openai.app import build_app

    serving = ServingConfig(host="127.0.0.1", port=0, served_model_names=["tiny"])
    return build_app(model, resolve_stage_configs(), serving, on_fatal=print)


@pytest.mark.parametrize("setting", [None, "0"])
def test_without_dev_mode_the_routes_do_not_exist(tiny_flux, monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", setting)
    client = TestClient(_app(tiny_flux))  # no `with`: the lifespan (the model's load) does not run
    assert client.post("/sleep").status_code == 404
    assert client.post("/wake_up").status_code == 404
    assert client.get("/is_sleeping").status_code == 404


def test_with_dev_mode_the_routes_exist_and_wait_for_the_model(tiny_flux, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    client = TestClient(_app(tiny_flux))
    answer = client.post("/sleep")
    assert answer.status_code == 503 and "loading" in answer.json()["error"]["message"]
    assert client.get("/is_sleeping").status_code == 503
