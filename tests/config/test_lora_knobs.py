"""The LoRA knobs (enable_lora, lora_modules, max_loras, max_lora_rank): every layer, provenance, diffusion stages
only, and vLLM's own flags mapped to them only when given."""

import re
import textwrap

import pytest

from vllm_omni import Omni
from vllm_omni.config import (
    DeployConfig,
    LoRAModulePath,
    StageDeployConfig,
    load_deploy_config,
    resolve_stage_configs,
)
from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args

LORA_KNOBS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank")
SPLIT = """
stages:
  - {stage_id: 0, stage_type: encode%s}
  - {stage_id: 1, stage_type: denoise, inputs: [0]%s}
  - {stage_id: 2, stage_type: decode, inputs: [1]%s}
"""


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def _split(tmp_path, encode="", denoise="", decode="") -> str:
    return _write(tmp_path, SPLIT % (encode, denoise, decode))


@pytest.fixture(scope="module")
def parser():
    return make_serve_parser("vllm serve")


@pytest.fixture
def model(tmp_path):
    """A folder the CLI takes as a diffusers model (nothing is loaded: flags are resolved before loading)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    return str(folder)


def _serve(parser, model, argv) -> list[StageDeployConfig]:
    args, explicit = parse_serve_args(parser, [model, *argv])
    return build_serve_config(parser, args, explicit)[1]


def _serve_error(parser, model, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        _serve(parser, model, argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def _knobs(stage: StageDeployConfig) -> dict:
    return {k: (getattr(stage, k), stage.provenance[k]) for k in LORA_KNOBS}


# The command line.


def test_vllm_lora_flags_resolve_with_cli_provenance(parser, model):
    (stage,) = _serve(
        parser,
        model,
        ["--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}', "--max-loras", "2"],
    )
    assert stage.lora_modules == (
        LoRAModulePath(name="a", path="/x"),
        LoRAModulePath(name="b", path="/y", base_model_name="m"),
    )
    assert _knobs(stage) == {
        "enable_lora": (False, "default"),
        "lora_modules": (stage.lora_modules, "cli"),
        "max_loras": (2, "cli"),
        "max_lora_rank": (64, "default"),
    }
    assert stage.lora_enabled  # lora_modules implies enable_lora
    assert "lora_modules=(a=/x, b=/y) (cli), max_loras=2 (cli), max_lora_rank=64 (default)" in stage.describe()


def test_enable_lora_and_max_lora_rank_flags(parser, model):
    (stage,) = _serve(parser, model, ["--enable-lora", "--max-lora-rank", "128"])
    assert _knobs(stage) == {
        "enable_lora": (True, "cli"),
        "lora_modules": ((), "default"),
        "max_loras": (4, "default"),
        "max_lora_rank": (128, "cli"),
    }
    assert stage.lora_enabled


def test_vllm_lora_defaults_are_not_taken_when_the_flags_are_not_given(parser, model):
    """vLLM's parser defaults are max_loras 1 and max_lora_rank 16; ours (4 and 64) stay."""
    (stage,) = _serve(parser, model, [])
    assert _knobs(stage) == {
        "enable_lora": (False, "default"),
        "lora_modules": ((), "default"),
        "max_loras": (4, "default"),
        "max_lora_rank": (64, "default"),
    }
    assert not stage.lora_enabled
    line = stage.describe()
    assert "enable_lora=False (default)" in line
    assert "lora_modules" not in line and "max_loras" not in line  # they apply once LoRA is enabled


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--lora-modules", "justaname"], r"--lora-modules: justaname"),
        (["--lora-modules", "{bad"], r"--lora-modules: \{bad"),
        (["--lora-modules", '{"name": "a"}'], r"--lora-modules: \{\"name\": \"a\"\}"),
        (["--lora-modules", "a=/x", "a=/y"], r"--lora-modules .*lora_modules names must be unique, repeated: a"),
        (["--max-loras", "0"], r"--max-loras 0: Input should be greater than or equal to 1"),
        (["--max-loras", "two"], r"argument --max-loras: invalid int value: 'two'"),
    ],
)
def test_bad_lora_flags_fail_naming_the_flag_and_entry(parser, model, capsys, argv, message):
    error = _serve_error(parser, model, argv, capsys)
    assert re.search(message, error), error


