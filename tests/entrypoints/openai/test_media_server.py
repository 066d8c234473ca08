"""Input images by URL through real servers: an edit's JSON ``images`` / ``mask`` and a video's ``input_reference`` /
``image_reference``, as data URLs and as URLs of a local HTTP server on 127.0.0.1. The servers started here allow
that host with ``--allowed-media-domains 127.0.0.1`` (it is private, so only listing it allows it); the shared Flux
server, without the flag, must refuse the same URL as private."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from openai.types import ImagesResponse
from PIL import Image

from vllm_omni.testing.checks.edits import noise_image, square_mask
from vllm_omni.testing.processes.media_server import serve_answers
from vllm_omni.testing.processes.server import RemoteOmniServer, finished_video_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"  # the shared servers' (conftest.py) and these
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
FAST = {"num_inference_steps": 4, "guidance_scale": 3.0, "seed": 7}
ALLOW_LOCAL = ("--allowed-media-domains", "127.0.0.1")


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(payload: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(payload).decode()


def openai_mask(mask: Image.Image) -> bytes:
    rgba = Image.new("RGBA", mask.size, (0, 0, 0, 255))
    rgba.putalpha(mask.point(lambda v: 0 if v else 255))
    return png(rgba)


IMAGE = png(noise_image(3))
FRAME = png(noise_image(2, size=32))


@pytest.fixture(scope="module")
def files():
    answers = {
        "/in.png": (200, {"Content-Type": "image/png"}, IMAGE),
        "/frame.png": (200, {"Content-Type": "image/png"}, FRAME),
        "/text": (200, {"Content-Type": "text/plain"}, b"not an image"),
        "/to-localhost": (302, {"Location": "http://localhost:{port}/in.png"}, b""),
    }
    with serve_answers(answers) as base:
        yield base


@pytest.fixture(scope="module")
def server(tiny_sd):
    args = ["--api-key", API_KEY, "--max-num-seqs", "2", "--uvicorn-log-level", "warning", *ALLOW_LOCAL]
    with RemoteOmniServer(tiny_sd, args) as server:
        yield server


@pytest.fixture(scope="module")
def video_server(tiny_wan_i2v):
    with RemoteOmniServer(tiny_wan_i2v, ["--api-key", API_KEY, "--uvicorn-log-level", "warning", *ALLOW_LOCAL]) as s:
        yield s


def edit_json(server, body: dict) -> httpx.Response:
    data = {"prompt": "a red door", "response_format": "b64_json", **FAST, **body}
    return httpx.post(server.url_for("v1", "images", "edits"), json=data, headers=HEADERS, timeout=300)


def decoded(answer: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))), dtype=np.float32)


def test_a_json_edit_by_url_equals_the_same_edit_uploaded(server, files):
    fields = {"prompt": "a red door", "response_format": "b64_json", **{k: str(v) for k, v in FAST.items()}}
    uploaded = httpx.post(
        server.url_for("v1", "images", "edits"),
        files={"image": ("in.png", IMAGE, "image/png")},
        data=fields,
        headers=HEADERS,
        timeout=300,
    )
    assert uploaded.status_code == 200, uploaded.text
    for url in (f"{files}/in.png", data_url(IMAGE)):
        by_url = edit_json(server, {"images": [{"image_url": url}]})
        assert by_url.status_code == 200, by_url.text
        np.testing.assert_array_equal(decoded(by_url.json()), decoded(uploaded.json()))


def test_a_json_inpainting_with_a_mask_by_url(server):
    body = {"images": [{"image_url": data_url(IMAGE)}], "mask": {"image_url": data_url(openai_mask(square_mask()))}}
    answer = edit_json(server, body)
    assert answer.status_code == 200, answer.text
    assert decoded(answer.json()).shape == (64, 64, 3)


def test_the_openai_client_posts_a_json_edit(server, files):
    """openai-python's ``images.edit`` sends files only: its generic ``post`` sends OpenAI's JSON edit body."""
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)
    body = {"prompt": "a red door", "images": [{"image_url": f"{files}/in.png"}], "response_format": "b64_json"}
    result = client.post("/images/edits", body={**body, **FAST}, cast_to=ImagesResponse)
    assert result.data[0].b64_json
    with pytest.raises(openai.BadRequestError) as raised:
        client.post("/images/edits", body={**body, "images": [{"file_id": "file-1"}]}, cast_to=ImagesResponse)
    assert raised.value.body["param"] == "images" and "no Files API" in raised.value.body["message"]


REFUSALS = {
    "file_id": ({"images": [{"file_id": "file-abc"}]}, "images", "unsupported_value"),
    "mask file_id": ({"images": [{"image_url": "{files}/in.png"}], "mask": {"file_id": "f"}}, "mask", None),
    "no images": ({}, "images", "missing_required_parameter"),
    "a string, not an object": ({"images": ["{files}/in.png"]}, "images", "invalid_value"),
    "404": ({"images": [{"image_url": "{files}/missing.png"}]}, "images", "image_url_failed"),
    "not an image": ({"images": [{"image_url": "{files}/text"}]}, "images", "invalid_image"),
    "host not listed": ({"images": [{"image_url": "http://localhost:9/a.png"}]}, "images", "image_url_not_allowed"),
    "redirect to a host not listed": ({"images": [{"image_url": "{files}/to-localhost"}]}, "images", None),
    "bad data URL": ({"images": [{"image_url": "data:image/png;base64,@@"}]}, "images", "invalid_image_url"),
    "ftp": ({"images": [{"image_url": "ftp://127.0.0.1/a.png"}]}, "images", "invalid_image_url"),
    "unknown field": ({"images": [{"image_url": "{files}/in.png"}], "sharpness": "high"}, "sharpness", None),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_json_edit_refusals_name_the_field(server, files, case):
    body, param, code = REFUSALS[case]
    answer = edit_json(server, _with_base(body, files))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert httpx.get(server.url_for("health"), timeout=60).status_code == 200


def test_a_server_without_the_flag_refuses_a_private_host(flux_server, files):
    answer = edit_json(flux_server, {"images": [{"image_url": f"{files}/in.png"}]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "images" and error["code"] == "image_url_not_allowed", error
    assert "non-public address (127.0.0.1)" in error["message"] and "--allowed-media-domains" in error["message"]


VIDEO = {"prompt": "a cat running", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3}


def test_an_image_to_video_from_a_url_and_from_image_reference(video_server, files):
    by_url = httpx.post(
        video_server.url_for("v1", "videos", "sync"),
        json={**VIDEO, "input_reference": {"image_url": f"{files}/frame.png"}},
        headers=HEADERS,
        timeout=600,
    )
    assert by_url.status_code == 200, by_url.text
    assert by_url.headers["content-type"] == "video/mp4"
    by_data_url = httpx.post(
        video_server.url_for("v1", "videos", "sync"),
        json={**VIDEO, "image_reference": data_url(FRAME)},  # upstream's field, a string
        headers=HEADERS,
        timeout=600,
    )
    assert by_data_url.status_code == 200, by_data_url.text
    assert by_data_url.content == by_url.content  # the same image, seed and parameters


def test_the_openai_client_creates_a_video_from_a_url(video_server, files):
    """openai-python's ``videos.create`` sends a multipart form; an ``input_reference`` object given in
    ``extra_body`` arrives as the form field ``input_reference[image_url]`` (the typed argument takes files only in
    the installed client)."""
    client = openai.OpenAI(base_url=video_server.url_for("v1"), api_key=API_KEY, max_retries=0)
    extra = {k: v for k, v in VIDEO.items() if k not in ("prompt", "size")}
    video = client.videos.create(
        prompt=VIDEO["prompt"],
        size="32x32",  # type: ignore[arg-type]  # the client lists OpenAI's sizes only
        extra_body={**extra, "input_reference": {"image_url": f"{files}/frame.png"}},
    )
    assert finished_video_job(video_server.base_url, video.id, HEADERS)["status"] == "completed"


VIDEO_REFUSALS = {
    "file and image_reference": (
        {"files": {"input_reference": ("f.png", FRAME, "image/png")}, "data": {"image_reference": "x"}},
        "image_reference",
        ("input_reference", "image_reference"),
    ),
    "input_reference and image_reference": (
        {"json": {"input_reference": {"image_url": "x"}, "image_reference": "y"}},
        "image_reference",
        ("input_reference", "image_reference"),
    ),
    "video_reference": ({"json": {"video_reference": "https://example.com/v.mp4"}}, "video_reference", ("video",)),
    "file_id": ({"json": {"input_reference": {"file_id": "file-1"}}}, "input_reference", ("Files API",)),
    "private host": (
        {"json": {"input_reference": {"image_url": "http://localhost:9/a.png"}}},
        "input_reference",
        ("'localhost' is not allowed", "127.0.0.1"),
    ),
    "404": ({"json": {"image_reference": "{files}/missing.png"}}, "image_reference", ("HTTP 404",)),
}


@pytest.mark.parametrize("case", list(VIDEO_REFUSALS))
@pytest.mark.parametrize("route", ["", "sync"])
def test_video_reference_refusals_name_the_fields(video_server, files, case, route):
    request, param, words = VIDEO_REFUSALS[case]
    fields = {"prompt": "a cat", "size": "32x32", "num_frames": 5}
    request = _with_base(request, files)
    if "json" in request:
        request = {"json": {**fields, **request["json"]}}
    else:
        request = {**request, "data": {**{k: str(v) for k, v in fields.items()}, **request["data"]}}
    url = video_server.url_for("v1", "videos", *([route] if route else []))
    answer = httpx.post(url, headers=HEADERS, timeout=60, **request)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error


def _with_base(value, base: str):
    """``value`` with ``{files}`` in its strings replaced by the local server's base URL."""
    if isinstance(value, str):
        return value.replace("{files}", base)
    if isinstance(value, dict):
        return {k: _with_base(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_base(v, base) for v in value]
    return value


def test_a_model_without_a_video_to_video_variant_refuses_a_remix(video_server):
    """Wan's image-to-video pipeline has no video-to-video variant: a remix is refused, naming it, before any video
    is looked up."""
    answer = httpx.post(
        video_server.url_for("v1", "videos", "video_any", "remix"), json={"prompt": "x"}, headers=HEADERS, timeout=60
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_supported", "model")
    assert "WanImageToVideoPipeline" in error["message"] and "no video-to-video variant" in error["message"]
