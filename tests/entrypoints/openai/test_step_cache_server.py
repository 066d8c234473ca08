"""The step cache through the server: the openai client's ``extra_body: {"cache": false}`` opts a request out, and
``/metrics`` counts the skipped computations (``vllm_omni:cache_skipped_steps_total``)."""

import base64
import io

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from vllm_omni.testing.processes.server import in_process_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _skipped(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        if line.startswith("vllm_omni:cache_skipped_steps_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm_omni:cache_skipped_steps_total in /metrics")


def _image(client: OpenAI, **extra) -> np.ndarray:
    answer = client.images.generate(
        model="tiny", prompt="a red cube", size="64x64", extra_body={"num_inference_steps": 8, "seed": 5, **extra}
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), dtype=np.int16)


def test_a_request_opts_out_of_the_step_cache_and_metrics_count_skips(tiny_flux):
    with in_process_server(tiny_flux, cache_backend="first_block", cache_config={"threshold": 0.5}) as (_, base):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        start = _skipped(base)
        uncached = _image(client, cache=False)
        assert _skipped(base) == start
        cached = _image(client)
        assert _skipped(base) > start
        assert np.abs(_image(client, cache=False) - uncached).max() == 0
        bad = httpx.post(f"{base}/v1/images/generations", json={"prompt": "x", "cache": "sometimes"}, timeout=60)
    assert np.abs(cached - uncached).max() > 0
    assert bad.status_code == 400 and "cache" in bad.text
