"""Requests as the clients people point at an OpenAI-compatible image server send them, rebuilt from each client's
own source (named in each test's docstring): their field names, multipart layout, headers, and how they read the
answer. One Flux server serves the names those clients hard-code (``--served-model-name tiny-flux dall-e-3 dall-e-2
gpt-image-1``) with a small ``--max-image-pixels``, so that OpenAI's sizes are made at the closest size within it,
and ``--quality-steps`` of at most 2 steps, so that requests without steps stay tiny; one Wan server serves
``sora-2``. Also here: every route takes every served name and an empty ``model`` (docs/serving.md, "Clients that
name OpenAI's models"), and ``max_sequence_length`` reaches the pipeline call."""

import base64
import io
import json
import secrets
import uuid

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from vllm_omni.testing.checks.edits import noise_image
from vllm_omni.testing.checks.stock import stock_pipeline
from vllm_omni.testing.processes.server import RemoteOmniServer, finished_video_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sk-clients"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLUX_NAMES = ["tiny-flux", "dall-e-3", "dall-e-2", "gpt-image-1"]
WAN_NAMES = ["tiny-wan", "sora-2"]
MAX_PIXELS = 128 * 128
"""OpenAI's sizes are made within it (the tiny Flux's own default, 256x256, is over it)."""
TIMEOUT = 300
VIDEO = {"size": "16x16", "num_frames": 1, "num_inference_steps": 2, "fps": 8, "seed": 3}


@pytest.fixture(scope="module")
def flux(tiny_flux):
    args = [
        *("--api-key", KEY, "--served-model-name", *FLUX_NAMES, "--max-image-pixels", str(MAX_PIXELS)),
        *("--quality-steps", "low=1,medium=2,high=2", "--uvicorn-log-level", "warning"),
    ]
    with RemoteOmniServer(tiny_flux, args) as server:
        server.model = tiny_flux
        yield server
    assert server.returncode == 0


@pytest.fixture(scope="module")
def wan(tiny_wan):
    args = ["--api-key", KEY, "--served-model-name", *WAN_NAMES, "--uvicorn-log-level", "warning"]
    with RemoteOmniServer(tiny_wan, args) as server:
        yield server
    assert server.returncode == 0


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def multipart(parts: list[tuple[str, str | tuple]]) -> tuple[bytes, str]:
    """A multipart/form-data body with its parts in the order given, as Node's ``form-data`` and aiohttp's
    ``FormData`` write them (httpx always puts text fields first): a value is the text, ``(text, media type)`` for a
    text part with a Content-Type, or ``(filename, bytes, media type)`` for a file. Returns the body and its
    Content-Type."""
    boundary = secrets.token_hex(16)
    chunks = []
    for name, value in parts:
        disposition = f'Content-Disposition: form-data; name="{name}"'
        if isinstance(value, str):
            head, data = f"{disposition}\r\n", value.encode()
        elif len(value) == 2:
            head, data = f"{disposition}\r\nContent-Type: {value[1]}\r\n", value[0].encode()
        else:
            filename, data, media_type = value
            head = f'{disposition}; filename="{filename}"\r\nContent-Type: {media_type}\r\n'
        chunks.append(f"--{boundary}\r\n{head}\r\n".encode() + data + b"\r\n")
    chunks.append(f"--{boundary}--\r\n".encode())
    return b"".join(chunks), f"multipart/form-data; boundary={boundary}"


def post(server, path: str, **kwargs) -> httpx.Response:
    kwargs["headers"] = {**AUTH, **kwargs.get("headers", {})}
    return httpx.post(server.url_for(*path.split("/")), timeout=TIMEOUT, **kwargs)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=KEY, max_retries=0)


# Open WebUI