def test_lora_flags_sit_between_the_deploy_yaml_and_stage_overrides(parser, model, tmp_path):
    deploy = _write(tmp_path, "stages:\n  - {stage_id: 0, max_loras: 3, max_lora_rank: 32, lora_modules: [a=/x]}\n")
    (stage,) = _serve(
        parser,
        model,
        ["--deploy-config", deploy, "--max-loras", "2", "--stage-overrides", '{"0": {"lora_modules": ["b=/y"]}}'],
    )
    assert _knobs(stage) == {
        "enable_lora": (False, "default"),
        "lora_modules": ((LoRAModulePath(name="b", path="/y"),), "stage_override"),
        "max_loras": (2, "cli"),
        "max_lora_rank": (32, "deploy_yaml"),
    }


@pytest.mark.parametrize("argv", [["--enable-lora"], ["--max-loras", "2"], ["--lora-modules", "a=/x"]])
def test_a_lora_flag_on_a_split_deploy_is_refused(parser, model, tmp_path, capsys, argv):
    error = _serve_error(parser, model, ["--deploy-config", _split(tmp_path), *argv], capsys)
    assert f"{argv[0]} (cli): LoRA adapters are served by diffusion stages only" in error
    assert "serve the model as one diffusion stage for LoRA" in error


# The deploy YAML.


def test_yaml_lora_keys_on_a_diffusion_stage(tmp_path):
    path = _write(
        tmp_path,
        """
        stages:
          - stage_id: 0
            stage_type: diffusion
            enable_lora: true
            lora_modules:
              - a=/x
              - {name: b, path: /y, base_model_name: m}
            max_loras: 2
            max_lora_rank: 8
        """,
    )
    (stage,) = resolve_stage_configs(load_deploy_config(path))
    modules = (LoRAModulePath(name="a", path="/x"), LoRAModulePath(name="b", path="/y", base_model_name="m"))
    assert _knobs(stage) == {
        "enable_lora": (True, "deploy_yaml"),
        "lora_modules": (modules, "deploy_yaml"),
        "max_loras": (2, "deploy_yaml"),
        "max_lora_rank": (8, "deploy_yaml"),
    }
    assert "lora_modules=(a=/x, b=/y) (deploy_yaml)" in stage.describe()


def test_one_yaml_entry_may_be_given_without_a_list(tmp_path):
    (stage,) = resolve_stage_configs(load_deploy_config(_write(tmp_path, "stages:\n  - {lora_modules: a=/x}\n")))
    assert stage.lora_modules == (LoRAModulePath(name="a", path="/x"),)
    assert "lora_modules=(a=/x,) (deploy_yaml)" in stage.describe()


@pytest.mark.parametrize(
    "entries,message",
    [
        ("[bad]", r"invalid lora_modules in stage 0 of .*: lora_modules entry 'bad' is neither name=path nor"),
        ("['=/x']", r"lora_modules entry '=/x' is neither name=path nor"),
        ("['a=']", r"lora_modules entry 'a=' is neither name=path nor"),
        ("[{name: a}]", r"invalid lora_modules.0.path=.* in stage 0 of .*: Field required"),
        ("[{name: a, path: /x, scale: 1}]", r"unknown key 'lora_modules.0.scale'"),
        ("[a=/x, a=/y]", r"lora_modules names must be unique, repeated: a"),
        ("[a=/x, {name: a, path: /y}]", r"lora_modules names must be unique, repeated: a"),
    ],
)
def test_malformed_yaml_entries_fail_naming_the_entry_and_the_file(tmp_path, entries, message):
    path = _write(tmp_path, f"stages:\n  - {{lora_modules: {entries}}}\n")
    with pytest.raises(ValueError, match=message) as info:
        load_deploy_config(path)
    assert path in str(info.value)


