"""Precedence of the four layers, with provenance, for every pair of layers."""

import itertools

import pytest

from vllm_omni.config import DeployConfig, StageDeployConfig, resolve_stage_configs

# Each layer as the resolver receives it; ``None`` means the layer does not set the knob.
LAYERS = ("default", "deploy_yaml", "python", "stage_override")


def _resolve(yaml_value=None, global_value=None, override_value=None, knob="max_num_seqs", global_source="python"):
    stage = StageDeployConfig(**({knob: yaml_value} if yaml_value is not None else {}), provenance={})
    return resolve_stage_configs(
        DeployConfig(stages=[stage]),
        global_knobs={knob: global_value} if global_value is not None else {},
        global_source=global_source,
        stage_overrides={0: {knob: override_value}} if override_value is not None else None,
    )[0]


VALUES = {"deploy_yaml": 2, "python": 3, "stage_override": 4}


@pytest.mark.parametrize("low,high", list(itertools.combinations(LAYERS, 2)))
def test_higher_layer_wins_for_every_pair(low, high):
    given = {layer: VALUES[layer] for layer in (low, high) if layer != "default"}
    stage = _resolve(given.get("deploy_yaml"), given.get("python"), given.get("stage_override"))
    expected = VALUES.get(high, 1)
    assert stage.max_num_seqs == expected
    assert stage.provenance["max_num_seqs"] == high


def test_default_is_one_for_a_diffusion_stage():
    stage = resolve_stage_configs()[0]
    assert (stage.stage_type, stage.max_num_seqs, stage.provenance["max_num_seqs"]) == ("diffusion", 1, "default")
    assert set(stage.provenance.values()) == {"default"}


def test_cli_source_is_recorded():
    stage = _resolve(yaml_value=2, global_value=6, global_source="cli")
    assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (6, "cli")


def test_every_knob_goes_through_the_same_layers():
    stage = _resolve(yaml_value=5.0, global_value=7.0, knob="request_batch_max_wait_ms")
    assert stage.request_batch_max_wait_ms == 7.0
    assert stage.provenance["request_batch_max_wait_ms"] == "python"
    assert stage.provenance["max_num_seqs"] == "default"


def test_layers_apply_per_stage():
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode", max_num_seqs=2),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    stages = resolve_stage_configs(deploy, stage_overrides={"1": {"max_num_seqs": 8}})
    got = [(s.max_num_seqs, s.provenance["max_num_seqs"]) for s in stages]
    assert got == [(2, "deploy_yaml"), (8, "stage_override"), (1, "default")]


@pytest.mark.parametrize("key", [0, "0"])
def test_stage_override_keys_may_be_int_or_str(key):
    stage = resolve_stage_configs(stage_overrides={key: {"max_num_seqs": 3}})[0]
    assert stage.max_num_seqs == 3


def test_legacy_alias_source_at_the_global_layer():
    stage = resolve_stage_configs(global_knobs={"max_num_seqs": 4}, global_alias_knobs={"max_num_seqs"})[0]
    assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (4, "legacy_alias")


def test_resolved_config_is_frozen():
    stage = resolve_stage_configs()[0]
    with pytest.raises(Exception, match="frozen"):
        stage.max_num_seqs = 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(global_knobs={"max_num_seqs": 0}, global_source="cli"),
            r"--max-num-seqs 0: .*greater than or equal to 1",
        ),
        (dict(global_knobs={"max_num_seqs": 0}), r"max_num_seqs= 0: .*greater than or equal to 1"),
        (dict(global_knobs={"dtype": "float8"}), r"dtype= 'float8'.*'auto', 'float32', 'float16' or 'bfloat16'"),
        (dict(stage_overrides={5: {"max_num_seqs": 2}}), r"stage 5, which does not exist; stage ids: \[0\]"),
        (dict(stage_overrides={"x": {"max_num_seqs": 2}}), r"key 'x' is not a stage id"),
        (dict(stage_overrides={True: {"max_num_seqs": 2}}), r"key True is not a stage id"),
        (dict(stage_overrides={0.5: {"max_num_seqs": 2}}), r"key 0.5 is not a stage id"),
        (
            dict(stage_overrides={0: {"max_seqs": 2}}),
            r"unknown stage knob\(s\) max_seqs in stage_overrides for stage 0",
        ),
        (dict(stage_overrides={0: {"stage_type": "llm"}}), r"unknown stage knob\(s\) stage_type"),
        (dict(stage_overrides={0: 4}), r"stage_overrides\[0\] must be a mapping"),
        (dict(stage_overrides={0: {"max_num_seqs": 1}, "0": {"max_num_seqs": 2}}), r"names stage 0 twice"),
    ],
)
def test_bad_values_name_the_knob_and_where_it_was_given(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_stage_configs(**kwargs)


def test_describe_lists_every_knob_with_its_source():
    stage = _resolve(yaml_value=2, global_value=4)
    line = stage.describe()
    assert line.startswith("stage 0 (diffusion): max_num_seqs=4 (python)")
    assert "request_batch_max_wait_ms=0.0 (default)" in line


@pytest.mark.parametrize("low,high", list(itertools.combinations(LAYERS, 2)))
def test_execution_mode_follows_the_same_precedence(low, high):
    modes = {"deploy_yaml": "step", "python": "request", "stage_override": "step"}
    given = {layer: modes[layer] for layer in (low, high) if layer != "default"}
    stage = _resolve(given.get("deploy_yaml"), given.get("python"), given.get("stage_override"), knob="execution_mode")
    assert (stage.execution_mode, stage.provenance["execution_mode"]) == (modes.get(high, "request"), high)


def test_an_admission_wait_applies_to_step_mode_too():
    yaml_step = DeployConfig(stages=[StageDeployConfig(execution_mode="step", provenance={})])
    stage = resolve_stage_configs(yaml_step, global_knobs={"request_batch_max_wait_ms": 20}, global_source="cli")[0]
    assert (stage.execution_mode, stage.request_batch_max_wait_ms) == ("step", 20)
    assert stage.provenance["request_batch_max_wait_ms"] == "cli"
