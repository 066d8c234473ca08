"""Requests as upstream vllm-omni's clients and docs send them (docs/migration.md): ``b64_json`` by default,
``response_format: file``, case-insensitive ``output_format``, ``true_cfg_scale`` with ``negative_prompt`` (either
alone is dropped with a warning: test_ignored_fields), video ``width``/``height``, ``POST /v1/videos/sync``, ``order``
and unknown query parameters, 404 for unknown routes. Real uvicorn servers in this process, so that the sync route's
disconnect test can hold the engine."""

import base64
import contextlib
import io
import json
import re
import socket
import threading
import urllib.parse
import zipfile
from collections.abc import Iterator

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni.testing.processes.server import came_true, in_process_server, outcome_count

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST = {"size": "32x32", "num_inference_steps": 2, "seed": 5}
VIDEO = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2, "fps": 8, "seed": 3}


@pytest.fixture(scope="module")
def flux(tiny_flux):
    with in_process_server(tiny_flux, max_num_seqs=2) as (app, base):
        yield app, base


@pytest.fixture(scope="module")
def wan(tiny_wan):
    with in_process_server(tiny_wan) as (app, base):
        yield app, base


def _post(base: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}{path}", timeout=300, **kwargs)


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def _frames(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24").astype(np.int16) for frame in container.decode(video=0)]


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_b64_json_is_the_default_as_upstream_answers(flux):
    """Upstream's quick start reads ``data[0].b64_json`` of a body without ``response_format``."""
    response = _post(flux[1], "/v1/images/generations", json={"prompt": "a fox", **FAST})
    data = response.json()["data"][0]
    assert "url" not in data
    assert _pixels(base64.b64decode(data["b64_json"])).shape == (32, 32, 3)


def test_url_is_still_available(flux):
    response = _post(flux[1], "/v1/images/generations", json={"prompt": "a fox", "response_format": "url", **FAST})
    url = response.json()["data"][0]["url"]
    assert httpx.get(url, timeout=60).headers["content-type"] == "image/png"


def test_response_format_file_answers_the_image_bytes(flux):
    body = {"prompt": "a fox", **FAST}
    b64 = _post(flux[1], "/v1/images/generations", json=body).json()["data"][0]["b64_json"]
    single = _post(flux[1], "/v1/images/generations", json={**body, "response_format": "file"})
    assert single.headers["content-type"] == "image/png"
    assert single.content == base64.b64decode(b64)
    # Saved under the request's id with the format's extension (upstream's), a quoted filename (RFC 6266).
    assert re.fullmatch(r'attachment; filename="img-[0-9a-f]{32}\.png"', single.headers["content-disposition"])

    several = _post(
        flux[1],
        "/v1/images/generations",
        json={**body, "n": 2, "response_format": "file", "output_format": "jpeg"},
    )
    assert several.headers["content-type"] == "application/zip"
    assert re.fullmatch(r'attachment; filename="img-[0-9a-f]{32}\.zip"', several.headers["content-disposition"])
    with zipfile.ZipFile(io.BytesIO(several.content)) as archive:
        assert archive.namelist() == ["image_0.jpeg", "image_1.jpeg"]
        assert all(Image.open(archive.open(name)).format == "JPEG" for name in archive.namelist())


@pytest.mark.parametrize(("given", "pil_format"), [("PNG", "PNG"), ("jpg", "JPEG"), ("JPEG", "JPEG"), ("WebP", "WEBP")])
def test_output_format_is_case_insensitive_and_jpg_is_jpeg(flux, given, pil_format):
    response = _post(flux[1], "/v1/images/generations", json={"prompt": "a fox", "output_format": given, **FAST})
    assert response.json()["output_format"] == pil_format.lower()
    image = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"])))
    assert image.format == pil_format


def test_png_with_output_compression_is_answered_with_a_warning(flux):
    """OpenAI's SDK tests send output_compression with png, and upstream accepts it: the png (lossless) is the one
    made without it, and the Warning names it and the formats it acts on (test_ignored_fields: --strict-fields)."""
    body = {"prompt": "a fox", "output_format": "png", **FAST}
    response = _post(flux[1], "/v1/images/generations", json={**body, "output_compression": 50})
    assert response.status_code == 200, response.text
    plain = _post(flux[1], "/v1/images/generations", json=body)
    assert response.json()["data"][0]["b64_json"] == plain.json()["data"][0]["b64_json"]
    warning = response.headers["warning"]
    assert warning.startswith('299 - "output_compression ignored: ') and "jpeg and webp" in warning
    assert "warning" not in plain.headers


@pytest.mark.parametrize(
    ("path", "content", "headers"),
    [
        ("/v1/images/generations", b"", {"Content-Type": "application/json"}),
        ("/v1/images/generations", b"", {}),
        ("/v1/images/generations", b"{}", {"Content-Type": "application/json"}),
        ("/v1/images/edits", b"", {}),
        ("/v1/images/edits", b"", {"Content-Type": "multipart/form-data; boundary=x"}),
        ("/v1/images/edits", b"size=32x32", {"Content-Type": "application/x-www-form-urlencoded"}),
    ],
)
def test_a_missing_prompt_is_named_whatever_the_images_body(flux, path, content, headers):
    """An empty body, ``{}`` or a form without the field: the 400 names ``prompt`` (OpenAI's envelope)."""
    error = _error(_post(flux[1], path, content=content, headers=headers))
    assert (error["param"], error["code"]) == ("prompt", "missing_required_parameter"), error


@pytest.mark.parametrize("path", ["/v1/videos", "/v1/videos/sync"])
@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b"", {"Content-Type": "application/json"}),
        (b"", {}),
        (b"{}", {"Content-Type": "application/json"}),
        (b"", {"Content-Type": "multipart/form-data; boundary=x"}),
        (b"size=32x32", {"Content-Type": "application/x-www-form-urlencoded"}),
    ],
)
def test_a_missing_prompt_is_named_whatever_the_videos_body(wan, path, content, headers):
    error = _error(_post(wan[1], path, content=content, headers=headers))
    assert (error["param"], error["code"]) == ("prompt", "missing_required_parameter"), error


