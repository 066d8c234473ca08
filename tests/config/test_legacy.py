"""The deprecated aliases: each warns (naming max_num_seqs), maps, and conflicts raise."""

import logging
import textwrap

import pytest
from packaging.version import Version

import vllm_omni
from vllm_omni.config import legacy, load_deploy_config, resolve_stage_configs


def test_package_version_is_below_the_alias_removal_version():
    assert Version(vllm_omni.__version__) < Version(legacy.REMOVAL_VERSION), (
        f"vllm-omni {vllm_omni.__version__} reached {legacy.REMOVAL_VERSION}: delete vllm_omni/config/legacy.py, "
        "its callers and these tests, and move the alias to 'Removed' in CHANGELOG.md"
    )


def _yaml(tmp_path, stage_text: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  - stage_id: 0\n" + textwrap.indent(textwrap.dedent(stage_text), "    "))
    return str(path)


@pytest.mark.parametrize("stage_text", ["diffusion_batch_size: 4\n", "runtime:\n  max_batch_size: 4\n"])
def test_yaml_alias_warns_names_the_file_and_acts_as_max_num_seqs(tmp_path, caplog, stage_text):
    path = _yaml(tmp_path, stage_text)
    with (
        caplog.at_level(logging.WARNING, logger="vllm_omni"),
        pytest.warns(FutureWarning, match="use max_num_seqs instead") as record,
    ):
        deploy = load_deploy_config(path)
    assert len(record) == 1 and path in str(record[0].message)
    assert record[0].filename == __file__  # stacklevel: the caller, not vllm_omni internals
    assert [r.levelname for r in caplog.records if "deprecated" in r.getMessage()] == ["WARNING"]
    stage = resolve_stage_configs(deploy)[0]
    assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (4, "legacy_alias")


def test_yaml_alias_loses_to_higher_layers(tmp_path):
    with pytest.warns(FutureWarning):
        deploy = load_deploy_config(_yaml(tmp_path, "diffusion_batch_size: 2\n"))
    stage = resolve_stage_configs(deploy, global_knobs={"max_num_seqs": 6}, global_source="cli")[0]
    assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (6, "cli")


@pytest.mark.parametrize(
    "stage_text",
    [
        "diffusion_batch_size: 1\nmax_num_seqs: 4\n",
        "runtime: {max_batch_size: 1}\nmax_num_seqs: 4\n",
        "diffusion_batch_size: 2\nruntime: {max_batch_size: 3}\n",
    ],
)
def test_yaml_conflict_at_the_same_layer_raises_naming_both(tmp_path, stage_text):
    with pytest.raises(ValueError, match=r"conflicting batch sizes in stage 0 of .*deploy.yaml") as info:
        load_deploy_config(_yaml(tmp_path, stage_text))
    assert str(info.value).count("=") >= 2


def test_yaml_alias_equal_to_max_num_seqs_warns_and_keeps_yaml_source(tmp_path):
    with pytest.warns(FutureWarning):
        deploy = load_deploy_config(_yaml(tmp_path, "diffusion_batch_size: 4\nmax_num_seqs: 4\n"))
    stage = resolve_stage_configs(deploy)[0]
    assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (4, "deploy_yaml")


def test_runtime_block_with_other_keys_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) runtime.process in stage 0"):
        load_deploy_config(_yaml(tmp_path, "runtime: {max_batch_size: 2, process: true}\n"))


def test_python_alias_maps_to_max_num_seqs():
    kwargs = {"diffusion_batch_size": 4, "dtype": "float32"}
    with pytest.warns(FutureWarning, match="max_num_seqs") as record:
        value, from_alias = legacy.pop_python_alias(kwargs, None)
    assert (value, from_alias, kwargs) == (4, True, {"dtype": "float32"})
    assert record[0].filename == __file__


def test_python_alias_conflict_names_both():
    with pytest.raises(ValueError, match=r"diffusion_batch_size=1 and max_num_seqs=4"):
        legacy.pop_python_alias({"diffusion_batch_size": 1}, 4)


def test_python_alias_equal_to_max_num_seqs_keeps_python_source():
    with pytest.warns(FutureWarning):
        assert legacy.pop_python_alias({"diffusion_batch_size": 4}, 4) == (4, False)
