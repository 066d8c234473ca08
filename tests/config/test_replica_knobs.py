"""The replica knobs: num_replicas, distributed_executor_backend and the Ray-only knobs, through every layer."""

import pytest

from vllm_omni.config import DeployConfig, StageDeployConfig, resolve_stage_configs
from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args


def _resolve(yaml=None, knobs=None, source="python", overrides=None) -> StageDeployConfig:
    deploy = DeployConfig(stages=[StageDeployConfig(**(yaml or {}), provenance={})])
    return resolve_stage_configs(deploy, global_knobs=knobs or {}, global_source=source, stage_overrides=overrides)[0]


@pytest.mark.parametrize(
    "knobs,backend",
    [({}, "inline"), ({"num_replicas": 2}, "ray"), ({"ray_address": "auto"}, "ray"), ({"num_replicas": 1}, "inline")],
)
def test_the_backend_defaults_to_ray_when_replicas_or_a_cluster_are_asked_for(knobs, backend):
    stage = _resolve(knobs=knobs)
    assert (stage.distributed_executor_backend, stage.provenance["distributed_executor_backend"]) == (
        backend,
        "default",
    )


def test_replica_knobs_follow_the_precedence_of_every_knob():
    stage = _resolve(
        yaml={"num_replicas": 4, "num_cpus": 2, "placement_strategy": "SPREAD"},
        knobs={"num_replicas": 3},
        overrides={"0": {"num_gpus": 0.5}},
    )
    assert (stage.num_replicas, stage.provenance["num_replicas"]) == (3, "python")
    assert (stage.num_cpus, stage.provenance["num_cpus"]) == (2, "deploy_yaml")
    assert (stage.num_gpus, stage.provenance["num_gpus"]) == (0.5, "stage_override")
    assert stage.placement_strategy == "SPREAD"


def test_the_start_up_line_states_the_total_capacity_and_hides_ray_knobs_for_inline():
    ray_stage = _resolve(knobs={"num_replicas": 2, "max_num_seqs": 4})
    assert ray_stage.capacity == 8
    line = ray_stage.describe()
    assert "num_replicas=2 (python)" in line and "num_cpus=1 (default)" in line
    assert line.endswith("capacity 8 requests at once (2 replica(s) x max_num_seqs 4)")
    inline_line = _resolve().describe()
    assert "num_cpus" not in inline_line and "ray_address" not in inline_line
    assert inline_line.endswith("capacity 1 requests at once (1 replica(s) x max_num_seqs 1)")


def test_several_replicas_inline_is_refused_naming_both_knobs():
    with pytest.raises(ValueError) as excinfo:
        _resolve(yaml={"distributed_executor_backend": "inline"}, knobs={"num_replicas": 2}, source="cli")
    assert str(excinfo.value) == (
        "stage 0: --num-replicas 2 (cli) needs Ray, but distributed_executor_backend is 'inline' (deploy_yaml): "
        "set distributed_executor_backend to 'ray' (or leave it unset), or num_replicas to 1"
    )


@pytest.mark.parametrize("knob,value", [("ray_address", "auto"), ("num_cpus", 2), ("placement_strategy", "SPREAD")])
def test_a_ray_knob_with_the_inline_backend_is_refused(knob, value):
    with pytest.raises(
        ValueError, match=rf"{knob}= {value!r} \(python\) applies to distributed_executor_backend 'ray' only"
    ):
        _resolve(knobs={knob: value, "distributed_executor_backend": "inline"})


def test_devices_with_ray_replicas_is_refused():
    with pytest.raises(
        ValueError, match=r"devices '0' \(deploy_yaml\) picks CUDA devices of this process.*leave devices unset"
    ):
        _resolve(yaml={"devices": "0"}, knobs={"num_replicas": 2})


@pytest.mark.parametrize(
    "knobs,problem",
    [
        ({"num_replicas": 0}, "num_replicas= 0: Input should be greater than or equal to 1"),
        ({"distributed_executor_backend": "mp"}, "distributed_executor_backend= 'mp': Input should be 'inline' or "),
        (
            {"placement_strategy": "spread"},
            "'spread': Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'",
        ),
        ({"num_cpus": 0}, "num_cpus= 0: Input should be greater than or equal to 1"),
    ],
)
def test_bad_values_name_the_knob_and_the_allowed_values(knobs, problem):
    with pytest.raises(ValueError, match="invalid value in the Omni arguments") as excinfo:
        _resolve(knobs=knobs)
    assert problem in str(excinfo.value)


def _serve(argv, tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    parser = make_serve_parser("vllm serve")
    args, explicit = parse_serve_args(parser, [str(tmp_path), *argv])
    return build_serve_config(parser, args, explicit)[1][0]


def test_cli_flags_set_every_replica_knob_with_cli_provenance(tmp_path):
    flags = (
        "--num-replicas 2 --distributed-executor-backend ray --ray-address 10.0.0.1:6379 --num-cpus 2 --num-gpus 0.5 "
        "--placement-strategy STRICT_SPREAD"
    )
    stage = _serve(flags.split(), tmp_path)
    assert (stage.num_replicas, stage.ray_address, stage.num_cpus, stage.num_gpus) == (2, "10.0.0.1:6379", 2, 0.5)
    assert (stage.distributed_executor_backend, stage.placement_strategy) == ("ray", "STRICT_SPREAD")
    knobs = (
        "num_replicas",
        "distributed_executor_backend",
        "ray_address",
        "num_cpus",
        "num_gpus",
        "placement_strategy",
    )
    assert {stage.provenance[k] for k in knobs} == {"cli"}


def test_a_backend_vllm_knows_but_omni_does_not_is_refused_naming_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        _serve(["--distributed-executor-backend", "mp"], tmp_path)
    assert excinfo.value.code == 2
    assert "--distributed-executor-backend 'mp': Input should be 'inline' or 'ray'" in capsys.readouterr().err


def test_num_gpus_of_an_inline_stage_is_its_device_count():
    """Upstream vllm-omni's per-stage device count: accepted where it equals the ranks (the product of the parallel
    degrees), refused naming both otherwise (docs/scaling.md)."""
    assert _resolve(knobs={"num_gpus": 1, "distributed_executor_backend": "inline"}).num_gpus == 1
    with pytest.raises(ValueError, match=r"num_gpus= 2 \(python\) is the replica's device count.*give num_gpus 1"):
        _resolve(knobs={"num_gpus": 2, "distributed_executor_backend": "inline"})
    with pytest.raises(ValueError, match=r"num_gpus= 0.5 \(python\) is the replica's device count"):
        _resolve(knobs={"num_gpus": 0.5})