def test_open_webui_generation(flux):
    """open-webui/open-webui, backend/open_webui/routers/images.py (``image_generations``, engine ``openai``): aiohttp
    posts JSON with ``Authorization: Bearer`` and ``Content-Type``; ``model`` is ``dall-e-2`` while no image model is
    configured (``get_image_model``), ``size`` its ``IMAGE_SIZE`` (512x512), and ``response_format: b64_json``
    unless the model matches ``^gpt-image``. It reads each entry's ``url``, else decodes ``b64_json``. Before: 404
    without the served names; with them, 512x512 is over this server's ``--max-image-pixels``."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = {"model": "dall-e-2", "prompt": "a fox", "n": 1, "size": "512x512", "response_format": "b64_json"}
    answer = ok(httpx.post(flux.url_for("v1", "images", "generations"), content=json.dumps(body), headers=headers))
    [image] = answer["data"]
    assert image.get("url") is None
    assert decode(base64.b64decode(image["b64_json"])).size == (128, 128) and answer["size"] == "128x128"


def test_open_webui_edit_sends_an_empty_model(flux):
    """open-webui/open-webui, backend/open_webui/routers/images.py (``image_edits``, engine ``openai``): ``model`` is
    ``IMAGE_EDIT_MODEL``, an empty string until one is configured; an ``aiohttp.FormData`` of the text fields
    (``text/plain`` parts: ``model``, ``prompt``, ``response_format``), then the image as ``image`` (``image[]`` for
    several) named ``<uuid>.png``; ``Authorization: Bearer``. It reads ``url``, else ``b64_json``. Before: 404
    ``model ''`` whatever the served names."""
    text = "text/plain; charset=utf-8"
    body, content_type = multipart(
        [
            ("model", ("", text)),
            ("prompt", ("a red door", text)),
            ("response_format", ("b64_json", text)),
            ("image", (f"{uuid.uuid4()}.png", png(noise_image(0)), "image/png")),
        ]
    )
    answer = ok(post(flux, "v1/images/edits", content=body, headers={"Content-Type": content_type}))
    assert decode(base64.b64decode(answer["data"][0]["b64_json"])).size == (64, 64)


# LiteLLM (hosted_vllm/)


def test_litellm_hosted_vllm_generation(flux):
    """BerriAI/litellm, litellm/llms/openai/openai.py (``OpenAIChatCompletion.image_generation``, which
    ``litellm.image_generation`` uses for ``hosted_vllm/`` models): openai-python's ``images.generate`` with the
    model name after ``hosted_vllm/`` and the optional params given; the answer becomes an ``ImageResponse`` from
    ``model_dump()``. Worked before."""
    response = client(flux).images.generate(model="tiny-flux", prompt="a fox", n=1, size="32x32")
    assert decode(base64.b64decode(response.model_dump()["data"][0]["b64_json"])).size == (32, 32)


def test_litellm_hosted_vllm_edit(flux):
    """BerriAI/litellm, litellm/llms/hosted_vllm/image_edit/transformation.py (``HostedVLLMImageEditConfig``: OpenAI's
    edit params without ``mask``, ``quality``, ``input_fidelity``) on litellm/llms/openai/image_edit/transformation.py
    (``transform_image_edit_request``: each image as ``image[]``, named ``image.png`` unless it is a file, the other
    fields as form data), posted by httpx with ``Authorization: Bearer``; the JSON becomes an ``ImageResponse``.
    Worked before."""
    data = {"model": "tiny-flux", "prompt": "a red door", "n": "1", "size": "32x32", "response_format": "b64_json"}
    files = [("image[]", ("image.png", png(noise_image(1)), "image/png"))]
    answer = ok(post(flux, "v1/images/edits", data=data, files=files))
    assert decode(base64.b64decode(answer["data"][0]["b64_json"])).size == (32, 32)


def test_litellm_hosted_vllm_video(wan):
    """BerriAI/litellm, litellm/llms/hosted_vllm/videos/transformation.py (``HostedVLLMVideoConfig``, written for
    vllm-omni's /v1/videos): form fields ``model``, ``prompt`` and each optional param as text (vllm-omni's
    ``num_frames``, ``num_inference_steps``, ``fps``, ``seed``), ``Authorization: Bearer``; then OpenAI's video
    routes (retrieve, content). Worked before with the model's own name."""
    data = {"model": "sora-2", "prompt": "a cat running", **{name: str(value) for name, value in VIDEO.items()}}
    job = ok(post(wan, "v1/videos", data=data, files=[]))
    assert job["model"] == "sora-2"
    assert finished_video_job(wan.base_url, job["id"], AUTH)["status"] == "completed"
    content = httpx.get(wan.url_for("v1", "videos", job["id"], "content"), headers=AUTH, timeout=TIMEOUT)
    assert content.headers["content-type"] == "video/mp4" and content.content


# LangChain


