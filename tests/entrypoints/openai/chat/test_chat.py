"""``POST /v1/chat/completions`` on diffusion models, with bodies written as upstream vllm-omni's example clients
and curl scripts write them (a literal ``extra_body`` object, ``choices[0].message.content[0].image_url.url``) and
with the real `openai` client; the answer equals the Images (or Videos) API's for the same seed, because it is that
API underneath."""

import base64
import io

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni.testing.checks.edits import noise_image

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"  # the shared servers' (conftest.py)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAST = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 42}


@pytest.fixture
def server(flux_server):
    return flux_server


@pytest.fixture
def video_server(wan_server):
    return wan_server


def chat(server, body: dict) -> httpx.Response:
    return httpx.post(server.url_for("v1", "chat", "completions"), json=body, headers=AUTH, timeout=300)


def data_url_bytes(url: str, media_type: str) -> bytes:
    prefix = f"data:{media_type};base64,"
    assert url.startswith(prefix), url[:60]
    return base64.b64decode(url.removeprefix(prefix))


def images_api(server, **body) -> bytes:
    response = httpx.post(server.url_for("v1", "images", "generations"), json=body, headers=AUTH, timeout=300)
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


def counter(server, name: str, outcome: str) -> float:
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        if line.startswith(f'vllm_omni:{name}_total{{outcome="{outcome}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_upstreams_curl_body_answers_the_image_of_the_images_api(server):
    """run_curl_text_to_image.sh's body (smaller, and without its true_cfg_scale: test_ignored_fields), read as its
    ``jq -r '.choices[0].message.content[0].image_url.url'`` reads it."""
    completed = counter(server, "image_generation_requests", "completed")
    body = {"messages": [{"role": "user", "content": "a red fox"}], "extra_body": {**FAST, "num_outputs_per_prompt": 1}}
    response = chat(server, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    choice = answer["choices"][0]
    assert (choice["index"], choice["finish_reason"], choice["message"]["role"]) == (0, "stop", "assistant")
    assert answer["usage"]["prompt_tokens"] > 0 and answer["usage"]["completion_tokens"] > 0
    assert counter(server, "image_generation_requests", "completed") == completed + 1  # counted as the Images API's
    png = data_url_bytes(choice["message"]["content"][0]["image_url"]["url"], "image/png")
    assert png == images_api(server, prompt="a red fox", size="32x32", num_inference_steps=2, seed=42)


def test_the_openai_client_sends_the_parameters_at_the_top_level(server):
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)
    completion = client.chat.completions.create(
        model=server_model(server),
        messages=[{"role": "user", "content": [{"type": "text", "text": "a red"}, {"type": "text", "text": "fox"}]}],
        extra_body={**FAST, "n": 2},
    )
    parts = completion.choices[0].message.content
    assert [part["type"] for part in parts] == ["image_url", "image_url"]
    images = [data_url_bytes(part["image_url"]["url"], "image/png") for part in parts]
    assert images[0] == images_api(server, prompt="a red fox", size="32x32", num_inference_steps=2, seed=42, n=2)


def server_model(server) -> str:
    return httpx.get(server.url_for("v1", "models"), headers=AUTH, timeout=60).json()["data"][0]["id"]


def test_an_image_url_part_is_an_edit_of_that_image(server):
    """image_to_image/openai_chat_client.py's shape: a text part and a data-URL image part."""
    source = io.BytesIO()
    noise_image(4, size=32).save(source, format="PNG")
    data = base64.b64encode(source.getvalue()).decode()
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a blue square"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        ],
    }
    body = {"messages": [message], "extra_body": {"num_inference_steps": 2, "seed": 3, "strength": 0.8}}
    answer = chat(server, body)
    assert answer.status_code == 200, answer.text
    png = data_url_bytes(answer.json()["choices"][0]["message"]["content"][0]["image_url"]["url"], "image/png")
    edit = httpx.post(
        server.url_for("v1", "images", "edits"),
        files={"image": ("in.png", source.getvalue(), "image/png")},
        data={"prompt": "a blue square", "num_inference_steps": "2", "seed": "3", "strength": "0.8"},
        headers=AUTH,
        timeout=300,
    )
    assert png == base64.b64decode(edit.json()["data"][0]["b64_json"])


def test_output_format_gives_the_data_urls_media_type(server):
    body = {"messages": [{"role": "user", "content": "a fox"}], "extra_body": {**FAST, "output_format": "jpg"}}
    url = chat(server, body).json()["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert Image.open(io.BytesIO(data_url_bytes(url, "image/jpeg"))).format == "JPEG"


USER = [{"role": "user", "content": "a fox"}]
TEXT = {"type": "text", "text": "a fox"}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": USER, "max_tokens": 64, "temperature": 0.7}, "max_tokens", "generates no text"),
        ({"messages": [{"role": "system", "content": "be brief"}, *USER]}, "messages", "messages[0] has role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]}, "messages", "no text"),
        ({"messages": USER, "stream": True}, "stream", "answered whole"),
        ({"messages": USER, "seed": 1, "extra_body": {"seed": 2}}, "seed", "give it once"),
        ({"messages": USER, "extra_body": {"flow_shfit": 3}}, "flow_shfit", "Unrecognized"),
        ({"messages": USER, "extra_body": {"width": 32}}, "height", "needs height"),
        ({"messages": USER, "extra_body": {"size": "32x32", "width": 32, "height": 32}}, "width", "not both"),
        ({"messages": USER, "extra_body": {"n": 2, "num_outputs_per_prompt": 2}}, "n", "not both"),
        (
            {
                "messages": [
                    {"role": "user", "content": [TEXT, {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}
                ]
            },
            "messages",
            "fetches no URLs",
        ),
    ],
)
def test_refusals_name_the_field(server, body, param, words):
    invalid = counter(server, "image_generation_requests", "invalid")
    response = chat(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert counter(server, "image_generation_requests", "invalid") == invalid + 1


def test_the_api_key_and_a_wrong_model_are_checked_as_for_images(server):
    body = {"messages": USER, "extra_body": FAST}
    assert httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=60).status_code == 401
    wrong = chat(server, {**body, "model": "gpt-4o"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_a_video_model_answers_a_video_url_with_the_sync_routes_mp4(video_server):
    """run_curl_text_to_video.sh's shape: ``choices[0].message.content[0].video_url.url``."""
    params = {"height": 32, "width": 32, "num_frames": 5, "fps": 8, "num_inference_steps": 2, "seed": 9}
    body = {"messages": [{"role": "user", "content": "a cat running"}], "extra_body": params}
    response = chat(video_server, body)
    assert response.status_code == 200, response.text
    mp4 = data_url_bytes(response.json()["choices"][0]["message"]["content"][0]["video_url"]["url"], "video/mp4")
    sync = httpx.post(
        video_server.url_for("v1", "videos", "sync"),
        json={"prompt": "a cat running", **params},
        headers=AUTH,
        timeout=300,
    )
    with av.open(io.BytesIO(mp4)) as chatted, av.open(io.BytesIO(sync.content)) as synced:
        pairs = zip(chatted.decode(video=0), synced.decode(video=0), strict=True)
        diffs = [np.abs(a.to_ndarray().astype(int) - b.to_ndarray().astype(int)) for a, b in pairs]
    # The same frames: x264's output is not bit-reproducible on a loaded machine (the same frames
    # encoded twice decoded up to 10/255 apart, 1.2/255 on average), so compare on average; another seed is
    # 10.6/255 off.
    assert max(d.mean() for d in diffs) <= 3
