"""Fuzzing the HTTP API of a real server: schema-driven (schemathesis) and hand-written hostile input.

Every answer must be below 500, every non-2xx body OpenAI's error envelope, and the
server must be healthy afterwards. The image inputs (``POST /v1/images/edits``, a video's
``input_reference``) are fuzzed too, with small input limits so that hostile files are cheap.
"""

import collections
import io
import json
import struct
import urllib.parse
import zipfile
import zlib

import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin
from schemathesis import GenerationMode

from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_INPUT_BYTES = 64 * 1024
MAX_INPUT_PIXELS = 128 * 128
EDITS, VIDEOS = "/v1/images/edits", "/v1/videos"
# Examples per operation and mode; operations without parameters yield one example however many are asked.
EXAMPLES = {"POST /v1/images/generations": 250, "GET /v1/images/files/{image_id}": 100, f"POST {EDITS}": 200}
BODIES = ("POST /v1/images/generations", f"POST {EDITS}")
"""The operations with a request body: the negative mode has something to make invalid."""
counts: collections.Counter = collections.Counter()
edit_errors: collections.Counter = collections.Counter()
"""(status, param, code) of the schema-driven edits' refusals."""
real_image_outcomes: collections.Counter = collections.Counter()
"""The schema-driven edits with real images: ``200``, or the param of the refusal."""


@pytest.fixture(scope="module")
def server(tiny_flux):
    args = [
        *("--max-num-seqs", "4", "--max-inference-steps", "2", "--max-image-pixels", "4096", "--api-key", API_KEY),
        *("--max-input-image-bytes", str(MAX_INPUT_BYTES), "--max-input-image-pixels", str(MAX_INPUT_PIXELS)),
        *("--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"),
    ]
    with RemoteOmniServer(tiny_flux, args) as server:
        yield server
    assert server.returncode == 0


def _path(response) -> str:
    """The path a response answers (an httpx response, or schemathesis' whose request is a requests one)."""
    request = response.request
    return request.url.path if isinstance(request, httpx.Request) else urllib.parse.urlsplit(request.url).path


def check(response, what: str) -> None:
    counts["requests"] += 1
    counts[f"{response.status_code // 100}xx"] += 1
    path = _path(response)
    if path in (EDITS, VIDEOS):  # counted before the asserts, so that a 5xx is counted too
        counts[f"{path} requests"] += 1
        counts[f"{path} 5xx"] += response.status_code >= 500
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], what


def test_schema_driven_fuzzing(server):
    schema = schemathesis.openapi.from_url(server.url_for("openapi.json"))
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and label not in BODIES:
                continue  # no body, no query: nothing to make invalid (a path segment is any string)
            _fuzz_operation(operation, label, mode)
    assert counts["requests"] >= 900 and counts[f"{EDITS} requests"] >= 400, counts
    # The generated bodies reach the route: its own refusals (a file missing or not an image, the form's fields; a
    # JSON body's images by image_url, the schema's other content type).
    params = {param for _, param, _ in edit_errors}
    assert {"image", "images", "prompt"} <= params, edit_errors
    assert {status for status, _, _ in edit_errors} <= {400, 404}, edit_errors  # 404: a model of another name
    assert httpx.get(server.url_for("health")).status_code == 200