@pytest.mark.parametrize("model", ["dall-e-2", "dall-e-3"])
def test_langchain_dalle_wrapper_reads_urls(flux, model):
    """langchain-ai/langchain, libs/community/langchain_community/utilities/dalle_image_generator.py
    (``DallEAPIWrapper.run``): openai-python's ``images.generate(prompt, n=1, size="1024x1024", model=...)``, with
    ``quality="standard"`` unless the model is ``dall-e-2``, and no ``response_format``; it returns
    ``"\\n".join(item.url for item in response.data)``. Before: a ``b64_json`` answer, so ``item.url`` was ``None``
    (a TypeError, or "No image was generated"), and 1024x1024 was over ``--max-image-pixels``."""
    params = {"prompt": "a fox", "n": 1, "size": "1024x1024", "model": model}
    if model != "dall-e-2":
        params["quality"] = "standard"
    response = client(flux).images.generate(**params)
    urls = "\n".join(item.url for item in response.data)
    assert urls and response.size == "128x128" and response.quality == "medium"
    fetched = httpx.get(urls, headers=AUTH, timeout=TIMEOUT)
    assert fetched.headers["content-type"] == "image/png" and decode(fetched.content).size == (128, 128)


# LibreChat


def test_librechat_dalle3_tool(flux):
    """danny-avila/LibreChat, api/app/clients/tools/structured/DALLE3.js (``DALLE3._call``): openai-node's
    ``images.generate({model: 'dall-e-3', quality, style, size, prompt, n: 1})`` with the tool's defaults
    (``standard``, ``vivid``, ``1024x1024``); it reads ``resp.data[0].url`` ("No image URL returned" without one) and
    downloads it with ``processFileURL``, which sends no API key: on a server with ``--api-key`` that download is a
    401 (docs/serving.md: such a client needs a server without a key). Before: no ``url`` (a ``b64_json`` answer)."""
    body = {
        "model": "dall-e-3",
        "quality": "standard",
        "style": "vivid",
        "size": "1024x1024",
        "prompt": "a fox",
        "n": 1,
    }
    answer = ok(post(flux, "v1/images/generations", json=body))
    url = answer["data"][0]["url"]
    assert answer["size"] == "128x128"
    assert httpx.get(url, timeout=TIMEOUT).status_code == 401  # LibreChat's download, without a key
    assert decode(httpx.get(url, headers=AUTH, timeout=TIMEOUT).content).size == (128, 128)


def test_librechat_gpt_image_tools(flux):
    """danny-avila/LibreChat, api/app/clients/tools/structured/OpenAIImageTools.js: ``image_gen_oai`` calls
    openai-node's ``images.generate({model: 'gpt-image-1', prompt, n, background: 'auto', output_format: 'png',
    quality: 'auto', size})`` (``output_compression`` only for webp and jpeg; ``size`` as the agent picks it from the
    tool's schema, ``auto`` or one of OpenAI's sizes: here ``1024x1024``) and reads only
    ``resp.data[0].b64_json``; ``image_edit_oai`` posts a ``form-data`` of ``model``, ``prompt``, ``quality``,
    ``size``, then each image as ``image[]``, with ``Authorization: Bearer``, and reads ``data[0].b64_json``.
    Before: 404 without the served names; with them, it worked."""
    body = {"model": "gpt-image-1", "prompt": "a fox", "n": 1, "background": "auto", "output_format": "png"}
    generated = ok(post(flux, "v1/images/generations", json=body | {"quality": "auto", "size": "1024x1024"}))
    assert decode(base64.b64decode(generated["data"][0]["b64_json"])).size == (128, 128)
    form, content_type = multipart(
        [
            ("model", "gpt-image-1"),
            ("prompt", "a red door"),
            ("quality", "auto"),
            ("size", "auto"),
            ("image[]", ("img-1.png", png(noise_image(2)), "image/png")),
        ]
    )
    edited = ok(post(flux, "v1/images/edits", content=form, headers={"Content-Type": content_type}))
    assert decode(base64.b64decode(edited["data"][0]["b64_json"])).size == (64, 64)


# n8n

N8N_HEADERS = {"Authorization": f"Bearer {KEY}", "OpenAI-Organization": ""}
"""n8n-io/n8n, packages/nodes-base/credentials/OpenAiApi.credentials.ts: ``authenticate`` sends
``OpenAI-Organization: {{$credentials.organizationId}}``, empty unless the credential sets one."""


