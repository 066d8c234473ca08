"""A speech deploy: a talker (an ``llm`` stage in ``mode: tts``) whose code tokens a ``codec`` stage turns into
audio. `speech_deploy` is what ``--codec-model`` (``Omni(..., codec_model=...)``) deploys; `check_speech_graph` is the
rule of such stages' graph, in a deploy YAML too (their own keys: their entries in `STAGE_TYPES`)."""

from __future__ import annotations

from collections.abc import Sequence

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