def _fuzz_operation(operation, label: str, mode: GenerationMode) -> None:
    """Hypothesis' examples of ``operation`` in ``mode``, each sent to the server and checked."""

    @settings(
        max_examples=EXAMPLES.get(label, 5),
        deadline=None,
        database=None,
        derandomize=True,  # the same examples on every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(headers=AUTH, timeout=60)
        check(response, f"{label} {mode.value}: {case.body!r:.300}")
        if operation.path == EDITS and response.status_code >= 400:
            error = response.json()["error"]
            _check_edit_param(error, f"{mode.value}: {case.body!r:.300}")
            edit_errors[response.status_code, error["param"], error["code"]] += 1

    fuzz()


def _check_edit_param(error: dict, what: str) -> None:
    """An edit's refusal names one of the form's fields or the JSON body's (``images``), the unknown field it got,
    or none (the whole body)."""
    from vllm_omni.entrypoints.openai.protocol import ImageEditJSONBody  # imported here: it imports torch

    if error["code"] == "unknown_parameter":
        assert isinstance(error["param"], str), what
    else:
        assert error["param"] in {None, "image", "image[]", *ImageEditJSONBody.model_fields}, (error, what)


def _encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
    pixels = np.random.RandomState(width * height).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _mask(width: int = 32, height: int = 32) -> bytes:
    """OpenAI's mask: a PNG whose fully transparent pixels (here the centre square) mark what to edit."""
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (width // 4, height // 4, 3 * width // 4, 3 * height // 4))
    return _encode(mask)


def _png_bomb(side: int) -> bytes:
    """A 1-bit grayscale PNG whose header declares ``side × side`` pixels and whose IDAT is a real zlib stream of
    all its (zero) rows: tiny on disk, ``side²`` bytes once decoded by Pillow."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (side + 7) // 8)  # filter byte + the packed row
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # bit depth 1, grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _post(server, content: bytes, content_type: str | None = "application/json", **kwargs) -> httpx.Response:
    headers = AUTH | ({"Content-Type": content_type} if content_type else {})
    return httpx.post(
        server.url_for("v1", "images", "generations"), content=content, headers=headers, timeout=60, **kwargs
    )


def _json(body: dict) -> bytes:
    return json.dumps(body).encode()


GOOD = {"prompt": "a cat", "size": "32x32", "num_inference_steps": 2, "response_format": "b64_json"}
NASTY = [
    # (name, raw body, content type, expected status, expected param)
    ("not json", b"not json", "application/json", 400, None),
    ("invalid utf-8", b"\xff\xfe{", "application/json", 400, None),
    ("json null", b"null", "application/json", 400, None),
    ("json list", b"[]", "application/json", 400, None),
    ("json string", b'"a cat"', "application/json", 400, None),
    ("text/plain", _json(GOOD), "text/plain", 400, None),
    ("xml", b"<prompt>cat</prompt>", "application/xml", 400, None),
    ("form", b"prompt=cat", "application/x-www-form-urlencoded", 400, None),
    ("no content type", _json(GOOD), None, 400, None),
    ("empty body", b"", "application/json", 400, "prompt"),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json", 400, None),
    (
        "NaN guidance",
        b'{"prompt": "x", "size": "32x32", "guidance_scale": NaN}',
        "application/json",
        400,
        "guidance_scale",
    ),
    (
        "inf guidance",
        b'{"prompt": "x", "size": "32x32", "guidance_scale": Infinity}',
        "application/json",
        400,
        "guidance_scale",
    ),
    ("1 MB prompt", _json(GOOD | {"prompt": "x" * 1_000_000}), "application/json", 400, "prompt"),
    ("lone surrogate", b'{"prompt": "\\ud800 cat", "size": "32x32"}', "application/json", 400, "prompt"),
    ("prompt number", _json(GOOD | {"prompt": 42}), "application/json", 400, "prompt"),
    ("n at limit", _json(GOOD | {"n": 10}), "application/json", 200, None),
    ("n over", _json(GOOD | {"n": 11}), "application/json", 400, "n"),
    ("n zero", _json(GOOD | {"n": 0}), "application/json", 400, "n"),
    ("n string", _json(GOOD | {"n": "2"}), "application/json", 400, "n"),
    ("steps at limit", _json(GOOD | {"num_inference_steps": 2}), "application/json", 200, None),
    ("steps over", _json(GOOD | {"num_inference_steps": 3}), "application/json", 400, "num_inference_steps"),
    ("steps negative", _json(GOOD | {"num_inference_steps": -1}), "application/json", 400, "num_inference_steps"),
    ("pixels at limit", _json(GOOD | {"size": "64x64"}), "application/json", 200, None),
    ("pixels over", _json(GOOD | {"size": "72x64"}), "application/json", 400, "size"),
    ("size 0x0", _json(GOOD | {"size": "0x0"}), "application/json", 400, "size"),
    ("size 64x", _json(GOOD | {"size": "64x"}), "application/json", 400, "size"),
    ("size huge", _json(GOOD | {"size": "99999x99999"}), "application/json", 400, "size"),
    ("size one huge side", _json(GOOD | {"size": "99999x8"}), "application/json", 400, "size"),
    ("size 64X64", _json(GOOD | {"size": "64X64"}), "application/json", 400, "size"),
    ("size 3d", _json(GOOD | {"size": "8x8x8"}), "application/json", 400, "size"),
    ("size negative", _json(GOOD | {"size": "-64x64"}), "application/json", 400, "size"),
    ("size auto over limit", _json(GOOD | {"size": "auto"}), "application/json", 400, "size"),
    ("size not a multiple", _json(GOOD | {"size": "36x36"}), "application/json", 400, "size"),
    ("seed negative", _json(GOOD | {"seed": -1}), "application/json", 400, "seed"),
    ("seed float", _json(GOOD | {"seed": 1.5}), "application/json", 400, "seed"),
    ("seed string", _json(GOOD | {"seed": "7"}), "application/json", 400, "seed"),
    ("seed too big", _json(GOOD | {"seed": 2**63}), "application/json", 400, "seed"),
    ("seed max", _json(GOOD | {"seed": 2**63 - 1}), "application/json", 200, None),
    (
        "unicode and control characters",
        _json(GOOD | {"prompt": "\u0000\u0007\u202e日本語 🙂 \t\n\r"}),
        "application/json",
        200,
        None,
    ),
    ("unknown field", _json(GOOD | {"sharpness": "high"}), "application/json", 400, "sharpness"),
    ("openai field ignored here", _json(GOOD | {"complexity": "high"}), "application/json", 200, None),
]


@pytest.mark.parametrize("name,content,content_type,status,param", NASTY, ids=[case[0] for case in NASTY])
def test_hostile_input(server, name, content, content_type, status, param):
    response = _post(server, content, content_type)
    check(response, name)
    assert response.status_code == status, response.text[:500]
    if status != 200:
        assert response.json()["error"]["param"] == param
    else:
        assert response.json()["data"][0]["b64_json"]


def test_bodies_over_the_limit_are_413_before_they_are_read(server):
    too_big = b'{"prompt": "' + b"x" * (1024 * 1024 + 10) + b'"}'
    declared = _post(server, too_big)
    check(declared, "content-length over the limit")
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        for _ in range(40):
            yield b"x" * 65536

    streamed = _post(server, chunks())
    check(streamed, "chunked body over the limit")
    assert streamed.status_code == 413


def _text_chunk(size: int) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_text("padding", "x" * size)
    return info


def _inflated_size(png: bytes) -> int:
    """How many bytes the first IDAT chunk of ``png`` (after an IHDR) inflates to, counted in slices."""
    (length,) = struct.unpack(">I", png[33:37])
    inflater, data, size = zlib.decompressobj(), png[41 : 41 + length], 0
    while data:
        size += len(inflater.decompress(data, 1 << 20))
        data = inflater.unconsumed_tail
    return size


PNG32 = _encode(_noise(32, 32))
REAL_IMAGES = [PNG32, _encode(_noise(32, 32), "JPEG"), _encode(_noise(32, 32), "WEBP"), _encode(_noise(16, 48))]
REAL_MASKS = [None, _mask(), _mask(16, 16), PNG32]  # none, a good one, another size, no alpha
EDIT = {"prompt": "a cat", "num_inference_steps": "2", "response_format": "b64_json"}


def test_schema_driven_edits_with_real_images(server):
    """The form's fields as the schema generates them, with real image files (and masks) in place of the random
    bytes: the generated values reach admission and the engine, alone and in batches."""
    operation = schemathesis.openapi.from_url(server.url_for("openapi.json"))[EDITS]["POST"]
    properties = set(operation.definition.raw["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"])
    outcomes = real_image_outcomes
    # The form's cases (the schema's other body is OpenAI's JSON, whose images are URLs)
    form = operation.as_strategy(generation_mode=GenerationMode.POSITIVE).filter(
        lambda case: case.media_type == "multipart/form-data"
    )

    @settings(max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(form, st.data())
    def fuzz(case, data):
        # Absent rather than null (a form has no null); one model name; one image file (the model takes one).
        body = {k: v for k, v in case.body.items() if k in properties - {"image[]", "model"} and v is not None}
        body["image"] = data.draw(st.sampled_from(REAL_IMAGES), label="image")
        mask = data.draw(st.sampled_from(REAL_MASKS), label="mask")
        body = {k: v for k, v in body.items() if k != "mask"} | ({"mask": mask} if mask is not None else {})
        body["size"] = data.draw(st.sampled_from(["auto", "32x32", "16x48", body.get("size", "auto")]), label="size")
        steps = data.draw(st.sampled_from([1, 2, body.get("num_inference_steps", 2)]), label="steps")
        case.body = body | {"num_inference_steps": steps}
        response = case.call(headers=AUTH, timeout=120)
        what = f"real images: { {k: v for k, v in case.body.items() if k not in ('image', 'mask')}!r:.300}"
        check(response, what)
        if response.status_code == 200:
            assert _images_made(response, what) == case.body.get("n", 1), what
            outcomes["200"] += 1
        else:
            error = response.json()["error"]
            _check_edit_param(error, what)
            outcomes[error["param"]] += 1

    fuzz()
    assert outcomes["200"] > 0, outcomes  # some reached the engine (about a quarter of them)


def _images_made(response, what: str) -> int:
    """The images of a 200 answer: its ``data``, a stream's ``image_edit.completed`` events (``stream`` is one of
    the form's fields), which must end the stream without an ``error`` event, or for ``response_format: file`` the
    image itself or the zip of them."""
    content_type = response.headers["content-type"]
    content_type = content_type[0] if isinstance(content_type, list) else content_type  # schemathesis: a list
    if content_type.startswith("image/"):
        return 1
    if content_type == "application/zip":
        with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
            return len(archive.namelist())
    if not content_type.startswith("text/event-stream"):
        return len(response.json()["data"])
    events = [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1]["type"] == "image_edit.completed", f"{what}: {events[-1:]!r:.500}"
    return sum(event["type"] == "image_edit.completed" for event in events)


BOMB = _png_bomb(20_000)
"""400 M pixels declared, 50 MB of rows once decompressed, about 48 KB on disk: below the byte limit."""
TRUNCATED = _encode(_noise(32, 32))[:1500]
OVER_BYTES = _encode(_noise(32, 32), pnginfo=_text_chunk(MAX_INPUT_BYTES))
"""A valid 32x32 PNG above the byte limit (an uncompressed text chunk)."""
EDIT_CASES = [
    # (name, form fields changed (None: removed), files, expected status, param, code (None: not checked))
    ("one image", {}, [("image", PNG32)], 200, None, None),
    ("image[] and a mask (inpainting)", {}, [("image[]", PNG32), ("mask", _mask())], 200, None, None),
    ("JPEG, size auto", {"size": "auto"}, [("image", REAL_IMAGES[1])], 200, None, None),
    ("WebP, strength 1", {"strength": "1"}, [("image", REAL_IMAGES[2])], 200, None, None),
    ("CMYK JPEG", {}, [("image", _encode(_noise(32, 32, "CMYK"), "JPEG"))], 200, None, None),
    ("16-bit PNG", {}, [("image", _encode(Image.fromarray(np.full((32, 32), 40000, np.uint16))))], 200, None, None),
    ("palette PNG", {}, [("image", _encode(_noise(32, 32, "P"), transparency=0))], 200, None, None),
    (
        "animated PNG",
        {},
        [("image", _encode(_noise(32, 32), save_all=True, append_images=[_noise(32, 32, "L")]))],
        200,
        None,
        None,
    ),
    ("decompression bomb as the mask", {}, [("image", PNG32), ("mask", BOMB)], 400, "mask", "image_too_large"),
    ("pixels over the limit", {}, [("image", _encode(_noise(129, 128)))], 400, "image", "image_too_large"),
    ("over the byte limit", {}, [("image", OVER_BYTES)], 400, "image", "image_too_large"),
    ("truncated PNG", {}, [("image", TRUNCATED)], 400, "image", "invalid_image"),
    ("PNG signature alone", {}, [("image", b"\x89PNG\r\n\x1a\n")], 400, "image", "invalid_image"),
    ("empty file", {}, [("image", b"")], 400, "image", "invalid_image"),
    ("random bytes", {}, [("image", bytes(range(256)) * 4)], 400, "image", "invalid_image"),
    ("GIF", {}, [("image", _encode(_noise(32, 32), "GIF"))], 400, "image", "invalid_image"),
    ("BMP", {}, [("image", _encode(_noise(32, 32), "BMP"))], 400, "image", "invalid_image"),
    ("TIFF", {}, [("image", _encode(_noise(32, 32), "TIFF"))], 400, "image", "invalid_image"),
    ("image as a text value", {"image": "a cat"}, [], 400, "image", "invalid_value"),
    ("mask as a text value", {"mask": "a cat"}, [("image", PNG32)], 400, "mask", "invalid_value"),
    ("mask of another size", {}, [("image", PNG32), ("mask", _mask(16, 16))], 400, "mask", "invalid_value"),
    ("mask without alpha", {}, [("image", PNG32), ("mask", PNG32)], 400, "mask", "invalid_image"),
    ("JPEG mask", {}, [("image", PNG32), ("mask", REAL_IMAGES[1])], 400, "mask", "invalid_image"),
    ("two masks", {}, [("image", PNG32), ("mask", _mask()), ("mask", _mask())], 400, "mask", "invalid_value"),
    ("17 images", {}, [("image[]", PNG32)] * 17, 400, "image", "invalid_value"),
    ("16 images to a one-image model", {}, [("image[]", PNG32)] * 16, 400, "image", "invalid_value"),
    ("image and image[]", {}, [("image", PNG32), ("image[]", PNG32)], 400, "image", "invalid_value"),
    ("image too small for the model", {}, [("image", _encode(_noise(1, 1)))], 400, "image", "invalid_value"),
    ("missing prompt", {"prompt": None}, [("image", PNG32)], 400, "prompt", "missing_required_parameter"),
    ("empty prompt", {"prompt": ""}, [("image", PNG32)], 400, "prompt", "invalid_value"),
    ("1 MB prompt", {"prompt": "x" * 1_000_000}, [("image", PNG32)], 400, "prompt", None),
    ("missing image", {}, [], 400, "image", None),
    ("strength 0", {"strength": "0"}, [("image", PNG32)], 400, "strength", "invalid_value"),
    ("strength 1.5", {"strength": "1.5"}, [("image", PNG32)], 400, "strength", "invalid_value"),
    ("strength abc", {"strength": "abc"}, [("image", PNG32)], 400, "strength", "invalid_value"),
    ("strength nan", {"strength": "nan"}, [("image", PNG32)], 400, "strength", "invalid_value"),
    ("strength -inf", {"strength": "-inf"}, [("image", PNG32)], 400, "strength", "invalid_value"),
    ("n over", {"n": "11"}, [("image", PNG32)], 400, "n", "invalid_value"),
    ("n text", {"n": "two"}, [("image", PNG32)], 400, "n", "invalid_value"),
    ("steps over", {"num_inference_steps": "3"}, [("image", PNG32)], 400, "num_inference_steps", "invalid_value"),
    ("size over the output limit", {"size": "128x128"}, [("image", PNG32)], 400, "size", "invalid_value"),
    ("size auto over the output limit", {"size": "auto"}, [("image", _encode(_noise(128, 96)))], 400, "size", None),
    ("seed negative", {"seed": "-1"}, [("image", PNG32)], 400, "seed", "invalid_value"),
    ("guidance nan", {"guidance_scale": "nan"}, [("image", PNG32)], 400, "guidance_scale", "invalid_value"),
    ("compression of a PNG", {"output_compression": "50"}, [("image", PNG32)], 200, None, None),  # with a Warning
    ("unknown field", {"sharpness": "high"}, [("image", PNG32)], 400, "sharpness", "unknown_parameter"),
    ("another model", {"model": "other"}, [("image", PNG32)], 404, "model", "model_not_found"),
    ("too many fields", {f"x{i}": "1" for i in range(70)}, [("image", PNG32)], 400, None, "invalid_form"),
]


def _multipart(fields: dict, files: list[tuple[str, bytes]]) -> list:
    """httpx's ``files``: the text fields as parts without a filename (so a form without files is multipart too)."""
    parts = [(name, (None, value)) for name, value in fields.items() if value is not None]
    return parts + [(name, (f"{name}.png", data, "image/png")) for name, data in files]


def _edit(server, fields: dict, files: list[tuple[str, bytes]], path: str = EDITS) -> httpx.Response:
    return httpx.post(server.url_for(path.strip("/")), files=_multipart(fields, files), headers=AUTH, timeout=120)


@pytest.mark.parametrize("name,fields,files,status,param,code", EDIT_CASES, ids=[case[0] for case in EDIT_CASES])
def test_hostile_edits(server, name, fields, files, status, param, code):
    response = _edit(server, EDIT | fields, files)
    check(response, name)
    assert response.status_code == status, response.text[:500]
    if status == 200:
        assert response.json()["data"][0]["b64_json"]
        if name == "compression of a PNG":  # a field PNG ignores: accepted, and said so
            assert "output_compression" in response.headers["Warning"]
        return
    error = response.json()["error"]
    assert error["param"] == param, error
    assert code is None or error["code"] == code, error
    if name in ("GIF", "BMP", "TIFF"):  # refused naming the formats it takes
        assert all(fmt in error["message"].lower() for fmt in ("png", "jpeg", "webp")), error


def test_decompression_bombs_are_refused_from_their_header(server):
    """A bomb below the byte limit is refused by the pixel limit, from its header: Pillow would need 400 MB to
    decode it, and a decode error would answer ``could not be decoded``; the 10000² one names its declared size."""
    assert len(BOMB) < MAX_INPUT_BYTES and _inflated_size(BOMB) == 20_000 * (1 + 20_000 // 8)
    for data in (BOMB, _png_bomb(10_000)):
        response = _edit(server, EDIT, [("image", data)])
        check(response, "decompression bomb")
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (400, "image", "image_too_large"), error
        assert "pixels" in error["message"], error
    assert "(10000x10000)" in error["message"], error


EDIT_RAW = [
    # (name, raw body, content type, expected param); all 400
    # a JSON edit takes images: [{"image_url": ...}]; its multipart field is refused by name
    ("JSON body", _json({"prompt": "a cat", "image": "aGVsbG8="}), "application/json", "image"),
    ("urlencoded form", b"prompt=a+cat", "application/x-www-form-urlencoded", "image"),  # a form with no file
    ("no content type", b"prompt=a+cat", None, None),
    ("multipart without a boundary", b"--BB\r\n", "multipart/form-data", None),
    ("malformed multipart", b"garbage", "multipart/form-data; boundary=BB", None),
    (
        "part without a name",
        b"--BB\r\nContent-Disposition: form-data\r\n\r\nx\r\n--BB--\r\n",
        "multipart/form-data; boundary=BB",
        None,
    ),
    (
        "part over the part limit",
        b'--BB\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n' + b"x" * (2 << 20) + b"\r\n--BB--\r\n",
        "multipart/form-data; boundary=BB",
        None,
    ),
    ("empty multipart", b"--BB--\r\n", "multipart/form-data; boundary=BB", "prompt"),
]


@pytest.mark.parametrize("name,content,content_type,param", EDIT_RAW, ids=[case[0] for case in EDIT_RAW])
def test_hostile_edit_bodies(server, name, content, content_type, param):
    headers = AUTH | ({"Content-Type": content_type} if content_type else {})
    response = httpx.post(server.url_for(EDITS.strip("/")), content=content, headers=headers, timeout=60)
    check(response, name)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text[:500]


def test_edit_bodies_over_the_upload_limit_are_413(server):
    """The upload routes' body limit (room for 17 files at the byte limit), declared or streamed."""
    from vllm_omni.config.serving import ServingConfig  # imported here: they import torch
    from vllm_omni.entrypoints.openai.uploads import upload_body_limit

    limit = upload_body_limit(ServingConfig(max_input_image_bytes=MAX_INPUT_BYTES))
    url, headers = server.url_for(EDITS.strip("/")), AUTH | {"Content-Type": "multipart/form-data; boundary=BB"}
    declared = httpx.post(url, content=b"x" * (limit + 1), headers=headers, timeout=60)
    check(declared, "edit: content-length over the limit")
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'--BB\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536

    streamed = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    check(streamed, "edit: chunked body over the limit")
    assert streamed.status_code == 413


VIDEO_CASES = [
    # (name, form fields, files, param, code); all 400: the model is an image model
    ("input_reference to an image model", {}, [("input_reference", PNG32)], "model", "model_not_supported"),
    (
        "GIF input_reference",
        {},
        [("input_reference", _encode(_noise(8, 8), "GIF"))],
        "model",
        "model_not_supported",
    ),
    ("bomb input_reference", {}, [("input_reference", BOMB)], "model", "model_not_supported"),
    ("truncated input_reference", {}, [("input_reference", TRUNCATED)], "model", "model_not_supported"),
    ("input_reference as a text value", {"input_reference": "a cat"}, [], "input_reference", "invalid_value"),
    ("two input_reference files", {}, [("input_reference", PNG32)] * 2, None, "invalid_form"),
]


@pytest.mark.parametrize("name,fields,files,param,code", VIDEO_CASES, ids=[case[0] for case in VIDEO_CASES])
def test_hostile_video_references(server, name, fields, files, param, code):
    """An image model is refused before its ``input_reference`` is read, whatever the file."""
    response = _edit(server, {"prompt": "a cat"} | fields, files, path=VIDEOS)
    check(response, name)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, param, code), error


def test_other_routes_and_methods_answer_envelopes(server):
    for method, path in (
        ("GET", "v1/images/generations"),
        ("DELETE", "v1/models"),
        ("GET", "v2/nothing"),
        ("GET", "v1/images/files/..%2F..%2Fetc%2Fpasswd"),
        ("PUT", "health"),
        ("GET", "v1/images/edits"),
        ("PUT", "v1/images/edits"),
    ):
        check(httpx.request(method, server.url_for(path), headers=AUTH), f"{method} {path}")


def test_server_is_healthy_after_the_fuzzing(server):
    assert httpx.get(server.url_for("health")).status_code == 200
    response = httpx.post(server.url_for("v1", "images", "generations"), json=GOOD, headers=AUTH, timeout=60)
    assert response.status_code == 200
    edit = _edit(server, EDIT, [("image", PNG32)])
    assert edit.status_code == 200, edit.text[:500]
    print(f"fuzzed requests: {dict(counts)}")
    print(f"fuzz edits: {counts[f'{EDITS} requests']} requests, {counts[f'{EDITS} 5xx']} 5xx")
    print(f"fuzz videos: {counts[f'{VIDEOS} requests']} requests, {counts[f'{VIDEOS} 5xx']} 5xx")
    print(
        f"schema-driven edits: refusals {dict(edit_errors.most_common(8))}; "
        f"with real images {dict(real_image_outcomes)}"
    )
    assert counts[f"{EDITS} 5xx"] == counts[f"{VIDEOS} 5xx"] == 0