def test_n8n_generate(flux):
    """n8n-io/n8n, packages/@n8n/nodes-langchain/nodes/vendors/OpenAi/v2/actions/image/generate.operation.ts: the
    body ``{prompt, model, response_format: 'b64_json', ...options}`` (model ``dall-e-3`` by default; here with the
    node's Resolution option, ``1024x1024``), the credential's headers (an empty ``OpenAI-Organization``); it makes
    a binary of each ``data[].b64_json``. Before: 404 without the served names; with them, 1024x1024 was over
    ``--max-image-pixels``."""
    body = {"prompt": "a fox", "model": "dall-e-3", "response_format": "b64_json", "size": "1024x1024"}
    answer = ok(post(flux, "v1/images/generations", json=body, headers=N8N_HEADERS))
    assert [decode(base64.b64decode(entry["b64_json"])).size for entry in answer["data"]] == [(128, 128)]


def test_n8n_edit(flux):
    """n8n-io/n8n, packages/@n8n/nodes-langchain/nodes/vendors/OpenAi/v2/actions/image/edit.operation.ts: a
    ``form-data`` with the image first (``image[]`` for ``gpt-image-1``, the default model), then ``prompt``,
    ``model``, ``n``, ``size`` (``1024x1024`` by default) and ``quality`` (``auto``); the credential's headers (an
    empty ``OpenAI-Organization``); ``b64_json`` by default for ``gpt-image-1``, read into binaries. Before: 404
    without the served names; with them, 1024x1024 was over ``--max-image-pixels``."""
    form, content_type = multipart(
        [
            ("image[]", ("data.png", png(noise_image(3)), "image/png")),
            ("prompt", "a red door"),
            ("model", "gpt-image-1"),
            ("n", "1"),
            ("size", "1024x1024"),
            ("quality", "auto"),
        ]
    )
    answer = ok(post(flux, "v1/images/edits", content=form, headers={**N8N_HEADERS, "Content-Type": content_type}))
    assert answer["size"] == "128x128"
    assert [decode(base64.b64decode(entry["b64_json"])).size for entry in answer["data"]] == [(128, 128)]


# openai-python


def test_openai_python_generation_and_edit(flux):
    """openai/openai-python, src/openai/resources/images.py: ``images.generate`` posts JSON; ``images.edit`` a
    multipart form of the fields, then ``image`` (one file) or ``image[]`` (a list), and ``mask``."""
    openai_client = client(flux)
    generated = openai_client.images.generate(model="gpt-image-1", prompt="a fox", size="1536x1024", quality="low")
    assert generated.size == "152x104" and generated.quality == "low"
    assert decode(base64.b64decode(generated.data[0].b64_json)).size == (152, 104)
    for image in (("in.png", png(noise_image(4)), "image/png"), [("in.png", png(noise_image(4)), "image/png")]):
        edited = openai_client.images.edit(model="dall-e-2", image=image, prompt="a red door", size="256x256")
        assert edited.size == "128x128" and edited.data[0].url is not None


