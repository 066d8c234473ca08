"""The memory and batch-budget knobs (max_batch_pixels, vae_tiling, vae_slicing, cpu_offload) through every layer,
in the start-up line, and the combinations refused at resolution naming each knob as written."""

import pytest

from vllm_omni import Omni
from vllm_omni.config import DeployConfig, StageDeployConfig, resolve_stage_configs
from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args

KNOBS = ("max_batch_pixels", "vae_tiling", "vae_slicing", "cpu_offload")


def _resolve(yaml=None, knobs=None, source="python", overrides=None) -> StageDeployConfig:
    deploy = DeployConfig(stages=[StageDeployConfig(**(yaml or {}), provenance={})])
    return resolve_stage_configs(deploy, global_knobs=knobs or {}, global_source=source, stage_overrides=overrides)[0]


def _serve(argv, tmp_path) -> StageDeployConfig:
    (tmp_path / "model_index.json").write_text("{}")
    parser = make_serve_parser("vllm serve")
    args, explicit = parse_serve_args(parser, [str(tmp_path), *argv])
    return build_serve_config(parser, args, explicit)[1][0]


def test_the_knobs_follow_the_precedence_of_every_knob_and_show_in_the_start_up_line():
    stage = _resolve(
        yaml={"max_num_seqs": 4, "max_batch_pixels": 65536, "vae_tiling": True, "cpu_offload": "model"},
        knobs={"vae_slicing": True, "max_batch_pixels": 131072},
        overrides={0: {"vae_tiling": False}},
    )
    assert {k: (getattr(stage, k), stage.provenance[k]) for k in KNOBS} == {
        "max_batch_pixels": (131072, "python"),
        "vae_tiling": (False, "stage_override"),
        "vae_slicing": (True, "python"),
        "cpu_offload": ("model", "deploy_yaml"),
    }
    line = stage.describe()
    assert "max_batch_pixels=131072 (python)" in line and "cpu_offload='model' (deploy_yaml)" in line
    assert "max_num_seqs=4 (deploy_yaml)" in line
    defaults = _resolve().describe()
    assert "max_batch_pixels=None (default)" in defaults and "vae_tiling=False (default)" in defaults


def test_cli_flags_set_them_with_cli_provenance_and_no_flag_keeps_the_yaml(tmp_path):
    flags = "--max-num-seqs 2 --max-batch-pixels 8192 --vae-tiling --no-vae-slicing --cpu-offload sequential"
    stage = _serve(flags.split(), tmp_path)
    assert (stage.max_batch_pixels, stage.vae_tiling, stage.vae_slicing, stage.cpu_offload) == (
        8192,
        True,
        False,
        "sequential",
    )
    assert {stage.provenance[k] for k in KNOBS} == {"cli"}
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    vae_tiling: true\n")
    stage = _serve(["--deploy-config", str(deploy)], tmp_path)
    assert (stage.vae_tiling, stage.provenance["vae_tiling"]) == (True, "deploy_yaml")
    assert (stage.vae_slicing, stage.provenance["vae_slicing"]) == (False, "default")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--cpu-offload", "all"],
            "argument --cpu-offload: invalid choice: 'all' (choose from 'none', 'model', 'sequential')",
        ),
        (["--max-batch-pixels", "0"], "--max-batch-pixels 0: Input should be greater than or equal to 1"),
        (
            ["--max-batch-pixels", "4096"],
            "stage 0: --max-batch-pixels 4096 (cli) limits batches of several requests, but max_num_seqs is 1 "
            "(default): a request is never split, so raise max_num_seqs or remove it",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_flag(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as excinfo:
        _serve(argv, tmp_path)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_offload_on_ray_replicas_without_a_gpu_is_refused_naming_both_knobs():
    with pytest.raises(ValueError) as excinfo:
        _resolve(yaml={"num_replicas": 2, "num_gpus": 0}, knobs={"cpu_offload": "model"})
    assert str(excinfo.value) == (
        "stage 0: cpu_offload= 'model' (python) moves weights to a GPU while they run, but num_gpus 0.0 "
        "(deploy_yaml) gives each replica none: give it a GPU or set cpu_offload to 'none'"
    )


def test_sequential_offload_with_devices_is_refused_naming_both_knobs():
    with pytest.raises(ValueError) as excinfo:
        _resolve(yaml={"devices": "0,1"}, overrides={"0": {"cpu_offload": "sequential"}})
    assert str(excinfo.value) == (
        "stage 0: cpu_offload 'sequential' (stage_override) runs every submodule on one GPU, so devices '0,1' "
        "(deploy_yaml) cannot place the stage: remove devices (the first visible GPU is used) or use cpu_offload "
        "'model'"
    )


@pytest.mark.slow
def test_cpu_offload_on_a_cpu_only_host_fails_at_start_up_naming_the_knob(tiny_flux):
    with pytest.raises(ValueError, match=r"cpu_offload='model' moves weights from CPU memory to a GPU while they run"):
        Omni(tiny_flux, cpu_offload="model")


def test_compile_knobs_take_the_cli_flags_and_apply_to_the_stages_that_denoise(tmp_path):
    stage = _serve(["--compile", "regional", "--compile-sizes", "1024x1024, 512x768x33"], tmp_path)
    assert (stage.compile, stage.compile_sizes) == ("regional", ("1024x1024", "512x768x33"))
    assert stage.provenance["compile"] == stage.provenance["compile_sizes"] == "cli"
    split = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode", compile="full"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    with pytest.raises(
        ValueError, match=r"^stage 0 \(encode\): compile \(deploy_yaml\) applies to diffusion and denoise"
    ):
        resolve_stage_configs(split)
    stages = resolve_stage_configs(
        DeployConfig(
            stages=[{**s.model_dump(exclude_unset=True, exclude={"compile", "provenance"})} for s in split.stages]
        ),
        global_knobs={"compile": "regional"},
    )
    assert [s.compile for s in stages] == ["none", "regional", "none"]  # the global keyword: stages that denoise


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"compile": "full", "compile_sizes": ["1024"]}, r"compile_sizes entries are WxH or WxHxF \(frames\)"),
        (
            {"compile_sizes": ["64x64"]},
            r"stage 0: compile_sizes= \['64x64'\] \(python\) are compiled at warm-up, but compile is 'none' "
            r"\(default\): set compile to 'regional' or 'full', or remove compile_sizes",
        ),
    ],
)
def test_bad_compile_knobs_are_refused_naming_them(knobs, message):
    with pytest.raises(ValueError, match=message):
        _resolve(knobs=knobs)
