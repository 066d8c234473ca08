"""LoRA adapters on a real server, driven with the real `openai` client: ``model: "<adapter>"`` and the ``lora``
field select adapters whose images equal the stock diffusers run (load_lora_weights + set_adapters, alone), mixed
batches change no row, refusals name the field, the runtime load/unload routes, eviction under ``--max-loras``, the
metrics, start-up failures that name the file, and the routes' absence without VLLM_ALLOW_RUNTIME_LORA_UPDATING."""

import asyncio
import base64
import contextlib
import io
import multiprocessing.forkserver
import os

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.testing.models.lora import stock_lora_images, write_random_lora
from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PROMPT = "a cat in a hat"
STEPS = 2
TOL = 2 / 255 + 1e-6
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def adapters(tiny_sd, tmp_path_factory) -> dict[str, str]:
    """Random adapters for the tiny SD model: a (with text-encoder weights), b and c (denoiser only), rank16 (rank
    16), and a garbage file."""
    root = tmp_path_factory.mktemp("lora")
    garbage = root / "garbage.safetensors"
    garbage.write_bytes(b"this is not a safetensors file\n" * 4)
    return {
        "a": write_random_lora(tiny_sd, str(root / "a"), seed=1, text_encoder=True),
        "b": write_random_lora(tiny_sd, str(root / "b"), seed=2),
        "c": write_random_lora(tiny_sd, str(root / "c"), seed=3),
        "rank16": write_random_lora(tiny_sd, str(root / "rank16"), seed=4, rank=16),
        "garbage": str(garbage),
    }


@pytest.fixture(scope="module")
def server(tiny_sd, adapters, tmp_path_factory):
    """Step mode, two resident adapters, the runtime routes on."""
    args = [
        *("--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"),
        *("--max-loras", "2", "--max-num-seqs", "4", "--execution-mode", "step"),
        *("--api-key", API_KEY, "--uvicorn-log-level", "warning"),
    ]
    log = str(tmp_path_factory.mktemp("logs") / "step.log")
    with contextlib.ExitStack() as stack:
        # The server reads RUNTIME_ENV when it builds its app, not at import: a fork of the preloaded forkserver
        # (which starts with this process's environment as it is when the server starts) takes it as a real
        # ``vllm`` process would, without importing the stack again. Set for the start only, and the forkserver
        # started before (a fork keeps what the forkserver had): no later server or test sees it.
        multiprocessing.forkserver.ensure_running()
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv(RUNTIME_ENV, "true")
            server = stack.enter_context(RemoteOmniServer(tiny_sd, args, log_path=log))
        server.model = tiny_sd
        yield server


@pytest.fixture(scope="module")
def request_server(tiny_sd, adapters, tmp_path_factory):
    """Request mode, one resident adapter: a and b never share a batch."""
    args = [
        *("--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}"),
        *("--max-loras", "1", "--max-num-seqs", "4", "--request-batch-max-wait-ms", "0"),
        *("--api-key", API_KEY, "--uvicorn-log-level", "warning"),
    ]
    log = str(tmp_path_factory.mktemp("logs") / "request.log")
    with RemoteOmniServer(tiny_sd, args, log_path=log) as server:
        yield server


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def decoded(response) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))), dtype=np.float32) / 255


def _generate_args(seed: int, model: str | None, lora) -> dict:
    extra = {"seed": seed, "num_inference_steps": STEPS} | ({} if lora is None else {"lora": lora})
    args = {"prompt": PROMPT, "size": "64x64", "response_format": "b64_json", "extra_body": extra}
    return args | ({} if model is None else {"model": model})


def generate(server, seed: int, *, model: str | None = None, lora=None) -> np.ndarray:
    return decoded(_client(server).images.generate(**_generate_args(seed, model, lora)))


async def generate_all(server, requests: list[dict]) -> list[np.ndarray]:
    """``requests`` (each ``seed`` with ``model`` and/or ``lora``) sent at once."""
    async with openai.AsyncOpenAI(
        base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0, timeout=TIMEOUT
    ) as client:
        responses = await asyncio.gather(
            *(client.images.generate(**_generate_args(r["seed"], r.get("model"), r.get("lora"))) for r in requests)
        )
    return [decoded(response) for response in responses]


_STOCK: dict = {}


def stock(model: str, paths: dict[str, str], seed: int, **weights: float) -> np.ndarray:
    """The stock pipeline's image with ``weights`` (adapter name → scale; none: the base model), memoized."""
    key = (model, seed, tuple(weights.items()))
    if key not in _STOCK:
        chosen = {name: paths[name] for name in weights}
        result = stock_lora_images(
            model, chosen, weights, PROMPT, seed=seed, num_inference_steps=STEPS, height=64, width=64
        )
        _STOCK[key] = np.asarray(result.images[0], dtype=np.float32) / 255
    return _STOCK[key]


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape == (64, 64, 3)
    assert np.abs(actual - expected).max() <= TOL, np.abs(actual - expected).max() * 255