@pytest.mark.parametrize("knob,value", [("enable_lora", "true"), ("lora_modules", "[a=/x]"), ("max_loras", "2")])
@pytest.mark.parametrize("stage", ["encode", "denoise", "decode"])
def test_a_yaml_lora_key_on_a_split_stage_is_refused(tmp_path, knob, value, stage):
    keys = {s: f", {knob}: {value}" if s == stage else "" for s in ("encode", "denoise", "decode")}
    deploy = load_deploy_config(_split(tmp_path, **keys))
    stage_id = ("encode", "denoise", "decode").index(stage)
    with pytest.raises(
        ValueError, match=rf"^stage {stage_id} \({stage}\): {knob} \(deploy_yaml\) applies to diffusion stages only"
    ):
        resolve_stage_configs(deploy)


@pytest.mark.parametrize("stage_id", [0, 1, 2])
def test_a_stage_override_lora_knob_on_a_split_stage_is_refused(tmp_path, stage_id):
    with pytest.raises(ValueError, match=r"max_lora_rank \(stage_override\) applies to diffusion stages only"):
        resolve_stage_configs(_split(tmp_path), stage_overrides={stage_id: {"max_lora_rank": 8}})


def test_a_split_deploy_shows_no_lora_knobs(tmp_path):
    for stage in resolve_stage_configs(_split(tmp_path)):
        assert not any(knob in stage.describe() for knob in LORA_KNOBS)


# Python keywords.


def test_python_keywords_take_every_entry_form():
    (stage,) = resolve_stage_configs(
        global_knobs={
            "lora_modules": ["a=/x", {"name": "b", "path": "/y"}, LoRAModulePath(name="c", path="/z")],
            "max_lora_rank": 16,
        }
    )
    assert [(m.name, m.path) for m in stage.lora_modules] == [("a", "/x"), ("b", "/y"), ("c", "/z")]
    assert stage.provenance["lora_modules"] == stage.provenance["max_lora_rank"] == "python"


@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"max_loras": 0}, r"max_loras= 0: Input should be greater than or equal to 1"),
        ({"max_lora_rank": 0}, r"max_lora_rank= 0: Input should be greater than or equal to 1"),
        ({"enable_lora": "maybe"}, r"enable_lora= 'maybe': Input should be a valid boolean"),
        ({"lora_modules": ["bad"]}, r"lora_modules= \['bad'\]: .*lora_modules entry 'bad' is neither name=path"),
        ({"lora_modules": ['{"name": "a"']}, r"lora_modules entry '\{\"name\": \"a\"' is not valid JSON"),
        ({"lora_modules": ["a=/x", "a=/y"]}, r"lora_modules names must be unique, repeated: a"),
    ],
)
def test_invalid_omni_keywords_fail_before_loading_naming_the_knob(knobs, message):
    with pytest.raises(ValueError, match=r"^invalid value in the Omni arguments: .*" + message):
        Omni("/nonexistent/model", **knobs)  # resolution fails first: no model is read


def test_a_python_lora_keyword_on_a_split_deploy_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^max_loras= \(python\): LoRA adapters are served by diffusion stages"):
        Omni("/nonexistent/model", deploy_config=_split(tmp_path), max_loras=2)


def test_stage_config_refuses_lora_values_directly():
    with pytest.raises(ValueError, match="lora_modules names must be unique"):
        StageDeployConfig(lora_modules=["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        StageDeployConfig(max_loras=0)
    assert not StageDeployConfig().lora_enabled
    assert StageDeployConfig(enable_lora=True).lora_enabled
    assert StageDeployConfig(lora_modules="a=/x").lora_enabled
    assert DeployConfig(stages=[StageDeployConfig(lora_modules="a=/x")]).stages[0].lora_modules[0].name == "a"
