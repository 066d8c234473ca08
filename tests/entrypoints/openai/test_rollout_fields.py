"""Stochastic sampling over HTTP (docs/rl.md): the RL rollout fields of the Images and Videos APIs reach the
engine, ``logprobs`` answers each image (video) with its steps' log-probabilities, deterministically for a seed,
streamed or not; what cannot carry them, and values out of range, are 400s naming the field."""

import json

import httpx
import openai
import pytest

from vllm_omni.testing.processes.server import finished_video_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AUTH = {"Authorization": "Bearer sk-test"}  # the shared servers' key (conftest.py)
ROLLOUT = {"sde_type": "sde", "noise_level": 0.9, "sde_window_size": 2, "sde_window_range": [0, 3], "logprobs": True}
FAST = {"size": "32x32", "num_inference_steps": 3, "seed": 7}


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.url_for(*path.strip("/").split("/")), headers=AUTH, timeout=300, **kwargs)


def test_the_openai_client_gets_each_images_log_probs_the_same_for_a_seed(flux_server):
    client = openai.OpenAI(base_url=flux_server.url_for("v1"), api_key="sk-test")
    first, again = (
        client.images.generate(prompt="a cat", n=2, extra_body={**FAST, **ROLLOUT}, response_format="b64_json")
        for _ in range(2)
    )
    rows = [image.model_extra["log_probs"] for image in first.data]
    assert [len(row) for row in rows] == [2, 2] and rows[0] != rows[1]  # the window's steps, per image
    assert rows == [image.model_extra["log_probs"] for image in again.data]
    assert [image.b64_json for image in first.data] == [image.b64_json for image in again.data]
    plain = client.images.generate(prompt="a cat", extra_body=FAST)
    assert plain.data[0].model_extra.get("log_probs") is None
    stochastic = client.images.generate(prompt="a cat", extra_body={**FAST, "sde_type": "cps"})
    assert stochastic.data[0].b64_json != plain.data[0].b64_json  # sampled stochastically, without log-probs
    assert stochastic.data[0].model_extra.get("log_probs") is None


def test_a_streamed_image_completes_with_its_log_probs(flux_server):
    body = {"prompt": "a cat", "stream": True, **FAST, **ROLLOUT}
    with httpx.stream(
        "POST", flux_server.url_for("v1", "images", "generations"), headers=AUTH, json=body, timeout=300
    ) as response:
        events = [json.loads(line[len("data: ") :]) for line in response.iter_lines() if line.startswith("data: ")]
    whole = post(flux_server, "/v1/images/generations", json={"prompt": "a cat", **FAST, **ROLLOUT}).json()
    assert events[-1]["log_probs"] == whole["data"][0]["log_probs"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"sde_type": "ode"}, "sde_type"),
        ({"noise_level": -1}, "noise_level"),
        ({"sde_type": "cps", "noise_level": 2.0}, "noise_level"),
        ({"sde_window_range": [0, 2]}, "sde_window_range"),
        ({"sde_window_size": 5}, "sde_window_size"),
        ({"logprobs": True, "response_format": "file"}, "logprobs"),
    ],
)
def test_bad_rollout_fields_are_400s_naming_them(flux_server, fields, param):
    response = post(flux_server, "/v1/images/generations", json={"prompt": "a cat", **FAST, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].endswith(param)


def test_a_video_job_answers_with_its_log_probs_and_a_sync_video_refuses_them(wan_server):
    body = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 3, "seed": 2, **ROLLOUT}
    job = post(wan_server, "/v1/videos", json=body)
    assert job.status_code == 200, job.text
    video = finished_video_job(wan_server.base_url, job.json()["id"], AUTH)
    assert video["status"] == "completed" and len(video["log_probs"]) == 2
    refused = post(wan_server, "/v1/videos/sync", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