def post(server, path: str, body: dict, *, key: bool = True) -> httpx.Response:
    return httpx.post(server.url_for(*path.split("/")), json=body, headers=AUTH if key else {}, timeout=TIMEOUT)


def metric_samples(server) -> dict[tuple[str, frozenset], float]:
    """Every sample of ``/metrics``: (name, labels) → value."""
    text = httpx.get(server.url_for("metrics"), timeout=TIMEOUT).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def lora_requests(server, adapter: str) -> float:
    return metric_samples(server).get(("vllm_omni:lora_requests_total", frozenset({("adapter", adapter)})), 0.0)


def resident(server) -> float:
    labels = frozenset({("stage", "0"), ("replica", "0")})
    return metric_samples(server)[("vllm_omni:lora_adapters_resident", labels)]


def served_models(server) -> dict[str, dict]:
    return {m.id: m.model_dump() for m in _client(server).models.list().data}


# Server 1: step mode.


def test_models_lists_the_base_model_and_its_adapters(server, adapters):
    models = served_models(server)
    base = server.model  # the served model name defaults to the model path
    assert base in models and models[base].get("parent") is None
    for name in ("a", "b"):
        assert models[name]["parent"] == base, models[name]
        assert models[name]["root"] == adapters[name], models[name]
    # The same over plain HTTP, and behind the API key.
    listed = httpx.get(server.url_for("v1", "models"), headers=AUTH, timeout=TIMEOUT).json()["data"]
    assert {m["id"]: m["parent"] for m in listed if m["id"] in ("a", "b")} == {"a": base, "b": base}
    assert httpx.get(server.url_for("v1", "models"), timeout=TIMEOUT).status_code == 401


def test_model_and_lora_field_select_the_same_adapter_as_stock(server, adapters):
    by_model = generate(server, 3, model="a")
    by_field = generate(server, 3, lora={"name": "a"})
    by_both = generate(server, 3, model="a", lora=[{"name": "a", "scale": 1.0}])
    by_base_model = generate(server, 3, model=server.model, lora={"name": "a"})
    for image in (by_field, by_both, by_base_model):
        assert np.array_equal(by_model, image)
    assert_close(by_model, stock(server.model, adapters, 3, a=1.0))
    # The adapter changes the image: the test would not see a server that ignored it.
    assert np.abs(by_model - stock(server.model, adapters, 3)).max() > 10 / 255


def test_a_scaled_stack_and_the_base_model_equal_stock(server, adapters):
    stacked = generate(server, 4, lora=[{"name": "a", "scale": 0.8}, {"name": "b", "scale": 0.5}])
    assert_close(stacked, stock(server.model, adapters, 4, a=0.8, b=0.5))
    assert_close(generate(server, 4), stock(server.model, adapters, 4))
    assert_close(generate(server, 4, model=server.model), stock(server.model, adapters, 4))
    negative = generate(server, 4, lora={"name": "b", "scale": -0.5})
    assert_close(negative, stock(server.model, adapters, 4, b=-0.5))


def test_concurrent_requests_with_different_adapters_each_equal_stock(server, adapters):
    requests = [
        {"seed": 5, "model": "a"},
        {"seed": 6, "lora": {"name": "b", "scale": 0.7}},
        {"seed": 7},
        {"seed": 8, "lora": [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 1.5}]},
    ]
    expected = [
        stock(server.model, adapters, 5, a=1.0),
        stock(server.model, adapters, 6, b=0.7),
        stock(server.model, adapters, 7),
        stock(server.model, adapters, 8, a=0.5, b=1.5),
    ]
    for image, reference in zip(asyncio.run(generate_all(server, requests)), expected, strict=True):
        assert_close(image, reference)


