"""The stage graph of a deploy: stage types, ``inputs``, and every way a graph can be wrong."""

import re
import typing

import pytest

from vllm_omni.config import DeployConfig, StageDeployConfig, load_deploy_config, resolve_stage_configs
from vllm_omni.config.stage import StageType
from vllm_omni.config.stage_types import STAGE_TYPES, check_stage_graph

THREE_STAGES = """\
stages:
  - {stage_id: 0, stage_type: encode, max_num_seqs: 16}
  - {stage_id: 1, stage_type: denoise, inputs: [0], max_num_seqs: 4}
  - {stage_id: 2, stage_type: decode, inputs: [1], max_num_seqs: 8}
"""


def _stages(*specs: tuple) -> list[StageDeployConfig]:
    return [StageDeployConfig(stage_id=i, stage_type=t, inputs=inputs) for i, t, inputs in specs]


def test_the_stage_type_literal_is_the_tables_keys_in_order():
    assert typing.get_args(StageType) == tuple(STAGE_TYPES)


def test_a_three_stage_yaml_loads_in_request_order(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(THREE_STAGES)
    stages = resolve_stage_configs(path)
    got = [(s.stage_id, s.stage_type, s.inputs, s.max_num_seqs) for s in stages]
    assert got == [(0, "encode", (), 16), (1, "denoise", (0,), 4), (2, "decode", (1,), 8)]
    assert all(s.provenance["max_num_seqs"] == "deploy_yaml" for s in stages)


def test_the_request_order_follows_inputs_not_the_listing():
    listed = [
        StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        StageDeployConfig(stage_id=0, stage_type="encode"),
        StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
    ]
    assert [s.stage_id for s in check_stage_graph(listed)] == [0, 1, 2]


@pytest.mark.parametrize("first", ["diffusion", "encode"])
def test_an_llm_stage_writes_the_prompt_of_a_stage_that_takes_the_request(first):
    specs = [(0, first, [1]), (1, "llm", [])]
    if first == "encode":
        specs += [(2, "denoise", [0]), (3, "decode", [2])]
    order = [s.stage_id for s in check_stage_graph(_stages(*specs))]
    assert order[:2] == [1, 0]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (
            [(0, "encode", []), (1, "denoise", [5]), (2, "decode", [1])],
            "stage 1 lists unknown input(s) [5]; stage ids: [0, 1, 2]",
        ),
        (
            [(0, "encode", [2]), (1, "denoise", [0]), (2, "decode", [1])],
            "stage 0: inputs form a cycle (0 <- 2 <- 1 <- 0, where a <- b means stage a takes stage b's output)",
        ),
        (
            [(0, "diffusion", [0])],
            "stage 0: inputs form a cycle (0 <- 0, where a <- b means stage a takes stage b's output)",
        ),
        (
            [(0, "encode", []), (1, "decode", [0])],
            "stage 1 (decode) takes exactly one input, a stage of type 'denoise'; it lists ['0 (encode)']",
        ),
        (
            [(0, "encode", []), (1, "denoise", []), (2, "decode", [1])],
            "stage 1 (denoise) takes exactly one input, a stage of type 'encode'; it lists none",
        ),
        (
            [(0, "encode", []), (1, "encode", []), (2, "denoise", [0, 1]), (3, "decode", [2])],
            "stage 2 (denoise) takes exactly one input, a stage of type 'encode'; "
            "it lists ['0 (encode)', '1 (encode)']",
        ),
        (
            [(0, "encode", []), (1, "diffusion", [0])],
            "stage 1 (diffusion) takes the request itself, so it has no inputs (but an llm stage's prompt); "
            "it lists [0]",
        ),
        (
            [(0, "encode", []), (1, "llm", []), (2, "denoise", [0, 1]), (3, "decode", [2])],
            "stage 2 (denoise) lists llm stage(s) [1] as inputs; an llm stage's text is the prompt of one stage that "
            "takes the request itself (diffusion or encode), and such a stage takes at most one",
        ),
        (
            [(0, "llm", []), (1, "llm", []), (2, "diffusion", [0, 1])],
            "stage 2 (diffusion) lists llm stage(s) [0, 1] as inputs",
        ),
        (
            [(0, "llm", []), (1, "diffusion", [])],
            "the stages no other stage takes are: 0 (llm), 1 (diffusion)",
        ),
        (
            [(0, "encode", []), (1, "denoise", [0])],
            "a deploy needs exactly one final stage, a diffusion, decode or codec stage that no other stage takes as "
            "input; "
            "the stages no other stage takes are: 1 (denoise)",
        ),
        (
            [(0, "diffusion", []), (1, "diffusion", [])],
            "a deploy needs exactly one final stage, a diffusion, decode or codec stage that no other stage takes as "
            "input; "
            "the stages no other stage takes are: 0 (diffusion), 1 (diffusion)",
        ),
    ],
)
def test_every_graph_error_names_the_stage_and_the_problem(specs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DeployConfig(stages=_stages(*specs))


def test_a_graph_error_in_a_yaml_names_the_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(THREE_STAGES.replace("inputs: [1]", "inputs: [7]"))
    with pytest.raises(ValueError, match=re.escape(f"invalid stages in {path}: stage 2 lists unknown input(s) [7]")):
        load_deploy_config(path)


def test_execution_mode_applies_to_the_stages_that_denoise(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(THREE_STAGES)
    stages = resolve_stage_configs(path, global_knobs={"execution_mode": "step"}, global_source="cli")
    got = [(s.execution_mode, s.provenance["execution_mode"]) for s in stages]
    assert got == [("request", "default"), ("step", "cli"), ("request", "default")]
    assert "execution_mode" not in stages[0].describe() and "execution_mode='step' (cli)" in stages[1].describe()
    assert "stage 1 (denoise <- stage(s) 0)" in stages[1].describe()

    with pytest.raises(ValueError, match=r"stage 2 \(decode\): execution_mode \(stage_override\) applies to diffusion"):
        resolve_stage_configs(path, stage_overrides={2: {"execution_mode": "step"}})
    path.write_text(THREE_STAGES.replace("stage_type: encode,", "stage_type: encode, execution_mode: request,"))
    with pytest.raises(ValueError, match=r"stage 0 \(encode\): execution_mode \(deploy_yaml\) applies to diffusion"):
        resolve_stage_configs(path)


def test_stage_overrides_reach_one_stage_of_a_graph(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(THREE_STAGES)
    stages = resolve_stage_configs(path, global_knobs={"max_num_seqs": 3}, stage_overrides={"1": {"max_num_seqs": 2}})
    got = [(s.max_num_seqs, s.provenance["max_num_seqs"]) for s in stages]
    assert got == [(3, "python"), (2, "stage_override"), (3, "python")]


def test_inputs_and_stage_type_are_structure_not_knobs():
    with pytest.raises(ValueError, match=r"unknown stage knob\(s\) inputs"):
        resolve_stage_configs(stage_overrides={0: {"inputs": [1]}})
