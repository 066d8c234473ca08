"""A real `vllm serve MODEL --omni` process on 127.0.0.1, driven with the real `openai` client."""

import asyncio
import base64
import contextlib
import io
import json
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test-key"
FAST = {"num_inference_steps": 4}


def metric(server: RemoteOmniServer, name: str, **labels) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    text = httpx.get(server.url_for("metrics"), timeout=60).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(r"^([^{ ]+)(?:\{([^}]*)\})? (\S+)$", line)
        if match and match[1] == name:
            got = ",".join(sorted((match[2] or "").split(","))) if match[2] else ""
            if got == want:
                return float(match[3])
    return 0.0


def phase_samples(server: RemoteOmniServer, api: str) -> dict[str, tuple[float, float]]:
    """``{phase: (count, sum)}`` of the server's ``vllm_omni:request_phase_seconds`` for ``api``."""
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(server.url_for("metrics"), timeout=60).text):
        for sample in family.samples:
            if sample.name.startswith("vllm_omni:request_phase_seconds_") and sample.labels["api"] == api:
                entry = samples.setdefault(sample.labels["phase"], [0.0, 0.0])
                if sample.name.endswith("_count"):
                    entry[0] = sample.value
                elif sample.name.endswith("_sum"):
                    entry[1] = sample.value
    return {phase: (count, total) for phase, (count, total) in samples.items()}


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def live_server(tiny_flux, tmp_path_factory):
    """The module's server, as a function that returns it running: the SIGTERM test stops it, and a test that runs
    after that one (in a random order) gets a new one."""
    args = [
        *("--max-num-seqs", "4", "--request-batch-max-wait-ms", "300", "--api-key", API_KEY),
        *("--served-model-name", "tiny-flux", "tiny-alias", "--max-waiting-requests", "4"),
        *("--max-image-pixels", str(64 * 64), "--max-inference-steps", "400", "--max-prompt-length", "200"),
        # The SIGTERM test's request must finish in the drain (a real `vllm` process: that test is about the
        # executable's signal handling); a busy machine may need minutes for it.
        *("--shutdown-timeout-s", "600"),
    ]
    with contextlib.ExitStack() as servers:
        running: list[RemoteOmniServer] = []

        def live() -> RemoteOmniServer:
            if not running or running[-1].process.poll() is not None:
                log = tmp_path_factory.mktemp("server") / "server.log"
                running.append(servers.enter_context(RemoteOmniServer(tiny_flux, args, log_path=str(log), cli=True)))
                running[-1].log = log
            return running[-1]

        yield live


@pytest.fixture
def server(live_server) -> RemoteOmniServer:
    return live_server()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)


def test_health_was_503_until_the_model_was_warm(server):
    assert server.health_before_ready, "the server answered 200 before its model was loaded"
    status, body = server.health_before_ready[0]
    assert status == 503 and body["error"]["code"] == "service_unavailable"
    assert httpx.get(server.url_for("health")).status_code == 200


def test_startup_logs_the_resolved_knobs_with_their_sources(server):
    log = server.log.read_text()
    assert "max_num_seqs=4 (cli)" in log and "request_batch_max_wait_ms=300.0 (cli)" in log
    assert metric(server, "vllm_omni:stage_max_num_seqs", stage="0", source="cli") == 4
    info = {
        s.labels["knob"]: (s.labels["value"], s.labels["source"])
        for family in text_string_to_metric_families(httpx.get(server.url_for("metrics"), timeout=60).text)
        if family.name == "vllm_omni:stage_knob_info"
        for s in family.samples
    }
    assert info["max_num_seqs"] == ("4", "cli") and info["request_batch_max_wait_ms"] == ("300.0", "cli")
    assert info["execution_mode"] == ("request", "default") and info["cache_backend"] == ("none", "default")
    assert info["vae_tiling"] == ("false", "default") and info["max_batch_pixels"] == ("null", "default")
    assert "num_gpus" not in info  # a Ray-only knob does not apply to an inline stage, as in the start-up line


def test_four_concurrent_requests_run_as_one_batch(server):
    batches_of_4 = metric(
        server, "vllm_omni:batch_num_requests_bucket", stage="0", replica="0", task="image", le="4.0"
    ) - metric(server, "vllm_omni:batch_num_requests_bucket", stage="0", replica="0", task="image", le="2.0")
    count, total = (
        metric(server, f"vllm_omni:batch_num_requests_{s}", stage="0", replica="0", task="image")
        for s in ("count", "sum")
    )

    async def four():
        async with openai.AsyncOpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(
                *(
                    aclient.images.generate(
                        prompt=f"prompt {i}", size="32x32", response_format="b64_json", extra_body=FAST
                    )
                    for i in range(4)
                )
            )

    responses = asyncio.run(four())
    for response in responses:
        image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        assert (image.format, image.size) == ("PNG", (32, 32))
    assert metric(server, "vllm_omni:batch_num_requests_count", stage="0", replica="0", task="image") == count + 1
    assert metric(server, "vllm_omni:batch_num_requests_sum", stage="0", replica="0", task="image") == total + 4
    assert (
        metric(server, "vllm_omni:batch_num_requests_bucket", stage="0", replica="0", task="image", le="4.0")
        - metric(server, "vllm_omni:batch_num_requests_bucket", stage="0", replica="0", task="image", le="2.0")
        == batches_of_4 + 1
    )


