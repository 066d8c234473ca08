"""Streamed images (``stream`` / ``partial_images``) over HTTP: OpenAI's server-sent events through the real
`openai` client and raw, equality with the non-streamed image, errors after the stream began, and clients that go
away mid-stream. One real uvicorn server in this process, so that faults can be injected into its engine."""

import base64
import io
import json
import threading

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni.testing.processes.server import came_true, in_process_server, outcome_count

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUICK = {"size": "64x64", "extra_body": {"num_inference_steps": 4, "seed": 7}}
"""4 steps: previews come after steps 1, 2 and 3 (``partial_images`` 3) or after step 2 (1)."""


@pytest.fixture(scope="module")
def server(tiny_flux):
    with in_process_server(tiny_flux, max_num_seqs=2) as (app, base):
        yield app, base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """``(event, data)`` of each server-sent event, read off the wire."""
    events, event = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((event, json.loads(line.removeprefix("data: "))))
    return events


def test_the_openai_client_iterates_partial_images_then_the_image(client):
    stream = client.images.generate(model="tiny", prompt="a lighthouse", stream=True, partial_images=2, **QUICK)
    events = list(stream)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    for event in events:
        assert (event.size, event.output_format, event.background) == ("64x64", "png", "opaque")
        assert event.quality is None and event.created_at > 0  # the request gave num_inference_steps, not quality
        assert pixels(event.b64_json).shape == (64, 64, 3)
    completed = events[-1]
    assert completed.usage.input_tokens > 0 and completed.usage.output_tokens > 0
    assert completed.model_extra["metrics"]["batch_size"] >= 1
    assert completed.model_extra["metrics"]["seed"] == 7

    plain = client.images.generate(model="tiny", prompt="a lighthouse", response_format="b64_json", **QUICK)
    assert np.abs(pixels(completed.b64_json) - pixels(plain.data[0].b64_json)).max() <= 2


