"""The parallel knobs (cfg_parallel_size, ulysses_degree, ring_degree, vae_patch_parallel_size, tensor_parallel_size)
through every layer, and the combinations refused at resolution naming each knob as written: against the devices,
and against the model's folder (a denoiser without a _cp_plan, a head count the Ulysses degree does not divide, a
pipeline without classifier-free guidance)."""

import json

import pytest

from vllm_omni import Omni
from vllm_omni.config import DeployConfig, OmniDiffusionConfig, StageDeployConfig, resolve_stage_configs
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.parallel import world_size
from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args

KNOBS = ("cfg_parallel_size", "ulysses_degree", "ring_degree", "vae_patch_parallel_size", "tensor_parallel_size")


def _resolve(yaml=None, knobs=None, source="python", overrides=None, model=None) -> StageDeployConfig:
    deploy = DeployConfig(stages=[StageDeployConfig(**(yaml or {}), provenance={})])
    return resolve_stage_configs(
        deploy, global_knobs=knobs or {}, global_source=source, stage_overrides=overrides, model=model
    )[0]


def _folder(tmp_path, pipeline="FluxPipeline", denoisers=(("transformer", "FluxTransformer2DModel", 4),)):
    """A diffusers folder's configs only (no weights): what the resolver reads of a model."""
    index = {"_class_name": pipeline, "vae": ["diffusers", "AutoencoderKL"], "feature_extractor": [None, None]}
    for name, cls, heads in denoisers:
        index[name] = ["diffusers", cls]
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"_class_name": cls, "num_attention_heads": heads}))
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    return ModelSource(str(tmp_path))


def _serve(argv, tmp_path) -> StageDeployConfig:
    (tmp_path / "model_index.json").write_text("{}")
    parser = make_serve_parser("vllm serve")
    args, explicit = parse_serve_args(parser, [str(tmp_path), *argv])
    return build_serve_config(parser, args, explicit)[1][0]


def test_the_knobs_follow_the_precedence_of_every_knob_and_multiply_into_the_world_size():
    stage = _resolve(
        yaml={"ulysses_degree": 2, "ring_degree": 2},
        knobs={"cfg_parallel_size": 2, "ring_degree": 1},
        overrides={0: {"vae_patch_parallel_size": 2}},
    )
    assert {k: (getattr(stage, k), stage.provenance[k]) for k in KNOBS} == {
        "cfg_parallel_size": (2, "python"),
        "ulysses_degree": (2, "deploy_yaml"),
        "ring_degree": (1, "python"),
        "vae_patch_parallel_size": (2, "stage_override"),
        "tensor_parallel_size": (1, "default"),
    }
    assert world_size(stage.model_dump()) == 8
    line = stage.describe()
    assert "cfg_parallel_size=2 (python)" in line and "tensor_parallel_size=1 (default)" in line
    assert world_size(_resolve().model_dump()) == 1


