"""A speech deploy: a talker (an ``llm`` stage in ``mode: tts``) whose code tokens a ``codec`` stage turns into
audio. `speech_deploy` is what ``--codec-model`` (``Omni(..., codec_model=...)``) deploys; `check_codec_stage` and
`check_speech_graph` are the rules of such stages, in a deploy YAML too."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_omni.config.stage import DeployConfig, StageDeployConfig


def speech_deploy(talker: str, codec: str) -> DeployConfig:
    """The two stages of a speech model: stage 0 the talker ``talker`` on vLLM's engine, stage 1 the codec
    ``codec`` taking its codes. Every other knob comes from the usual layers (flags, ``stage_overrides``)."""
    return DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="llm", mode="tts", model=talker),
            StageDeployConfig(stage_id=1, stage_type="codec", inputs=(0,), model=codec),
        ]
    )


def check_codec_stage(stage_id: int, values: Mapping[str, Any], written: Callable[[str], str]) -> None:
    """A codec stage's keys: its codec model, and replicas in this process."""
    where = f"stage {stage_id} (codec)"
    if not values["model"]:
        raise ValueError(f"{where}: model is required: the codec's folder or Hugging Face repo id")
    if values["distributed_executor_backend"] != "inline":
        raise ValueError(
            f"{where}: {written('distributed_executor_backend')}: a codec stage runs inline in this release (its "
            "decoder is small beside the talker); set it to 'inline' or leave it unset"
        )


def check_speech_graph(stages: Sequence[StageDeployConfig]) -> None:
    """An llm stage in ``mode: tts`` makes codes, so exactly one codec stage takes it, and a codec stage takes a
    talker (`check_stage_graph` has checked the types of the inputs already)."""
    by_id = {stage.stage_id: stage for stage in stages}
    for stage in stages:
        if stage.stage_type == "codec" and by_id[stage.inputs[0]].mode != "tts":
            raise ValueError(
                f"stage {stage.stage_id} (codec) takes stage {stage.inputs[0]}, an llm stage in mode "
                f"{by_id[stage.inputs[0]].mode!r}; a codec decodes the codes of a talker: set that stage's mode: tts"
            )
        if stage.stage_type == "llm" and stage.mode == "tts":
            takers = [s.stage_id for s in stages if stage.stage_id in s.inputs]
            if [by_id[i].stage_type for i in takers] != ["codec"]:
                raise ValueError(
                    f"stage {stage.stage_id} (llm, mode tts) makes speech codes, so exactly one codec stage must "
                    f"take it (inputs: [{stage.stage_id}]); the stages that take it: {takers or 'none'}"
                )