def test_true_cfg_scale_with_a_negative_prompt_changes_the_image(flux):
    client = openai.OpenAI(base_url=f"{flux[1]}/v1", api_key="unused", max_retries=0)
    plain = client.images.generate(prompt="a fox", size="32x32", extra_body={"num_inference_steps": 2, "seed": 5})
    guided = client.images.generate(
        prompt="a fox",
        size="32x32",
        extra_body={"num_inference_steps": 2, "seed": 5, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    )
    difference = np.abs(
        _pixels(base64.b64decode(plain.data[0].b64_json)) - _pixels(base64.b64decode(guided.data[0].b64_json))
    )
    assert difference.max() > 2


def test_flow_shift_moves_the_schedule_of_images_and_videos(flux, wan):
    """The tiny Flux's scheduler has a fixed shift, as SD3's and Wan's do (FLUX.1's own shifts by image size and
    drops it with a warning: test_model_card)."""
    body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 4, "seed": 5}
    plain = _post(flux[1], "/v1/images/generations", json=body).json()["data"][0]["b64_json"]
    shifted = _post(flux[1], "/v1/images/generations", json={**body, "flow_shift": 3.0}).json()["data"][0]["b64_json"]
    assert np.abs(_pixels(base64.b64decode(plain)) - _pixels(base64.b64decode(shifted))).max() > 2
    video = {"prompt": "a cat", **VIDEO, "num_inference_steps": 4}
    plain, shifted = (
        _post(wan[1], "/v1/videos/sync", json=video | extra).content for extra in ({}, {"flow_shift": 2.0})
    )
    assert max(np.abs(a - b).max() for a, b in zip(_frames(plain), _frames(shifted), strict=True)) > 2
    assert _error(_post(wan[1], "/v1/videos/sync", json={**video, "flow_shift": 0}))["param"] == "flow_shift"