def test_cli_flags_set_them_with_cli_provenance(tmp_path):
    argv = "--cfg-parallel-size 2 --ulysses-degree 2 --ring-degree 1 --vae-patch-parallel-size 2"
    stage = _serve([*argv.split(), "--tensor-parallel-size", "1"], tmp_path)
    assert {k: getattr(stage, k) for k in KNOBS} == dict(zip(KNOBS, (2, 2, 1, 2, 1), strict=True))
    assert {stage.provenance[k] for k in KNOBS} == {"cli"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cfg-parallel-size", "3"], "--cfg-parallel-size 3: Input should be less than or equal to 2"),
        (["--ulysses-degree", "0"], "--ulysses-degree 0: Input should be greater than or equal to 1"),
        (
            ["--tensor-parallel-size", "2"],
            "--tensor-parallel-size 2: Value error, tensor_parallel_size is accepted as 1 only: diffusion stages do "
            "not shard the denoiser's weights; split one request over devices with ulysses_degree, ring_degree or "
            "cfg_parallel_size",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_flag(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as excinfo:
        _serve(argv, tmp_path)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_they_apply_to_the_stages_that_run_what_they_split():
    split = [
        {"stage_id": 0, "stage_type": "encode"},
        {"stage_id": 1, "stage_type": "denoise", "inputs": [0]},
        {"stage_id": 2, "stage_type": "decode", "inputs": [1]},
    ]
    stages = resolve_stage_configs(
        DeployConfig(stages=split), global_knobs={"ulysses_degree": 2, "vae_patch_parallel_size": 2}
    )
    assert [(s.ulysses_degree, s.vae_patch_parallel_size) for s in stages] == [(1, 1), (2, 1), (1, 2)]
    with pytest.raises(ValueError, match=r"^stage 0 \(encode\): ring_degree \(deploy_yaml\) applies to diffusion and "):
        resolve_stage_configs(DeployConfig(stages=[{**split[0], "ring_degree": 2}, *split[1:]]))


def test_a_world_larger_than_the_devices_given_is_refused_naming_the_knobs():
    with pytest.raises(ValueError) as excinfo:
        _resolve(yaml={"devices": "0,1"}, knobs={"ulysses_degree": 2, "cfg_parallel_size": 2})
    assert str(excinfo.value) == (
        "stage 0: cfg_parallel_size= 2 (python) x ulysses_degree= 2 (python) make 4 ranks per replica, one device "
        "each, but devices '0,1' (deploy_yaml) gives 2: list 4 devices or lower the degrees"
    )
    assert _resolve(yaml={"devices": "0,1"}, knobs={"ulysses_degree": 2}).devices == "0,1"


def test_ray_replicas_reserving_fewer_gpus_than_ranks_are_refused():
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=r"make 2 ranks per replica, one GPU each, but num_gpus 1.0 \(deploy_yaml\)"):
        _resolve(yaml={"num_replicas": 2, "num_gpus": 1}, knobs={"ring_degree": 2})
    assert _resolve(yaml={"num_replicas": 2, "num_gpus": 0}, knobs={"ring_degree": 2}).ring_degree == 2


def test_sequence_parallel_is_checked_against_the_denoisers_of_the_model(tmp_path):
    stage = _resolve(knobs={"ulysses_degree": 2, "ring_degree": 2}, model=_folder(tmp_path))
    assert (stage.ulysses_degree, stage.ring_degree) == (2, 2)


def test_a_denoiser_without_a_cp_plan_is_refused_naming_the_knob_and_the_class(tmp_path):
    model = _folder(tmp_path, "StableDiffusion3Pipeline", (("transformer", "SD3Transformer2DModel", 2),))
    with pytest.raises(ValueError) as excinfo:
        _resolve(knobs={"ring_degree": 2}, source="cli", model=model)
    assert str(excinfo.value) == (
        "stage 0: --ring-degree 2 (cli) split the denoiser's sequence with diffusers' context parallelism, and "
        "SD3Transformer2DModel (transformer) declares no _cp_plan for it: set them to 1 for this model"
    )


def test_a_head_count_the_ulysses_degree_does_not_divide_is_refused(tmp_path):
    model = _folder(tmp_path, denoisers=(("transformer", "FluxTransformer2DModel", 6),))
    with pytest.raises(ValueError) as excinfo:
        _resolve(overrides={0: {"ulysses_degree": 4}}, model=model)
    assert str(excinfo.value) == (
        "stage 0: ulysses_degree 4 (stage_override) gives each rank a share of the attention heads, and "
        "FluxTransformer2DModel (transformer) has 6, which it does not divide: use a divisor of 6, or ring_degree"
    )
    assert _resolve(knobs={"ring_degree": 4}, model=model).ring_degree == 4


def test_every_denoiser_of_a_two_expert_model_is_checked(tmp_path):
    model = _folder(
        tmp_path,
        "WanPipeline",
        (("transformer", "WanTransformer3DModel", 4), ("transformer_2", "WanTransformer3DModel", 3)),
    )
    with pytest.raises(ValueError, match=r"WanTransformer3DModel \(transformer_2\) has 3, which it does not divide"):
        _resolve(knobs={"ulysses_degree": 2}, model=model)


def test_cfg_parallel_on_a_pipeline_without_classifier_free_guidance_is_refused(tmp_path):
    model = _folder(tmp_path, "Flux2Pipeline", (("transformer", "Flux2Transformer2DModel", 4),))
    with pytest.raises(ValueError) as excinfo:
        _resolve(knobs={"cfg_parallel_size": 2}, model=model)
    assert str(excinfo.value) == (
        "stage 0: cfg_parallel_size= 2 (python) runs the conditional and unconditional branches of classifier-free "
        "guidance on two ranks, and Flux2Pipeline has no classifier-free guidance (its call takes no negative "
        "prompt): set cfg_parallel_size to 1"
    )
    assert _resolve(knobs={"ulysses_degree": 2}, model=model).ulysses_degree == 2


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            {"execution_mode": "step"},
            "stage 0: --ulysses-degree 2 (cli) run one request on several ranks, and --execution-mode 'step' (cli) "
            "is not run there yet (the ranks run whole pipeline calls (request mode), not one step at a time): set "
            "execution_mode to 'request' or the degrees to 1",
        ),
        ({"enable_lora": True}, "(the ranks load no adapters)"),
        ({"cache_backend": "first_block"}, "(the ranks run no step cache)"),
        ({"vae_tiling": True}, "set vae_tiling to False or the degrees to 1"),
        ({"stage_type": "denoise"}, "which a split stage (stage_type 'denoise' (default)) does not do yet"),
    ],
)
def test_a_replica_of_several_ranks_refuses_when_it_starts_what_its_ranks_do_not_run(knobs, message):
    knobs = dict(knobs)
    stage_type = knobs.pop("stage_type", "diffusion")  # a stage of a split pipeline (not a knob)
    stage = _resolve(knobs={"ulysses_degree": 2, **knobs}, source="cli").model_copy(update={"stage_type": stage_type})
    with pytest.raises(ValueError) as excinfo:
        OmniDiffusionConfig.from_stage("/models/flux", stage)
    assert message in str(excinfo.value)
    assert str(excinfo.value).startswith("stage 0: --ulysses-degree 2 (cli) run one request on several ranks")
    assert OmniDiffusionConfig.from_stage("/models/flux", _resolve(knobs={"ulysses_degree": 2})).stage.ulysses_degree
    ray = {"ulysses_degree": 2, "distributed_executor_backend": "ray"}  # a Ray replica's ranks are its actor's
    assert OmniDiffusionConfig.from_stage("/models/flux", _resolve(knobs=ray)).stage.distributed_executor_backend