REFUSALS = {
    "unknown adapter as model": ({"model": "zz"}, 404, "model", "model_not_found"),
    "unknown adapter in lora": ({"lora": {"name": "zz"}}, 404, "lora", "model_not_found"),
    "unknown adapter in a stack": ({"lora": [{"name": "a"}, {"name": "zz"}]}, 404, "lora", "model_not_found"),
    "scale 100": ({"lora": {"name": "a", "scale": 100}}, 400, "lora", None),
    "scale -100": ({"lora": [{"name": "a", "scale": -100}]}, 400, "lora", None),
    "scale as text": ({"lora": {"name": "a", "scale": "strong"}}, 400, "lora", None),
    "model names another adapter than lora": ({"model": "a", "lora": [{"name": "b"}]}, 400, "model", "invalid_value"),
    "unknown field in lora": ({"lora": {"name": "a", "weight": 1}}, 400, "lora", "unknown_parameter"),
    "path in lora": ({"lora": {"name": "a", "path": "/etc"}}, 400, "lora", "unknown_parameter"),
    "no name": ({"lora": {"scale": 1}}, 400, "lora", None),
    "empty name": ({"lora": {"name": ""}}, 400, "lora", None),
    "a bare string": ({"lora": "a"}, 400, "lora", None),
    "an adapter twice": ({"lora": [{"name": "a"}, {"name": "a", "scale": 0.5}]}, 400, "lora", None),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_field(server, case):
    body, status, param, code = REFUSALS[case]
    response = post(server, "v1/images/generations", {"prompt": "x", "size": "64x64"} | body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if case == "unknown adapter as model":  # it lists what the server serves
        assert "zz" in error["message"] and "a, b" in error["message"], error
    if status == 404:
        assert "zz" in error["message"], error


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_scales_are_refused(server, value):
    """Python's JSON (and so the server's) reads NaN and Infinity; the scale must still be finite."""
    body = '{"prompt": "x", "size": "64x64", "lora": {"name": "a", "scale": ' + value + "}}"
    response = httpx.post(
        server.url_for("v1", "images", "generations"),
        content=body,
        headers=AUTH | {"Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "lora"


def test_runtime_load_and_unload(server, adapters):
    loaded = post(server, "v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert loaded.status_code == 200 and "c" in loaded.text, loaded.text
    try:
        models = served_models(server)
        assert models["c"]["parent"] == server.model and models["c"]["root"] == adapters["c"]
        assert_close(generate(server, 9, lora={"name": "c"}), stock(server.model, adapters, 9, c=1.0))
        assert_close(generate(server, 9, model="c"), stock(server.model, adapters, 9, c=1.0))

        # Three adapters served, but a stack of three is above --max-loras 2.
        stack = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
        refused = post(server, "v1/images/generations", {"prompt": "x", "size": "64x64", "lora": stack})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora", refused.text
        assert "--max-loras 2" in refused.json()["error"]["message"]

        again = post(server, "v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
        inplace = post(
            server, "v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"], "load_inplace": True}
        )
        assert inplace.status_code == 400 and inplace.json()["error"]["param"] == "load_inplace", inplace.text
        for name in ("a", "b"):  # --lora-modules names are taken too
            taken = post(server, "v1/load_lora_adapter", {"lora_name": name, "lora_path": adapters["c"]})
            assert taken.status_code == 400, taken.text

        missing = os.path.join(os.path.dirname(adapters["c"]), "no-such-adapter")
        for path in (adapters["garbage"], missing):
            bad = post(server, "v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
            assert bad.status_code == 400, bad.text
            error = bad.json()["error"]
            assert error["param"] == "lora_path" and path in error["message"], error
            # A failed load leaves nothing behind: the name is free and not served.
            assert "bad" not in served_models(server)
            unknown = post(server, "v1/images/generations", {"prompt": "x", "size": "64x64", "model": "bad"})
            assert unknown.status_code == 404, unknown.text

        for route, body in (
            ("v1/load_lora_adapter", {"lora_name": "d", "lora_path": adapters["c"]}),
            ("v1/unload_lora_adapter", {"lora_name": "c"}),
        ):
            assert post(server, route, body, key=False).status_code == 401
        assert "d" not in served_models(server)  # the refused load did nothing
    finally:
        unloaded = post(server, "v1/unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200 and "c" in unloaded.text, unloaded.text
    assert "c" not in served_models(server)
    gone = post(server, "v1/images/generations", {"prompt": "x", "size": "64x64", "lora": {"name": "c"}})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora", gone.text
    twice = post(server, "v1/unload_lora_adapter", {"lora_name": "c"})
    assert twice.status_code == 404 and twice.json()["error"]["param"] == "lora_name", twice.text
    assert httpx.get(server.url_for("health"), timeout=TIMEOUT).status_code == 200


def _evictions_of_a(server) -> int:
    with open(server.log_path) as log:
        return log.read().count("Evicted LoRA adapter 'a'")


def test_evicted_adapters_reload_and_the_metrics_count_them(server, adapters):
    before = {name: lora_requests(server, name) for name in ("a", "b", "e", "base")}
    evictions = _evictions_of_a(server)
    loaded = post(server, "v1/load_lora_adapter", {"lora_name": "e", "lora_path": adapters["c"]})
    assert loaded.status_code == 200, loaded.text
    try:
        first = generate(server, 10, model="a")
        generate(server, 10, model="b")
        generate(server, 10, lora={"name": "e", "scale": 0.5})  # three adapters in turn: one was evicted
        assert 1 <= resident(server) <= 2
        generate(server, 10, model="b")
        generate(server, 10, model="e")  # a is the least recently used now: evicted
        assert 1 <= resident(server) <= 2
        again = generate(server, 10, lora=[{"name": "a"}])  # loaded again
        assert _evictions_of_a(server) > evictions  # so the equality below is after a reload
        assert_close(again, first)
        assert_close(again, stock(server.model, adapters, 10, a=1.0))
        generate(server, 10)
        generate(server, 10, lora=[{"name": "a", "scale": 0.3}, {"name": "e", "scale": 0.3}])  # counts each
    finally:
        assert post(server, "v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    after = {name: lora_requests(server, name) for name in before}
    assert {name: after[name] - before[name] for name in before} == {"a": 3, "b": 2, "e": 3, "base": 1}
    assert resident(server) <= 2


# Server 2: request mode, one resident adapter.


def test_request_mode_with_one_resident_adapter_serves_both(server, request_server, adapters):
    requests = [{"seed": 11, "model": "a"}, {"seed": 12, "model": "b"}, {"seed": 13, "lora": {"name": "a"}}]
    images = asyncio.run(generate_all(request_server, requests))
    for image, request in zip(images, requests, strict=True):
        assert_close(image, generate(server, request["seed"], model=request.get("model"), lora=request.get("lora")))
    assert_close(images[0], stock(server.model, adapters, 11, a=1.0))
    assert_close(images[1], stock(server.model, adapters, 12, b=1.0))
    assert resident(request_server) == 1
    # No runtime routes without VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    assert (
        post(request_server, "v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}).status_code == 404
    )


# Start-up failures.


@pytest.mark.parametrize("case", ["garbage", "rank above --max-lora-rank"])
def test_an_adapter_that_cannot_be_served_fails_start_up_naming_its_file(tiny_sd, adapters, tmp_path, case):
    if case == "garbage":
        path, args, words = adapters["garbage"], [], [adapters["garbage"]]
    else:
        # vLLM's flag takes 1, 8, 16...
        path, args, words = adapters["rank16"], ["--max-lora-rank", "8"], [adapters["rank16"], "--max-lora-rank 8"]
    log = tmp_path / "server.log"
    starting = RemoteOmniServer(tiny_sd, ["--lora-modules", f"bad={path}", *args], log_path=str(log))
    with pytest.raises(RuntimeError, match="exited with"), starting:
        pass
    assert starting.process.returncode not in (0, None)
    text = log.read_text()
    for word in words:
        assert word in text, text[-3000:]


# The runtime routes, in process (the app is built, its lifespan (the model load) never runs).


def _app(model: str, adapters: dict[str, str], api_keys: list[str]):
    from vllm_omni.config import resolve_stage_configs
    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.entrypoints.openai.app import build_app

    stages = resolve_stage_configs(global_knobs={"lora_modules": [f"a={adapters['a']}"]})
    serving = ServingConfig(host="127.0.0.1", port=0, served_model_names=["tiny"], api_keys=api_keys)
    return build_app(model, stages, serving, on_fatal=print)


@pytest.mark.parametrize("setting", [None, "0", "false", "yes"])
def test_without_the_env_var_the_runtime_routes_do_not_exist(tiny_sd, adapters, monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv(RUNTIME_ENV, raising=False)
    else:
        monkeypatch.setenv(RUNTIME_ENV, setting)
    client = TestClient(_app(tiny_sd, adapters, []))  # no `with`: the lifespan does not run
    for route, body in (
        ("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]}),
        ("/v1/unload_lora_adapter", {"lora_name": "a"}),
    ):
        assert client.post(route, json=body).status_code == 404


@pytest.mark.parametrize("setting", ["true", "1", "TRUE"])
def test_with_the_env_var_the_runtime_routes_exist(tiny_sd, adapters, monkeypatch, setting):
    monkeypatch.setenv(RUNTIME_ENV, setting)
    client = TestClient(_app(tiny_sd, adapters, []))
    body = {"lora_name": "c", "lora_path": adapters["c"]}
    loading = client.post("/v1/load_lora_adapter", json=body)
    assert loading.status_code == 503 and "loading" in loading.json()["error"]["message"], loading.text
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 503
    keyed = TestClient(_app(tiny_sd, adapters, [API_KEY]))
    assert keyed.post("/v1/load_lora_adapter", json=body).status_code == 401
    assert keyed.post("/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 503