def test_an_unknown_query_parameter_is_refused(flux, wan):
    error = _error(_post(flux[1], "/v1/images/generations?debug=1", json={"prompt": "a fox", **FAST}))
    assert (error["param"], error["code"]) == ("debug", "unknown_parameter")
    error = _error(httpx.get(f"{wan[1]}/v1/videos", params={"sort": "asc"}, timeout=60))
    assert error["param"] == "sort" and "after, limit, order" in error["message"]


def test_an_unknown_route_is_404_and_a_wrong_method_405(flux, wan):
    error = _error(_post(wan[1], "/v1/videos/render", json={"prompt": "x"}), 404)
    assert "POST /v1/videos/render" in error["message"]
    assert httpx.get(f"{flux[1]}/v1/images/generations", timeout=60).status_code == 405


def test_video_width_and_height_give_the_size_in_json_and_forms(wan):
    base = wan[1]
    body = {k: v for k, v in VIDEO.items() if k != "size"}
    as_json = _post(base, "/v1/videos", json={"prompt": "a cat", "width": 48, "height": 32, **body})
    assert as_json.json()["size"] == "48x32"
    as_form = _post(base, "/v1/videos", data={"prompt": "a cat", "width": "48", "height": "32", "num_frames": "5"})
    assert as_form.json()["size"] == "48x32"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"size": "32x32", "width": 32, "height": 32}, "width"),
        ({"size": "32x32", "height": 32}, "height"),
        ({"width": 32}, "height"),
    ],
)
def test_video_refusals_name_the_field(wan, fields, param):
    body = {"prompt": "a cat", "num_frames": 5, "num_inference_steps": 2, **fields}
    assert _error(_post(wan[1], "/v1/videos", json=body))["param"] == param


def test_videos_sync_answers_the_mp4_of_the_same_job(wan):
    base = wan[1]
    sync = _post(base, "/v1/videos/sync", json={"prompt": "a cat", **VIDEO})
    assert sync.status_code == 200 and sync.headers["content-type"] == "video/mp4"
    assert re.fullmatch(r'attachment; filename="video_[0-9a-f]{32}\.mp4"', sync.headers["content-disposition"])
    job = _post(base, "/v1/videos", json={"prompt": "a cat", **VIDEO}).json()
    assert came_true(lambda: httpx.get(f"{base}/v1/videos/{job['id']}", timeout=60).json()["status"] == "completed")
    download = httpx.get(f"{base}/v1/videos/{job['id']}/content", timeout=60)
    assert download.headers["content-disposition"] == f'attachment; filename="{job["id"]}.mp4"'
    thumbnail = httpx.get(f"{base}/v1/videos/{job['id']}/content", params={"variant": "thumbnail"}, timeout=60)
    assert thumbnail.headers["content-disposition"] == f'attachment; filename="{job["id"]}.png"'
    content = download.content
    synced, queued = _frames(sync.content), _frames(content)
    assert len(synced) == len(queued) == VIDEO["num_frames"]
    # x264's output is not bit-reproducible on a loaded machine: the same frames, on average.
    assert max(np.abs(a - b).mean() for a, b in zip(synced, queued, strict=True)) <= 3


def test_videos_sync_takes_a_form_and_refuses_previews(wan):
    form = {"prompt": "a cat", "width": "32", "height": "32", "num_frames": "5", "num_inference_steps": "1"}
    assert _post(wan[1], "/v1/videos/sync", data=form).headers["content-type"] == "video/mp4"
    error = _error(_post(wan[1], "/v1/videos/sync", json={"prompt": "a cat", **VIDEO, "partial_images": 1}))
    assert error["param"] == "partial_images" and "POST /v1/videos" in error["message"]