def test_openai_python_streaming(flux):
    """openai/openai-python, src/openai/resources/images.py (``images.generate(stream=True)``): server-sent events,
    ``image_generation.partial_image`` then ``image_generation.completed``; a stream's images are ``b64_json``
    whatever the model's default."""
    stream = client(flux).images.generate(
        model="dall-e-3", prompt="a lighthouse", size="1024x1024", stream=True, partial_images=1
    )
    events = list(stream)
    assert [event.type for event in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert events[-1].size == "128x128"
    assert decode(base64.b64decode(events[-1].b64_json)).size == (128, 128)


def test_openai_python_videos(wan):
    """openai/openai-python, src/openai/resources/videos.py: ``videos.create`` posts a multipart form (``seconds``
    as text, ``extra_body`` fields among them), ``retrieve``, ``download_content``."""
    openai_client = client(wan)
    video = openai_client.videos.create(
        model="sora-2", prompt="a red car", seconds="1", size="32x32", extra_body={"num_inference_steps": 2, "fps": 8}
    )
    assert video.model == "sora-2"
    assert finished_video_job(wan.base_url, video.id, AUTH)["status"] == "completed"
    assert openai_client.videos.retrieve(video.id).status == "completed"
    assert len(openai_client.videos.download_content(video.id).read()) > 0


# Upstream vllm-omni's example scripts


def test_upstream_text_to_image_client(flux):
    """vllm-project/vllm-omni, examples/online_serving/text_to_image/openai_chat_client.py (``generate_image``):
    ``requests.post`` of ``{prompt, response_format: "b64_json", n, size: "WxH", num_inference_steps, seed}`` with
    ``Content-Type: application/json`` only (this server has a key: the test adds it); it decodes
    ``data[0].b64_json``."""
    body = {"prompt": "a cup of coffee", "response_format": "b64_json", "n": 1, "size": "32x32"}
    answer = ok(post(flux, "v1/images/generations", json=body | {"num_inference_steps": 2, "seed": 42}))
    assert decode(base64.b64decode(answer["data"][0]["b64_json"])).size == (32, 32)


def test_upstream_image_to_image_client(flux):
    """vllm-project/vllm-omni, examples/online_serving/image_to_image/openai_chat_client.py (``edit_image``): a chat
    request of one user message, a text part and a data-URL ``image_url`` part, and a literal ``extra_body`` of
    ``height``, ``width``, ``num_inference_steps``, ``guidance_scale`` (7.5 by default) and ``seed``; it decodes the
    data URL of ``choices[0].message.content[0].image_url.url``."""
    data_url = "data:image/png;base64," + base64.b64encode(png(noise_image(5))).decode()
    content = [{"type": "text", "text": "Convert to watercolor"}, {"type": "image_url", "image_url": {"url": data_url}}]
    extra_body = {"height": 32, "width": 32, "num_inference_steps": 2, "guidance_scale": 7.5, "seed": 0}
    body = {"messages": [{"role": "user", "content": content}], "extra_body": extra_body}
    answer = ok(post(flux, "v1/chat/completions", json=body))
    url = answer["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image") and decode(base64.b64decode(url.split(",", 1)[1])).size == (32, 32)


def test_upstream_true_cfg_scale_without_a_negative_prompt_is_accepted_with_a_warning(flux):
    """vllm-project/vllm-omni, examples/online_serving/text_to_image/openai_chat_client.py with ``--cfg-scale 4``:
    ``true_cfg_scale`` without a ``negative_prompt``, which does nothing on Flux: answered 200, with a ``Warning``
    header naming the field."""
    body = {"prompt": "a cup of coffee", "response_format": "b64_json", "n": 1, "size": "32x32", "true_cfg_scale": 4.0}
    response = post(flux, "v1/images/generations", json=body | {"num_inference_steps": 2, "seed": 42})
    assert response.status_code == 200, response.text
    assert "true_cfg_scale" in response.headers.get("warning", "")


# Every route takes every served name, and an empty model


def _model(name: str | None) -> dict:
    return {} if name is None else {"model": name}


@pytest.mark.parametrize("name", [*FLUX_NAMES, "", None])
def test_generations_and_edits_take_every_served_name(flux, name):
    body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2, "response_format": "b64_json"}
    ok(post(flux, "v1/images/generations", json=body | _model(name)))
    files = [("image", ("in.png", png(noise_image(6)), "image/png"))]
    data = {"prompt": "a red door", "size": "32x32", "num_inference_steps": "2", "response_format": "b64_json"}
    ok(post(flux, "v1/images/edits", data=data | _model(name), files=files))


@pytest.mark.parametrize("name", [*FLUX_NAMES, "", None])
def test_image_chat_takes_every_served_name(flux, name):
    body = {"messages": [{"role": "user", "content": "a fox"}], "height": 32, "width": 32, "num_inference_steps": 2}
    answer = ok(post(flux, "v1/chat/completions", json=body | _model(name)))
    assert answer["model"] == (name or "tiny-flux")
    assert answer["choices"][0]["message"]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.parametrize("name", [*WAN_NAMES, "", None])