@pytest.mark.parametrize("output_format,pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_formats_sizes_and_n(client, output_format, pil_format):
    kwargs = {"output_compression": 80} if output_format != "png" else {}
    response = client.images.generate(
        model="tiny-alias",
        prompt="a cat",
        n=2,
        size="64x32",
        response_format="b64_json",
        output_format=output_format,
        extra_body={**FAST, "seed": 7},
        **kwargs,
    )
    assert len(response.data) == 2 and response.created > 0
    for item in response.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert (image.format, image.size) == (pil_format, (64, 32))
        assert item.revised_prompt == "a cat"


def test_seed_makes_the_request_reproducible(client):
    def once():
        return (
            client.images.generate(
                prompt="a dog", size="32x32", response_format="b64_json", extra_body={**FAST, "seed": 11}
            )
            .data[0]
            .b64_json
        )

    assert once() == once()


IMAGE_PHASES = {"parse", "validation", "completion", "handoff", "queue", "execution", "encoding", "response"}


def test_a_completed_request_observes_each_of_its_phases_once(server, client):
    before = phase_samples(server, "images")
    response = client.images.generate(prompt="a cat", n=2, size="32x32", response_format="b64_json", extra_body=FAST)
    assert len(response.data) == 2  # encoded in parallel, one worker thread each
    after = phase_samples(server, "images")  # observed before the answer was sent: nothing to wait for
    assert set(after) == IMAGE_PHASES
    for phase in IMAGE_PHASES:
        count, total = before.get(phase, (0.0, 0.0))
        assert after[phase][0] == count + 1 and after[phase][1] >= total, phase
    assert after["execution"][1] > before.get("execution", (0.0, 0.0))[1]
    # Refused requests observe nothing: one at validation (unknown model), one at completion (over the limits).
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="x", model="nope")
    with pytest.raises(openai.BadRequestError):
        client.images.generate(prompt="x", size="128x128")
    assert phase_samples(server, "images") == after


def test_url_responses_download_with_the_api_key_from_an_unguessable_address(server, client):
    response = client.images.generate(
        prompt="a tree", size="32x32", output_format="webp", response_format="url", extra_body=FAST
    )
    url = response.data[0].url
    assert url.startswith(server.base_url + "/v1/images/files/") and response.data[0].b64_json is None
    assert len(url.rsplit("/", 1)[1]) >= 40
    assert httpx.get(url).status_code == 401
    download = httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert download.status_code == 200 and download.headers["content-type"] == "image/webp"
    assert Image.open(io.BytesIO(download.content)).size == (32, 32)
    for image_id in ("x" * 43, "..%2F..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd", url.rsplit("/", 1)[1][:-1]):
        missing = httpx.get(
            server.url_for("v1", "images", "files", image_id), headers={"Authorization": f"Bearer {API_KEY}"}
        )
        assert missing.status_code == 404 and "error" in missing.json()


BAD_REQUESTS = [
    ({"prompt": "x", "size": "0x0"}, 400, "size"),
    ({"prompt": "x", "size": "64x"}, 400, "size"),
    ({"prompt": "x", "size": "99999x99999"}, 400, "size"),
    ({"prompt": "x", "size": "128x128"}, 400, "size"),  # over --max-image-pixels
    ({"prompt": "x", "size": "auto"}, 400, "size"),  # the model's default, 256x256, is over it too
    ({"prompt": "x", "size": "36x36"}, 400, "size"),  # not a multiple the model allows
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 11}, 400, "n"),
    ({"prompt": "x", "n": 1.5}, 400, "n"),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"prompt": "x", "size": "32x32", "num_inference_steps": 401}, 400, "num_inference_steps"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "seed": 2.5}, 400, "seed"),
    ({"prompt": "x", "seed": 2**63}, 400, "seed"),
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale"),
    ({"prompt": "x", "response_format": "png"}, 400, "response_format"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format"),
    ({"prompt": "x", "output_compression": 101, "output_format": "jpeg"}, 400, "output_compression"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x" * 201}, 400, "prompt"),
    ({"prompt": "x", "negative_prompt": "y" * 201}, 400, "negative_prompt"),
    ({"n": 1}, 400, "prompt"),
    ({"prompt": "x", "quality": "ultra"}, 400, "quality"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_REQUESTS)
def test_every_rejection_is_an_openai_envelope_naming_the_param(server, body, status, param):
    response = httpx.post(
        server.url_for("v1", "images", "generations"), json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    "content,content_type",
    [(b"{not json", "application/json"), (b"prompt=x", "text/plain"), (b"[1, 2]", "application/json"), (b"", None)],
)
def test_bodies_that_are_not_a_json_object(server, content, content_type):
    headers = {"Authorization": f"Bearer {API_KEY}"} | ({"content-type": content_type} if content_type else {})
    response = httpx.post(server.url_for("v1", "images", "generations"), content=content, headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_client_sees_the_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", size="0x0")
    assert info.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="x", model="nope")


def test_api_key_guards_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "v1/models"), ("POST", "v1/images/generations")):
            response = httpx.request(method, server.url_for(path), headers=headers, json={"prompt": "x"})
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url_for("health")).status_code == 200
    assert httpx.get(server.url_for("metrics")).status_code == 200
    unknown = httpx.get(server.url_for("nope"))
    assert unknown.status_code == 404 and "error" in unknown.json()