def test_a_sync_client_that_goes_away_aborts_its_request(wan):
    """The engine is held in the denoiser's first forward, so the client provably leaves while its request runs;
    the server counts it cancelled, and once the engine goes on its slot is free."""
    app, base = wan
    engine = app.state.server.omni.engine.stages[0].replicas[0].engine
    transformer = engine.runner.pipeline.transformer
    holding, release = threading.Event(), threading.Event()

    def hold(module, args, output):
        holding.set()
        release.wait(120)

    cancelled = outcome_count(base, "video_generation_requests", "cancelled")
    handle = transformer.register_forward_hook(hold)
    try:
        with _sent(base, "/v1/videos/sync", {"prompt": "a cat", **VIDEO}):
            assert holding.wait(120)
        # The connection is closed while the engine holds the request.
        assert came_true(lambda: outcome_count(base, "video_generation_requests", "cancelled") == cancelled + 1)
    finally:
        release.set()
        handle.remove()
    assert came_true(lambda: engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0)
    assert _post(base, "/v1/videos/sync", json={"prompt": "a dog", **VIDEO}).status_code == 200


def test_list_videos_in_either_order(wan):
    base = wan[1]
    ids = [_post(base, "/v1/videos", json={"prompt": f"cat {i}", **VIDEO}).json()["id"] for i in range(2)]
    newest = [v["id"] for v in httpx.get(f"{base}/v1/videos", params={"limit": 100}, timeout=60).json()["data"]]
    oldest = httpx.get(f"{base}/v1/videos", params={"limit": 100, "order": "asc"}, timeout=60).json()["data"]
    assert [v["id"] for v in oldest] == newest[::-1]
    assert newest.index(ids[1]) < newest.index(ids[0])
    after = httpx.get(f"{base}/v1/videos", params={"order": "asc", "after": ids[0]}, timeout=60).json()["data"]
    assert after[0]["id"] == ids[1]
    error = _error(httpx.get(f"{base}/v1/videos", params={"order": "up"}, timeout=60))
    assert error["param"] == "order" and "'asc' or 'desc'" in error["message"]


@contextlib.contextmanager
def _sent(base: str, path: str, body: dict) -> Iterator[None]:
    """A connection that has sent ``POST path`` with the JSON ``body``; it closes on the way out, unanswered. A raw
    socket: an httpx client closed from another thread leaves its in-flight request's connection open."""
    url = urllib.parse.urlsplit(base)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=60) as connection:
        connection.sendall(head.encode() + payload)
        yield


@pytest.fixture(scope="module")
def wan22(tiny_wan22):
    with in_process_server(tiny_wan22) as (app, base):
        yield app, base


def test_a_two_expert_wan_takes_its_knobs_as_json_and_form_fields(wan22):
    base = wan22[1]
    # 4 steps: the last ones are below the boundary, where the low-noise expert runs.
    body = {"prompt": "a cat", "guidance_scale": 3.0, "negative_prompt": "blurry", **VIDEO, "num_inference_steps": 4}
    plain = _post(base, "/v1/videos/sync", json=body)
    tuned = _post(base, "/v1/videos/sync", json={**body, "guidance_scale_2": 20.0, "boundary_ratio": 0.5})
    assert plain.status_code == tuned.status_code == 200, tuned.text
    difference = max(np.abs(a - b).max() for a, b in zip(_frames(plain.content), _frames(tuned.content), strict=True))
    assert difference > 2
    form = {k: str(v) for k, v in {**body, "guidance_scale_2": 20.0, "boundary_ratio": 0.5}.items()}
    assert _post(base, "/v1/videos/sync", data=form).content == tuned.content
    error = _error(_post(base, "/v1/videos/sync", json={**body, "boundary_ratio": 1.5}))
    assert error["param"] == "boundary_ratio"
