"""A speech deploy's configuration: ``--codec-model`` (``codec_model=``) deploys a talker and its codec, and the
rules of ``llm`` stages in ``mode: tts`` and of ``codec`` stages, each refusal naming the stage and the key."""

import pytest
import yaml

from vllm_omni.config import resolve_stage_configs
from vllm_omni.config.model_source import ModelSource


def _deploy(tmp_path, *stages: dict) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"stages": list(stages)}))
    return str(path)


def _talker(**keys) -> dict:
    return {"stage_id": 0, "stage_type": "llm", "mode": "tts", "model": "talker", **keys}


def _codec(**keys) -> dict:
    return {"stage_id": 1, "stage_type": "codec", "inputs": [0], "model": "codec", **keys}


def test_codec_model_deploys_the_talker_and_its_codec_with_the_global_knobs(tmp_path):
    talker_dir = tmp_path / "talker"
    talker_dir.mkdir()
    (talker_dir / "config.json").write_text("{}")
    stages = resolve_stage_configs(
        model=ModelSource(str(talker_dir)),
        codec_model="org/codec",
        global_knobs={"max_num_seqs": 4},
        global_source="cli",
    )
    talker, codec = stages
    assert (talker.stage_type, talker.mode, talker.model) == ("llm", "tts", str(talker_dir))
    assert (codec.stage_type, codec.inputs, codec.model) == ("codec", (0,), "org/codec")
    assert (talker.max_num_seqs, codec.max_num_seqs) == (4, 4)
    assert talker.provenance["max_num_seqs"] == codec.provenance["max_num_seqs"] == "cli"
    assert (talker.distributed_executor_backend, codec.distributed_executor_backend) == ("ray", "inline")
    assert codec.window_order == "underrun"
    assert "window_order='underrun' (default)" in codec.describe()
    assert "window_order" not in talker.describe()


def test_codec_model_and_a_deploy_yaml_are_refused_together(tmp_path):
    with pytest.raises(ValueError, match=r"codec_model \(--codec-model\) .* give one or the other"):
        resolve_stage_configs(_deploy(tmp_path, _talker(), _codec()), model=ModelSource("org/talker"), codec_model="c")


def test_a_deploy_yaml_of_a_talker_and_its_codec_resolves(tmp_path):
    stages = resolve_stage_configs(_deploy(tmp_path, _talker(max_num_seqs=8), _codec(window_order="arrival")))
    assert [s.max_num_seqs for s in stages] == [8, 1]
    assert stages[1].window_order == "arrival"


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ((_talker(mode="chat"), _codec()), r"stage 1 \(codec\) takes stage 0, an llm stage in mode 'chat'.*mode: tts"),
        (
            (_talker(), {"stage_id": 1, "stage_type": "diffusion", "inputs": [0]}),
            r"stage 0 \(llm, mode tts\) makes speech codes, so exactly one codec stage must take it",
        ),
        ((_talker(), _codec(model=None)), r"stage 1 \(codec\): model is required"),
        (
            (_talker(), _codec(distributed_executor_backend="ray")),
            r"stage 1 \(codec\): distributed_executor_backend 'ray' \(deploy_yaml\): a codec stage runs inline",
        ),
        (
            (_talker(prompt_template="say {prompt}"), _codec()),
            r"prompt_template 'say \{prompt\}' \(deploy_yaml\): in mode 'tts' the speech family's own prompt format",
        ),
        (({**_codec(), "inputs": []}, _talker()), r"stage 1 \(codec\) takes exactly one input, a stage of type 'llm'"),
        ((_talker(window_order="arrival"), _codec()), r"window_order .* applies to codec stages only"),
    ],
)
def test_a_wrong_speech_deploy_is_refused_naming_the_stage_and_the_key(tmp_path, stages, message):
    with pytest.raises(ValueError, match=message):
        resolve_stage_configs(_deploy(tmp_path, *stages))
