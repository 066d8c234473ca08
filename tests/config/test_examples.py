"""The deploy YAMLs in examples/deploy/ load and resolve, and say what their README says they do."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni.config import load_deploy_config, resolve_stage_configs

EXAMPLES = Path(__file__).parents[2] / "examples" / "deploy"
YAMLS = sorted(EXAMPLES.glob("*.yaml"))


def _name(path: Path) -> str:
    return path.name


def test_examples_exist():
    names = {path.name for path in YAMLS}
    assert {
        "flux-single-stage.yaml",
        "flux-three-stage.yaml",
        "wan-single-stage.yaml",
        "wan-three-stage.yaml",
        "flux-prompt-enhancer.yaml",
    } <= names
    readme = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    for name in names:
        assert name in readme, f"examples/deploy/README.md does not document {name}"


@pytest.mark.parametrize("path", YAMLS, ids=_name)
def test_example_loads_and_resolves(path: Path):
    deploy = load_deploy_config(path)
    stages = resolve_stage_configs(deploy)
    assert [s.stage_id for s in stages] == [s.stage_id for s in deploy.stages]
    for written, stage in zip(deploy.stages, stages, strict=True):
        # Every knob the file sets is recorded as coming from it.
        for key in written.model_fields_set - {"stage_id", "stage_type", "inputs", "provenance"}:
            assert stage.provenance[key] == "deploy_yaml", (path.name, stage.stage_id, key)
        # The examples resolve on any machine: no device pinned (the devices lines are comments), and no Ray but for
        # llm stages, whose replicas are always Ray actors (no GPU reserved: num_gpus is a comment).
        if stage.stage_type == "llm":
            assert stage.distributed_executor_backend == "ray"
            assert stage.num_gpus is None and stage.python_executable is None
        else:
            assert stage.distributed_executor_backend == "inline"
            assert stage.devices is None


@pytest.mark.parametrize("path", [p for p in YAMLS if "three-stage" in p.name], ids=_name)
def test_three_stage_examples(path: Path):
    stages = resolve_stage_configs(path)
    assert [(s.stage_id, s.stage_type, s.inputs) for s in stages] == [
        (0, "encode", ()),
        (1, "denoise", (0,)),
        (2, "decode", (1,)),
    ]
    assert [s.max_num_seqs for s in stages] == [16, 4, 8]
    assert all(s.provenance["max_num_seqs"] == "deploy_yaml" for s in stages)
    # execution_mode belongs to the denoising stage only.
    assert stages[0].provenance["execution_mode"] == stages[2].provenance["execution_mode"] == "default"


@pytest.mark.parametrize("path", [p for p in YAMLS if "single-stage" in p.name], ids=_name)
def test_single_stage_examples(path: Path):
    stages = resolve_stage_configs(path)
    assert len(stages) == 1
    (stage,) = stages
    assert (stage.stage_id, stage.stage_type, stage.inputs) == (0, "diffusion", ())
    assert stage.provenance["max_num_seqs"] == "deploy_yaml"


def test_prompt_enhancer_example():
    stages = resolve_stage_configs(EXAMPLES / "flux-prompt-enhancer.yaml")
    assert [(s.stage_id, s.stage_type, s.inputs) for s in stages] == [(0, "llm", ()), (1, "diffusion", (0,))]
    llm, diffusion = stages
    assert (llm.max_num_seqs, diffusion.max_num_seqs) == (8, 4)
    assert all(s.provenance["max_num_seqs"] == "deploy_yaml" for s in stages)
    # The stage's max_num_seqs is vLLM's: engine_args holds vLLM's other settings only.
    assert "max_num_seqs" not in llm.engine_args
    assert llm.engine_args == {"gpu_memory_utilization": 0.2, "max_model_len": 2048}
    assert llm.sampling == {"temperature": 0.7, "max_tokens": 120}
    assert (llm.model, llm.mode) == ("Qwen/Qwen2.5-0.5B-Instruct", "chat")
    assert llm.system_prompt and llm.prompt_template is None


def test_stage_overrides_change_one_stage_of_an_example():
    stages = resolve_stage_configs(EXAMPLES / "flux-three-stage.yaml", stage_overrides={"1": {"max_num_seqs": 2}})
    assert [(s.max_num_seqs, s.provenance["max_num_seqs"]) for s in stages] == [
        (16, "deploy_yaml"),
        (2, "stage_override"),
        (8, "deploy_yaml"),
    ]


def test_global_execution_mode_reaches_only_the_denoise_stage():
    stages = resolve_stage_configs(
        EXAMPLES / "wan-three-stage.yaml", global_knobs={"execution_mode": "step"}, global_source="cli"
    )
    assert [(s.execution_mode, s.provenance["execution_mode"]) for s in stages] == [
        ("request", "default"),
        ("step", "cli"),
        ("request", "default"),
    ]
