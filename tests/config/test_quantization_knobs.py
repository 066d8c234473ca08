"""The quantization knobs through the one resolver: every layer with its provenance, the start-up line and
``stage_knob_info``'s knobs; ``gguf`` set by a ``.gguf`` model (provenance ``model``) and refused otherwise; every
refusal naming the knob as it was written."""

import pytest

from vllm_omni.config import DeployConfig, StageDeployConfig, resolve_stage_configs
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.resolver import check_model


@pytest.fixture
def gguf_model(tmp_path) -> ModelSource:
    """A ``.gguf`` model with its base folder (nothing is read from either here)."""
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model_index.json").write_text("{}")
    (tmp_path / "flux-Q8_0.gguf").write_bytes(b"")
    return ModelSource(str(tmp_path / "flux-Q8_0.gguf"), model_config=str(tmp_path / "base"))


@pytest.fixture
def folder_model(tmp_path) -> ModelSource:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    return ModelSource(str(tmp_path / "model"))


SPLIT = DeployConfig(
    stages=[
        StageDeployConfig(stage_id=0, stage_type="encode"),
        StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
        StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
    ]
)


def test_the_knobs_resolve_from_every_layer_with_provenance_and_show_in_the_start_up_line(tmp_path):
    stage = resolve_stage_configs(
        global_knobs={"quantization": "int8", "quantize_components": "transformer, text_encoder_2"},
        global_source="cli",
    )[0]
    assert (stage.quantization, stage.quantize_components) == ("int8", ("transformer", "text_encoder_2"))
    assert "quantization='int8' (cli), quantize_components=('transformer', 'text_encoder_2') (cli)" in stage.describe()
    assert stage.applied_knobs()["quantization"] == ("int8", "cli")  # what vllm_omni:stage_knob_info exports
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    quantization: fp8_storage\n")
    stage = resolve_stage_configs(deploy)[0]
    assert (stage.quantization, stage.provenance["quantization"]) == ("fp8_storage", "deploy_yaml")
    stage = resolve_stage_configs(deploy, global_knobs={"quantization": "int8"})[0]
    assert (stage.quantization, stage.provenance["quantization"]) == ("int8", "python")
    stages = resolve_stage_configs(SPLIT, stage_overrides={1: {"quantization": "int8"}})
    assert [s.quantization for s in stages] == ["none", "int8", "none"]
    assert stages[1].provenance["quantization"] == "stage_override"


def test_a_gguf_model_sets_gguf_on_every_diffusers_stage_with_provenance_model(gguf_model):
    stage = resolve_stage_configs(model=gguf_model)[0]
    assert (stage.quantization, stage.provenance["quantization"]) == ("gguf", "model")
    assert "quantization='gguf' (model)" in stage.describe()
    assert [s.quantization for s in resolve_stage_configs(SPLIT, model=gguf_model)] == ["gguf"] * 3
    given = resolve_stage_configs(global_knobs={"quantization": "gguf"}, model=gguf_model)[0]
    assert (given.quantization, given.provenance["quantization"]) == ("gguf", "python")
    check_model([stage], gguf_model)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (
            {"quantization": "int8"},
            r"stage 0: --quantization 'int8' \(cli\), but model '.*flux-Q8_0.gguf' is a GGUF file, whose denoiser "
            r"loads quantized as the file holds it",
        ),
        ({"quantization": "none"}, r"--quantization 'none' \(cli\), but model .* is a GGUF file"),
        (
            {"quantize_components": "transformer,text_encoder_2"},
            r"--quantize-components 'transformer,text_encoder_2' \(cli\): a GGUF file quantizes the denoiser",
        ),
    ],
)
def test_a_gguf_model_refuses_other_quantization_naming_both(gguf_model, knobs, message):
    with pytest.raises(ValueError, match=message):
        resolve_stage_configs(global_knobs=knobs, global_source="cli", model=gguf_model)


def test_gguf_for_a_model_that_is_not_a_gguf_file_is_refused_naming_the_knob(folder_model, gguf_model):
    with pytest.raises(ValueError, match=r"--quantization 'gguf' \(cli\) is what a .gguf model file sets, and model"):
        resolve_stage_configs(global_knobs={"quantization": "gguf"}, global_source="cli", model=folder_model)
    # Configs resolved without the model are checked when it is known (OmniBase.from_stage_configs).
    with pytest.raises(
        ValueError, match=r"quantization 'none' \(default\), but model .*\(resolve_stage_configs\(\.\.\., model"
    ):
        check_model(resolve_stage_configs(), gguf_model)
    with pytest.raises(ValueError, match=r"quantization= 'gguf' \(python\) is what a .gguf model file sets"):
        check_model(resolve_stage_configs(global_knobs={"quantization": "gguf"}), folder_model)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"quantization": "q4"}, r"--quantization 'q4': Input should be 'none', 'int8', 'fp8', 'fp8_storage', 'nf4'"),
        (
            {"quantize_components": "transformer"},
            r"--quantize-components 'transformer' \(cli\) chooses what quantization quantizes, but "
            r"quantization is 'none' \(default\)",
        ),
        ({"quantize_components": "transformer,transformer"}, r"quantize_components names transformer more than once"),
        ({"quantize_components": "vae/decoder"}, r"quantize_components are component names .* got \['vae/decoder'\]"),
        (
            {"quantization": "int8", "cpu_offload": "sequential"},
            r"--cpu-offload 'sequential' \(cli\) moves each submodule's weights by value .* use cpu_offload 'model'",
        ),
        (
            {"quantization": "int8", "load_format": "dummy"},
            r"--quantization 'int8' \(cli\) quantizes the weights as they are read from the files, and --load-format "
            r"is 'dummy' \(cli\), which reads none: use quantization 'fp8_storage' or 'none'",
        ),
        ({"load_format": "safetensors"}, r"--load-format 'safetensors': Input should be 'auto' or 'dummy'"),
        (
            {"quantization": "fp8", "enable_lora": True},
            r"--quantization 'fp8' \(cli\) with --enable-lora True \(cli\): PEFT's LoRA layer on a torchao weight "
            r"takes int8 weights only; serve LoRA with quantization 'int8' or 'fp8_storage'",
        ),
        (
            {"quantization": "nf4", "lora_modules": ["a=/x"]},
            r"--quantization 'nf4' \(cli\) with --lora-modules .*: bitsandbytes's LoRA layers are not served",
        ),
    ],
)
def test_refusals_name_each_knob_as_written(knobs, message):
    with pytest.raises(ValueError, match=message):
        resolve_stage_configs(global_knobs=knobs, global_source="cli")


def test_random_weights_take_fp8_storage_which_casts_them_after_the_load():
    stage = resolve_stage_configs(global_knobs={"load_format": "dummy", "quantization": "fp8_storage"})[0]
    assert (stage.load_format, stage.quantization) == ("dummy", "fp8_storage")
    assert "load_format='dummy' (python)" in stage.describe()


def test_lora_with_int8_or_fp8_storage_and_a_model_offload_resolve():
    for mode in ("int8", "fp8_storage"):
        stage = resolve_stage_configs(global_knobs={"quantization": mode, "enable_lora": True})[0]
        assert stage.quantization == mode
    assert resolve_stage_configs(global_knobs={"quantization": "nf4", "cpu_offload": "model"})[0].cpu_offload == "model"
