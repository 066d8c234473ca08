"""Faults seen over HTTP: a dead engine loop, clients that go away, SIGTERM under load."""

import asyncio
import signal
import threading
import time

import aiohttp
import httpx
import pytest
import uvicorn

from vllm_omni.config import resolve_stage_configs
from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.api_server import build_app
from vllm_omni.testing.server import RemoteOmniServer, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUICK = {"size": "32x32", "num_inference_steps": 2, "response_format": "b64_json"}


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def gauge(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(f'vllm_omni:{name}{{replica="0",stage="0"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_dead_engine_loop_turns_health_503_and_fails_requests_fast(tiny_flux):
    """In-process server, so that the fault can be injected into the real scheduler."""
    port = free_port()
    serving = ServingConfig(host="127.0.0.1", port=port, served_model_names=["tiny"])
    app = build_app(tiny_flux, resolve_stage_configs(global_knobs={"max_num_seqs": 1}), serving, on_fatal=print)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200 if _listening(base) else False, timeout=120)
        scheduler = app.state.server.omni.engine.stages[0].replicas[0].engine.scheduler
        original_finish = scheduler.finish

        def finish_then_break(batch, outputs):
            original_finish(batch, outputs)
            raise RuntimeError("simulated scheduler bug")

        results = {}

        def post(name, steps):
            results[name] = httpx.post(
                f"{base}/v1/images/generations", json={"prompt": name, **QUICK, "num_inference_steps": steps}, timeout=60
            )

        running = threading.Thread(target=post, args=("running", 200))
        running.start()
        wait_for(lambda: gauge(base, "num_requests_running") == 1)
        scheduler.finish = finish_then_break
        waiting = threading.Thread(target=post, args=("waiting", 2))
        waiting.start()
        wait_for(lambda: gauge(base, "num_requests_waiting") == 1)
        running.join(60)
        waiting.join(60)
        assert results["running"].status_code == 200
        assert results["waiting"].status_code == 503
        assert results["waiting"].json()["error"]["code"] == "generation_failed"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "no replica of stage 0 is alive" in health.json()["error"]["message"]
        started = time.monotonic()
        late = httpx.post(f"{base}/v1/images/generations", json={"prompt": "late", **QUICK}, timeout=60)
        assert late.status_code == 503 and time.monotonic() - started < 5
        assert late.json()["error"]["code"] == "service_unavailable"
    finally:
        server.should_exit = True
        thread.join(60)


def _listening(base: str) -> bool:
    try:
        httpx.get(f"{base}/health")
        return True
    except httpx.HTTPError:
        return False


def test_a_client_that_disconnects_while_waiting_frees_its_slot(tiny_flux):
    with RemoteOmniServer(tiny_flux, ["--max-num-seqs", "1"]) as server:
        url = server.url_for("v1", "images", "generations")
        running = threading.Thread(
            target=lambda: httpx.post(url, json={"prompt": "long", **QUICK, "num_inference_steps": 150}, timeout=60)
        )
        running.start()
        wait_for(lambda: gauge(server.base_url, "num_requests_running") == 1)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"prompt": "gives up", **QUICK}, timeout=0.5)
        wait_for(lambda: gauge(server.base_url, "num_requests_waiting") == 0, timeout=10)
        running.join(60)
        wait_for(lambda: gauge(server.base_url, "num_requests_running") == 0, timeout=10)
    assert server.returncode == 0


def test_sigterm_under_load_stops_admission_and_exits_0(tiny_flux):
    """32 clients keep sending; SIGTERM mid-way. Every request ends: an image, a 503 envelope, or a connection
    the draining server refused or closed before reading a request on it. None hangs, and the exit code is 0."""
    outcomes: dict[str, int] = {}

    async def client(base: str, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while not stop.is_set():
                try:
                    async with session.post(f"{base}/v1/images/generations", json={"prompt": "x", **QUICK}) as r:
                        body = await r.json(content_type=None)
                        key = "ok" if r.status == 200 and body["data"] else f"{r.status}:{body['error']['code']}"
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    key = type(exc).__name__
                    stop.set()
                outcomes[key] = outcomes.get(key, 0) + 1

    with RemoteOmniServer(tiny_flux, ["--max-num-seqs", "4", "--shutdown-timeout-s", "20"]) as server:

        async def load() -> None:
            stop = asyncio.Event()
            clients = [asyncio.create_task(client(server.base_url, stop)) for _ in range(32)]
            await asyncio.sleep(2.0)
            server.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(*clients), timeout=90)

        asyncio.run(load())
        assert server.process.wait(timeout=60) == 0
    assert outcomes.get("ok", 0) > 0
    unexpected = {k: v for k, v in outcomes.items()
                  if k not in ("ok", "503:service_unavailable", "ClientConnectorError", "ServerDisconnectedError",
                               "ClientOSError")}  # fmt: skip
    assert unexpected == {}, outcomes
    assert "TimeoutError" not in outcomes
