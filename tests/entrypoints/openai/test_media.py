"""media.py's references without a model server: data URLs, fetches from a local HTTP server on 127.0.0.1 (allowed
only by listing it, as ``--allowed-media-domains`` does), each failure a 400 naming the field, and the shapes of the
request fields. The servers here answer at once or never; no test depends on timing."""

from __future__ import annotations

import asyncio
import base64
import io
import socket

import pytest
from PIL import Image

from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.media import (
    FetchLimits,
    MediaReference,
    edit_references,
    fold_form_references,
    read_references,
    video_reference,
)
from vllm_omni.testing.processes.media_server import serve_answers

MAX_BYTES = 4096
SERVING = ServingConfig(served_model_names=["tiny"], max_input_image_bytes=MAX_BYTES)
LOCAL = FetchLimits(allowed_domains=("127.0.0.1",), timeout_s=30)


def png(size: int = 8, color=(200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png()


ANSWERS = {
    "/in.png": (200, {"Content-Type": "image/png"}, PNG),
    "/text": (200, {"Content-Type": "text/plain"}, b"not an image"),
    "/big.png": (200, {"Content-Type": "image/png"}, b"\x89PNG" + b"\0" * (2 * MAX_BYTES)),
    "/to-png": (302, {"Location": "/in.png"}, b""),
    "/to-localhost": (302, {"Location": "http://localhost:{port}/in.png"}, b""),
    "/loop": (302, {"Location": "/loop"}, b""),
}


@pytest.fixture(scope="module")
def http_server():
    with serve_answers(ANSWERS) as base:
        yield base


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers (its backlog completes the handshake)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


@pytest.fixture
def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read(url: str, limits: FetchLimits = LOCAL, param: str = "input_reference") -> Image.Image:
    return asyncio.run(read_references([MediaReference(param, param, url)], SERVING, limits))[0]


def refusal(url: str, limits: FetchLimits = LOCAL, param: str = "input_reference") -> APIError:
    with pytest.raises(APIError) as raised:
        read(url, limits, param)
    error = raised.value
    assert error.status == 400 and error.param == param, (error.status, error.param, error.message)
    return error


def data_url(payload: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(payload).decode()}"


def test_a_data_url_is_decoded_and_checked():
    assert read(data_url(PNG), FetchLimits()).size == (8, 8)
    assert "not valid base64" in refusal("data:image/png;base64,@@@", FetchLimits()).message
    assert "must be base64" in refusal("data:image/png,rawbytes", FetchLimits()).message
    assert refusal(data_url(b"\0" * (2 * MAX_BYTES)), FetchLimits()).code == "image_too_large"
    assert refusal(data_url(b"GIF89a...", "image/gif"), FetchLimits()).code == "invalid_image"


def test_an_allowed_local_url_is_fetched(http_server):
    image = read(f"{http_server}/in.png")
    assert image.size == (8, 8) and image.getpixel((0, 0)) == (200, 10, 10)


def test_a_redirect_is_followed_and_each_hop_checked(http_server):
    assert read(f"{http_server}/to-png").size == (8, 8)
    error = refusal(f"{http_server}/to-localhost")  # localhost is not in the allowed list
    assert error.code == "image_url_not_allowed" and "'localhost'" in error.message
    assert "more than 5 redirects" in refusal(f"{http_server}/loop").message
    no_redirects = FetchLimits(allowed_domains=("127.0.0.1",), allow_redirects=False)
    assert "redirects are off" in refusal(f"{http_server}/to-png", no_redirects).message


def test_a_private_address_is_refused_unless_its_host_is_listed(http_server):
    port = http_server.rsplit(":", 1)[1]
    for url in (f"{http_server}/in.png", f"http://localhost:{port}/in.png", f"http://[::1]:{port}/in.png"):
        error = refusal(url, FetchLimits())
        assert error.code == "image_url_not_allowed" and "non-public address" in error.message, error.message
    # Listing the host allows it: the operator's explicit choice.
    assert read(f"http://localhost:{port}/in.png", FetchLimits(allowed_domains=("localhost",))).size == (8, 8)


def test_a_host_outside_the_allowed_list_is_refused_without_a_lookup():
    error = refusal("https://example.com/a.png", LOCAL)
    assert error.code == "image_url_not_allowed" and "allowed: 127.0.0.1" in error.message


@pytest.mark.parametrize(
    "path, reason, code",
    [
        ("/missing.png", "HTTP 404", "image_url_failed"),
        ("/text", "is not an image", "invalid_image"),
        ("/big.png", "above the limit of 4096 bytes (--max-input-image-bytes)", "image_too_large"),
    ],
)
def test_a_failed_fetch_names_the_field_and_the_reason(http_server, path, reason, code):
    error = refusal(f"{http_server}{path}", param="image_reference")
    assert reason in error.message and error.code == code, error.message


def test_a_refused_connection_a_silent_server_and_an_unknown_host(closed_port, silent_port):
    assert "could not connect" in refusal(f"http://127.0.0.1:{closed_port}/a.png").message
    quick = FetchLimits(allowed_domains=("127.0.0.1",), timeout_s=0.2)
    error = refusal(f"http://127.0.0.1:{silent_port}/a.png", quick)
    assert error.code == "image_url_timeout" and "no answer within 0.2 s (VLLM_IMAGE_FETCH_TIMEOUT)" in error.message
    error = refusal("http://no-such-host.invalid/a.png", FetchLimits(allowed_domains=("no-such-host.invalid",)))
    assert "could not be resolved" in error.message


def test_file_urls_only_under_the_allowed_folder(tmp_path):
    (tmp_path / "in.png").write_bytes(PNG)
    assert "--allowed-local-media-path" in refusal(f"file://{tmp_path}/in.png", FetchLimits()).message
    inside = FetchLimits(local_path=tmp_path.resolve())
    assert read(f"file://{tmp_path}/in.png", inside).size == (8, 8)
    assert "must be under" in refusal(f"file://{tmp_path}/../x.png", inside).message
    assert "must be a data URL" in refusal("ftp://example.com/a.png").message


def test_the_video_reference_fields():
    url = data_url(PNG)
    assert video_reference({"input_reference": {"image_url": url}}, uploaded=False).param == "input_reference"
    assert video_reference({"image_reference": url}, uploaded=False).url == url  # upstream's string
    assert video_reference({"image_reference": {"image_url": url}}, uploaded=False).url == url
    assert video_reference({"prompt": "x"}, uploaded=True) is None
    data = {"prompt": "x", "image_reference": url}
    video_reference(data, uploaded=False)
    assert data == {"prompt": "x"}  # taken out of the request's fields
    for given, uploaded, params in [
        ({"image_reference": url}, True, ("input_reference", "image_reference")),
        (
            {"input_reference": {"image_url": url}, "image_reference": url},
            False,
            ("input_reference", "image_reference"),
        ),
        ({"image_reference": url, "video_reference": url}, False, ("image_reference", "video_reference")),
    ]:
        with pytest.raises(APIError) as raised:
            video_reference(given, uploaded)
        assert all(p in raised.value.message for p in params) and raised.value.param == params[1]
    with pytest.raises(APIError, match="takes a video as input") as raised:
        video_reference({"video_reference": "https://example.com/v.mp4"}, uploaded=False)
    assert raised.value.param == "video_reference"
    with pytest.raises(APIError, match="no Files API") as raised:
        video_reference({"input_reference": {"file_id": "file-1"}}, uploaded=False)
    assert raised.value.param == "input_reference"
    with pytest.raises(APIError, match='must be {"image_url": URL}'):
        video_reference({"input_reference": url}, uploaded=False)  # OpenAI's field is an object


def test_the_edit_fields():
    url = data_url(PNG)
    references = edit_references({"images": [{"image_url": url}] * 2, "mask": {"image_url": url}})
    assert [r.label for r in references.images] == ["images[0]", "images[1]"] and references.mask.param == "mask"
    for body, param, text in [
        ({}, "images", "images is required"),
        ({"images": []}, "images", "one or more"),
        ({"images": [{"image_url": url}] * 17}, "images", "at most 16"),
        ({"images": [{"file_id": "file-1"}]}, "images", "images[0].file_id is not supported"),
        ({"images": [{"image_url": url}], "mask": {"file_id": "f"}}, "mask", "mask.file_id is not supported"),
        ({"images": [{"image_url": url}], "image": url}, "image", "multipart form"),
    ]:
        with pytest.raises(APIError, match=text.replace("[", r"\[").replace("]", r"\]")) as raised:
            edit_references(body)
        assert raised.value.param == param


def _route_takes(body: dict) -> bool:
    """Whether the JSON edit route reads ``body``: its references (`edit_references`), then its fields."""
    from pydantic import ValidationError

    from vllm_omni.entrypoints.openai.protocol import ImageEditRequest

    fields = dict(body)
    try:
        edit_references(fields)
        ImageEditRequest.model_validate(fields, strict=None)
    except (APIError, ValidationError):
        return False
    return True


def test_the_json_edit_schema_takes_what_the_route_takes():
    """`ImageEditJSONBody` (the JSON body's OpenAPI schema) and the route that reads the body apart agree."""
    from pydantic import ValidationError

    from vllm_omni.entrypoints.openai.protocol import ImageEditJSONBody

    url = data_url(PNG)
    one = {"prompt": "a door", "images": [{"image_url": url}]}
    bodies = [
        one,
        one | {"images": [{"image_url": url}] * 16, "mask": {"image_url": url}, "strength": 0.5, "n": 2},
        one | {"mask": None},
        {"images": [{"image_url": url}]},  # no prompt
        {"prompt": "a door"},  # no images
        one | {"images": []},
        one | {"images": [{"image_url": url}] * 17},
        one | {"images": [{"image_url": ""}]},
        one | {"images": [{"file_id": "file-1"}]},
        one | {"images": [{"image_url": url, "detail": "high"}]},
        one | {"images": [url]},
        one | {"mask": {"file_id": "f"}},
        one | {"image": url},
        one | {"sharpness": "high"},
        one | {"n": "2"},  # a JSON body's integers are JSON integers
    ]
    for body in bodies:
        try:
            ImageEditJSONBody.model_validate(body, strict=None)
            schema_takes = True
        except ValidationError:
            schema_takes = False
        assert schema_takes == _route_takes(body), body
    assert sum(map(_route_takes, bodies)) == 3


def test_the_sdk_form_spelling_folds_into_the_json_shape():
    assert fold_form_references({"prompt": "x", "input_reference[image_url]": "u"}) == {
        "prompt": "x",
        "input_reference": {"image_url": "u"},
    }
    assert fold_form_references({"other[image_url]": "u"}) == {"other[image_url]": "u"}


def test_the_operator_flags_are_vllms(tmp_path, capsys):
    from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args

    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    parser = make_serve_parser("vllm serve")
    argv = [str(model), "--allowed-media-domains", "a.example", "127.0.0.1"]
    argv += ["--allowed-local-media-path", str(tmp_path)]
    serving = build_serve_config(parser, *parse_serve_args(parser, argv))[2]
    assert serving.allowed_media_domains == ["a.example", "127.0.0.1"]
    limits = FetchLimits.from_serving(serving)
    assert limits.allowed_domains == ("a.example", "127.0.0.1") and limits.local_path == tmp_path.resolve()
    argv = [str(model), "--allowed-local-media-path", str(tmp_path / "missing")]
    with pytest.raises(SystemExit):
        build_serve_config(parser, *parse_serve_args(parser, argv))
    assert "--allowed-local-media-path" in capsys.readouterr().err