def test_an_image_model_refuses_the_videos_api(server):
    response = httpx.post(
        server.url_for("v1", "videos"), json={"prompt": "x"}, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_supported"


def test_models_lists_the_served_names(client):
    assert [m.id for m in client.models.list().data] == ["tiny-flux", "tiny-alias"]


def _slow_request(server, timeout=120.0, **extra):
    return httpx.post(
        server.url_for("v1", "images", "generations"),
        json={"prompt": "slow", "size": "64x64", "num_inference_steps": 400, "response_format": "b64_json", **extra},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=timeout,
    )


@contextlib.contextmanager
def _slow_request_left_open(server):
    """`_slow_request` on a connection of its own, which the client closes, without reading the answer, when the
    context ends: the request holds the engine's slot until the test chooses to go away (which aborts it)."""
    body = json.dumps({"prompt": "slow", "size": "64x64", "num_inference_steps": 400, "response_format": "b64_json"})
    head = (
        f"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head.encode() + body.encode())
        yield
        sock.shutdown(socket.SHUT_RDWR)


def test_overload_is_answered_429_at_once(server):
    aborted = metric(server, "vllm_omni:image_generation_requests_total", outcome="aborted")
    quick = {"size": "32x32", "num_inference_steps": 4}
    waiting = [threading.Thread(target=_slow_request, args=(server,), kwargs={**quick, "seed": i}) for i in range(4)]
    try:
        with _slow_request_left_open(server):
            wait_for(lambda: metric(server, "vllm_omni:num_requests_running", stage="0", replica="0") == 1)
            for thread in waiting:
                thread.start()
            wait_for(lambda: metric(server, "vllm_omni:num_requests_waiting", stage="0", replica="0") == 4)
            rejected = httpx.post(
                server.url_for("v1", "images", "generations"),
                json={"prompt": "one too many", "size": "32x32"},
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=60,
            )
            # At once: answered while the slot and the queue were still full, not after waiting for either.
            busy = [metric(server, "vllm_omni:num_requests_running", stage="0", replica="0")]
            busy.append(metric(server, "vllm_omni:num_requests_waiting", stage="0", replica="0"))
        # The slow request's client has gone: it is aborted, and the four waiting requests run.
    finally:
        for thread in waiting:
            if thread.ident is not None:
                thread.join()
    assert rejected.status_code == 429 and busy == [1, 4]
    assert rejected.json()["error"]["code"] == "too_many_waiting_requests"
    wait_for(lambda: metric(server, "vllm_omni:image_generation_requests_total", outcome="aborted") == aborted + 1)


def test_a_client_that_disconnects_frees_its_slot(server):
    aborted = metric(server, "vllm_omni:image_generation_requests_total", outcome="aborted")
    with _slow_request_left_open(server):  # the client goes away once its request runs, not after a timeout
        wait_for(lambda: metric(server, "vllm_omni:num_requests_running", stage="0", replica="0") == 1)
    wait_for(lambda: metric(server, "vllm_omni:num_requests_running", stage="0", replica="0") == 0)
    assert metric(server, "vllm_omni:num_requests_waiting", stage="0", replica="0") == 0
    wait_for(lambda: metric(server, "vllm_omni:image_generation_requests_total", outcome="aborted") == aborted + 1)


def test_sigterm_lets_the_running_request_finish_and_exits_0(server):
    """Stops the module's server: a test after it gets a new one (`live_server`)."""
    result = {}
    running = threading.Thread(
        target=lambda: result.update(response=_slow_request(server, timeout=600, num_inference_steps=100))
    )
    running.start()
    wait_for(lambda: metric(server, "vllm_omni:num_requests_running", stage="0", replica="0") == 1)
    server.process.send_signal(signal.SIGTERM)
    running.join(timeout=600)
    assert result["response"].status_code == 200
    assert server.process.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url_for("health"))
