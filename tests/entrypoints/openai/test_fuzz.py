"""Fuzzing the HTTP API of a real server: schema-driven (schemathesis) and hand-written hostile input.

Every answer must be below 500, every non-2xx body OpenAI's error envelope, and the
server must be healthy afterwards.
"""

import collections
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from vllm_omni.testing.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Examples per operation and mode; operations without parameters yield one example however many are asked.
EXAMPLES = {"POST /v1/images/generations": 250, "GET /v1/images/files/{image_id}": 100}
counts: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def server(tiny_flux):
    args = [
        *("--max-num-seqs", "4", "--max-inference-steps", "2", "--max-image-pixels", "4096", "--api-key", API_KEY),
        *("--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"),
    ]
    with RemoteOmniServer(tiny_flux, args) as server:
        yield server
    assert server.returncode == 0


def check(response, what: str) -> None:
    counts["requests"] += 1
    counts[f"{response.status_code // 100}xx"] += 1
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
            if mode is GenerationMode.NEGATIVE and label != "POST /v1/images/generations":
                continue  # no body, no query: nothing to make invalid (a path segment is any string)

            @settings(
                max_examples=EXAMPLES.get(label, 5),
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                check(case.call(headers=AUTH, timeout=60), f"{label} {mode.value}: {case.body!r:.300}")

            fuzz()
    assert counts["requests"] >= 500, counts
    assert httpx.get(server.url_for("health")).status_code == 200


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
    ("empty body", b"", "application/json", 400, None),
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
    ("unknown field", _json(GOOD | {"style": "vivid"}), "application/json", 400, "style"),
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


def test_other_routes_and_methods_answer_envelopes(server):
    for method, path in (
        ("GET", "v1/images/generations"),
        ("DELETE", "v1/models"),
        ("GET", "v2/nothing"),
        ("GET", "v1/images/files/..%2F..%2Fetc%2Fpasswd"),
        ("PUT", "health"),
    ):
        check(httpx.request(method, server.url_for(path), headers=AUTH), f"{method} {path}")


def test_server_is_healthy_after_the_fuzzing(server):
    assert httpx.get(server.url_for("health")).status_code == 200
    response = httpx.post(server.url_for("v1", "images", "generations"), json=GOOD, headers=AUTH, timeout=60)
    assert response.status_code == 200
    print(f"fuzzed requests: {dict(counts)}")