def test_the_wire_format_is_event_then_data(server):
    body = {"prompt": "a lighthouse", "stream": True, "partial_images": 1, "size": "64x64", "num_inference_steps": 4}
    with httpx.stream("POST", f"{server[1]}/v1/images/generations", json=body, timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert [name for name, _ in events] == ["image_generation.partial_image", "image_generation.completed"]
    for name, data in events:
        assert data["type"] == name  # as OpenAI's: the event's name is also its data's type
    assert "usage" not in events[0][1] and "usage" in events[1][1]


def test_partial_images_0_streams_only_the_image(client):
    events = list(client.images.generate(model="tiny", prompt="a kite", stream=True, partial_images=0, **QUICK))
    assert [e.type for e in events] == ["image_generation.completed"]


def test_n_images_each_have_their_previews_and_completed_event(server):
    body = {"prompt": "a kite", "stream": True, "partial_images": 1, "n": 2, "size": "64x64", "num_inference_steps": 4}
    with httpx.stream("POST", f"{server[1]}/v1/images/generations", json=body, timeout=300) as response:
        events = sse_events(response)
    assert [(name, data["image_index"]) for name, data in events] == [
        ("image_generation.partial_image", 0),
        ("image_generation.partial_image", 1),
        ("image_generation.completed", 0),
        ("image_generation.completed", 1),
    ]


def test_an_edit_streams_image_edit_events(server, client):
    source = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(source, format="PNG")
    source.seek(0)
    stream = client.images.edit(
        model="tiny",
        image=("red.png", source, "image/png"),
        prompt="a blue square",
        stream=True,
        partial_images=1,
        extra_body={"num_inference_steps": 4, "seed": 3},
    )
    events = list(stream)
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert events[-1].size == "64x64"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"partial_images": 2}, "partial_images"),  # previews need a stream
        ({"stream": True, "partial_images": 4}, "partial_images"),
        ({"stream": True, "response_format": "url"}, "response_format"),
    ],
)
def test_stream_refusals_name_the_field(server, body, param):
    response = httpx.post(f"{server[1]}/v1/images/generations", json={"prompt": "x", **body}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_a_failure_after_the_stream_began_is_an_error_event(server, client):
    """The denoiser fails from its third forward on (after the first preview, at step 2 of 4): the client has
    the preview, then the error envelope as an ``error`` event, which the `openai` client raises."""
    app, base = server
    transformer = app.state.server.omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer
    forwards = []

    def fail_after_two(module, args, output):
        forwards.append(None)
        if len(forwards) > 2:
            raise RuntimeError("simulated device fault")

    handle = transformer.register_forward_hook(fail_after_two)
    received = []
    try:
        with pytest.raises(openai.APIError) as caught:
            for event in client.images.generate(model="tiny", prompt="x", stream=True, partial_images=1, **QUICK):
                received.append(event.type)
    finally:
        handle.remove()
    assert received == ["image_generation.partial_image"]
    assert "simulated device fault" in caught.value.message
    assert caught.value.body["code"] == "generation_failed" and caught.value.body["type"] == "server_error"


def test_a_client_that_goes_away_mid_stream_aborts_its_request(server):
    """The engine is held inside the denoiser after the first preview, so the client provably leaves while its
    request runs; the server notices, counts it aborted, and once the engine goes on the slot is free."""
    app, base = server
    engine = app.state.server.omni.engine.stages[0].replicas[0].engine
    transformer = engine.runner.pipeline.transformer
    forwards, holding, release = [], threading.Event(), threading.Event()

    def hold_third_forward(module, args, output):
        forwards.append(None)
        if len(forwards) == 3:
            holding.set()
            release.wait(600)

    aborted = outcome_count(base, "image_generation_requests", "aborted")
    handle = transformer.register_forward_hook(hold_third_forward)
    try:
        body = {"prompt": "x", "stream": True, "partial_images": 1, "size": "64x64", "num_inference_steps": 4}
        with httpx.stream("POST", f"{base}/v1/images/generations", json=body, timeout=300) as response:
            # The reader is kept until the engine holds: a discarded one is closed at once, and httpx then closes
            # the connection, so the client would leave as soon as the preview came, racing the third forward
            # (the server aborts the request, and diffusers skips the remaining forwards).
            lines = response.iter_lines()
            assert next(lines) == "event: image_generation.partial_image"
            assert holding.wait(600)  # a busy machine may take minutes to reach it
        # The connection is closed: the server counts the request aborted while the engine is still held.
        deadline_reached = not came_true(
            lambda: outcome_count(base, "image_generation_requests", "aborted") == aborted + 1
        )
        assert not deadline_reached, "the server did not notice the client going away"
    finally:
        release.set()
        handle.remove()
    assert came_true(lambda: engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0)
    # The slot is free: the next request runs.
    response = httpx.post(
        f"{base}/v1/images/generations", json={"prompt": "y", "size": "64x64", "num_inference_steps": 2}, timeout=300
    )
    assert response.status_code == 200


@pytest.fixture(scope="module")
def video_server(tiny_wan):
    with in_process_server(tiny_wan) as (app, base):
        yield app, base


def test_a_video_job_shows_its_preview_while_it_runs_then_its_middle_frame(video_server):
    """4 steps without guidance (one denoiser forward per step): the preview comes after step 2, and the engine
    is held in step 4's forward, so the running job provably shows it; once released, the thumbnail is the
    video's middle frame."""
    app, base = video_server
    engine = app.state.server.omni.engine.stages[0].replicas[0].engine
    # The hook counts this job's forwards only: no other job of the module's server may still be running.
    assert came_true(lambda: engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0)
    transformer = engine.runner.pipeline.transformer
    forwards, holding, release = [], threading.Event(), threading.Event()

    def hold_fourth_forward(module, args, output):
        forwards.append(None)
        if len(forwards) == 4:
            holding.set()
            release.wait(600)

    body = {"prompt": "a cat", "size": "32x32", "num_frames": 9, "fps": 8, "num_inference_steps": 4}
    handle = transformer.register_forward_hook(hold_fourth_forward)
    try:
        job = httpx.post(f"{base}/v1/videos", json={**body, "guidance_scale": 1.0, "partial_images": 1}, timeout=60)
        assert job.status_code == 200, job.text
        video_id = job.json()["id"]
        assert holding.wait(120)
        assert came_true(lambda: httpx.get(f"{base}/v1/videos/{video_id}", timeout=60).json().get("preview_index") == 0)
        running = httpx.get(f"{base}/v1/videos/{video_id}", timeout=60).json()
        assert running["status"] == "in_progress"
        preview = httpx.get(f"{base}/v1/videos/{video_id}/content", params={"variant": "thumbnail"}, timeout=60)
        assert preview.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(preview.content)).size == (32, 32)
        not_yet = httpx.get(f"{base}/v1/videos/{video_id}/content", timeout=60)
        assert not_yet.status_code == 400 and not_yet.json()["error"]["code"] == "video_not_ready"
    finally:
        release.set()
        handle.remove()
    assert came_true(lambda: httpx.get(f"{base}/v1/videos/{video_id}", timeout=60).json()["status"] == "completed")
    done = httpx.get(f"{base}/v1/videos/{video_id}", timeout=60).json()
    assert "preview_index" not in done  # only a running job has one
    mp4 = httpx.get(f"{base}/v1/videos/{video_id}/content", params={"variant": "video"}, timeout=60)
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = [frame.to_ndarray(format="rgb24").astype(np.int16) for frame in container.decode(video=0)]
    thumbnail = httpx.get(f"{base}/v1/videos/{video_id}/content", params={"variant": "thumbnail"}, timeout=60)
    middle = np.asarray(Image.open(io.BytesIO(thumbnail.content)).convert("RGB"), dtype=np.int16)
    # The PNG is lossless, the MP4 is not: the thumbnail is nearer its own frame than to the others.
    distances = [np.abs(middle - frame).mean() for frame in frames]
    assert int(np.argmin(distances)) == len(frames) // 2


def test_a_video_thumbnail_variant_is_refused_by_name(video_server):
    app, base = video_server
    job = httpx.post(
        f"{base}/v1/videos",
        json={"prompt": "a cat", "size": "32x32", "num_frames": 9, "num_inference_steps": 1},
        timeout=60,
    ).json()
    response = httpx.get(f"{base}/v1/videos/{job['id']}/content", params={"variant": "poster"}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "variant" and "'thumbnail'" in response.json()["error"]["message"]
    # Its job ends here, not in the module's next test.
    assert came_true(lambda: httpx.get(f"{base}/v1/videos/{job['id']}", timeout=60).json()["status"] == "completed")