def test_omni_keywords_and_stage_overrides_reach_the_checks_before_anything_loads(tmp_path):
    model = _folder(tmp_path, denoisers=(("transformer", "FluxTransformer2DModel", 3),)).model
    with pytest.raises(ValueError, match=r"^stage 0: ulysses_degree= 2 \(python\) gives each rank a share of the"):
        Omni(model, ulysses_degree=2)
    with pytest.raises(ValueError, match=r"^stage 0: cfg_parallel_size 2 \(stage_override\) run one request on"):
        Omni(model, stage_overrides={0: {"cfg_parallel_size": 2, "execution_mode": "step"}})


def test_configs_resolved_without_the_folder_are_checked_against_it_before_any_weights_load(tmp_path):
    """A repo id or a single file has no folder while the knobs resolve; `Omni` checks the folder it loads."""
    folder = _folder(tmp_path, "StableDiffusion3Pipeline", (("transformer", "SD3Transformer2DModel", 2),)).model
    stage = _resolve(knobs={"ulysses_degree": 2}, source="cli")  # no model: nothing to check yet
    with pytest.raises(ValueError, match=r"^stage 0: --ulysses-degree 2 \(cli\) split .* SD3Transformer2DModel"):
        Omni.from_stage_configs(folder, [stage])  # the folder has no weights: refused before diffusers loads
