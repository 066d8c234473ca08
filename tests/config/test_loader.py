"""The deploy YAML loader: flat per-stage keys, every error names the key and the file."""

import textwrap

import pytest

from vllm_omni.config import load_deploy_config, resolve_stage_configs


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_contract_example_loads_and_resolves(tmp_path):
    path = _write(
        tmp_path,
        """
        stages:
          - stage_id: 0
            stage_type: diffusion
            max_num_seqs: 4
            request_batch_max_wait_ms: 20
            execution_mode: request
            num_replicas: 1
            dtype: float32
        """,
    )
    stage = resolve_stage_configs(load_deploy_config(path))[0]
    assert (stage.max_num_seqs, stage.request_batch_max_wait_ms, stage.dtype) == (4, 20.0, "float32")
    assert stage.provenance["max_num_seqs"] == "deploy_yaml"
    assert stage.provenance["devices"] == "default"


def test_unknown_key_names_the_key_the_stage_and_the_file(tmp_path):
    path = _write(tmp_path, "stages:\n  - stage_id: 3\n    max_num_seq: 4\n")
    with pytest.raises(ValueError) as info:
        load_deploy_config(path)
    message = str(info.value)
    assert "'max_num_seq'" in message and "stage 3" in message and path in message
    assert "max_num_seqs" in message  # the allowed keys are listed


@pytest.mark.parametrize(
    "text,match",
    [
        ("stages: []\n", "at least one stage"),
        ("model: x\nstages:\n  - {}\n", r"unknown top-level key\(s\) \['model'\]"),
        ("- stage_id: 0\n", "must be a mapping with a 'stages' list"),
        ("stages: {stage_id: 0}\n", "'stages' .* must be a list"),
        ("stages:\n  - 7\n", "stage #0 .* must be a mapping"),
        (
            "stages:\n  - {stage_id: 0}\n  - {stage_id: 0}\n",
            r"^invalid stages in .*deploy.yaml: stage_id values must be unique, repeated: \[0\]$",
        ),
        ("stages:\n  - {max_num_seqs: 0}\n", r"invalid max_num_seqs=0 in stage 0 of .*greater than or equal to 1"),
        (
            "stages:\n  - {stage_type: video}\n",
            r"invalid stage_type='video'.*'diffusion', 'encode', 'denoise', 'decode', 'llm' or 'codec'",
        ),
        ("stages:\n  - {devices: gpu0}\n", r"devices must be comma-separated CUDA device indices"),
        ("stages:\n  - {provenance: {max_num_seqs: cli}}\n", r"unknown key 'provenance'"),
        ("stages: [\n", "not valid YAML"),
    ],
)
def test_invalid_documents_fail_with_a_clear_message(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=match):
        load_deploy_config(path)


def test_missing_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--deploy-config"):
        load_deploy_config(tmp_path / "nope.yaml")