def test_video_routes_take_every_served_name(wan, name):
    body = {"prompt": "a cat", **VIDEO} | _model(name)
    job = ok(post(wan, "v1/videos", json=body))
    assert job["model"] == (name or "tiny-wan")
    form = ok(post(wan, "v1/videos", data={k: str(v) for k, v in body.items()}, files=[]))
    for video_id in (job["id"], form["id"]):
        assert finished_video_job(wan.base_url, video_id, AUTH)["status"] == "completed"
    sync = post(wan, "v1/videos/sync", json=body)
    assert sync.status_code == 200 and sync.headers["content-type"] == "video/mp4"
    chat = {"messages": [{"role": "user", "content": "a cat"}], "extra_body": {"height": 32, "width": 32, **VIDEO}}
    del chat["extra_body"]["size"]
    answer = ok(post(wan, "v1/chat/completions", json=chat | _model(name)))
    assert answer["choices"][0]["message"]["content"][0]["type"] == "video_url"


def test_an_unknown_name_is_still_404(flux, wan):
    for server, path in ((flux, "v1/images/generations"), (wan, "v1/videos")):
        assert error(post(server, path, json={"prompt": "x", "model": "dall-e-4"}), 404)["param"] == "model"


# OpenAI's defaults for its own model names


@pytest.mark.parametrize(
    ("model", "size", "made"),
    [
        ("dall-e-2", "256x256", "128x128"),
        ("dall-e-2", "1024x1024", "128x128"),
        ("dall-e-3", "1792x1024", "168x96"),
        ("dall-e-3", "1024x1792", "96x168"),
        ("gpt-image-1", "1024x1536", "104x152"),
    ],
)
def test_openai_sizes_are_made_at_the_closest_size_within_the_limit(flux, model, size, made):
    answer = ok(post(flux, "v1/images/generations", json={"prompt": "a fox", "model": model, "size": size}))
    assert answer["size"] == made
    dall_e = model.startswith("dall-e")
    assert set(answer["data"][0]) == {"url" if dall_e else "b64_json", "revised_prompt"}
    assert answer["quality"] == ("medium" if dall_e else "high")  # standard, auto


def test_what_the_request_sets_wins_over_the_models_defaults(flux):
    body = {"prompt": "a fox", "model": "dall-e-3", "response_format": "b64_json", "quality": "hd", "size": "64x48"}
    answer = ok(post(flux, "v1/images/generations", json=body))
    assert "b64_json" in answer["data"][0] and answer["quality"] == "high"
    assert answer["size"] == "64x48"  # not one of DALL·E 3's sizes: as given
    # Any other name keeps this server's defaults, and OpenAI's sizes are not its own.
    refused = error(post(flux, "v1/images/generations", json={"prompt": "a fox", "size": "1024x1024"}))
    assert refused["param"] == "size"


# max_sequence_length


def test_max_sequence_length_reaches_the_pipeline_call(flux):
    """The image of a request with a short ``max_sequence_length`` is the stock pipeline's called with it (and not
    the image of the pipeline's default 512 tokens)."""
    body = {"prompt": "a lighthouse at dusk", "size": "32x32", "num_inference_steps": 2, "seed": 5}

    def image(**extra) -> np.ndarray:
        answer = ok(post(flux, "v1/images/generations", json=body | extra))
        return np.asarray(decode(base64.b64decode(answer["data"][0]["b64_json"])), dtype=np.float32) / 255

    short = image(max_sequence_length=8)
    stock = stock_pipeline(flux.model)(
        body["prompt"],
        height=32,
        width=32,
        num_inference_steps=2,
        max_sequence_length=8,
        generator=torch.Generator("cpu").manual_seed(5),
        output_type="np",
    ).images[0]
    assert np.abs(short - stock).max() <= 2 / 255 + 1e-6
    assert np.abs(short - image()).max() > 2 / 255


def test_max_sequence_length_is_checked_against_the_text_encoder(flux, wan):
    images = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2, "max_sequence_length": 513}
    for server, path, body in (
        (flux, "v1/images/generations", images),
        (flux, "v1/chat/completions", {"messages": [{"role": "user", "content": "a fox"}], "max_sequence_length": 513}),
        (wan, "v1/videos", {"prompt": "a cat", **VIDEO, "max_sequence_length": 513}),
    ):
        refused = error(post(server, path, json=body))
        assert refused["param"] == "max_sequence_length" and "512" in refused["message"], refused
    assert error(post(flux, "v1/images/generations", json=images | {"max_sequence_length": 0}))["param"] == (
        "max_sequence_length"
    )
    job = ok(post(wan, "v1/videos", json={"prompt": "a cat", **VIDEO, "max_sequence_length": 16}))
    assert finished_video_job(wan.base_url, job["id"], AUTH)["status"] == "completed"
