"""`OmniDiffusionConfig`: what a diffusion engine needs, one replica of a resolved stage config."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from vllm_omni.config.parallel import PARALLEL_KNOBS
from vllm_omni.config.resolver import knob_as_written
from vllm_omni.config.stage import StageDeployConfig


class OmniDiffusionConfig(BaseModel):
    """Engine-side view of one replica of a resolved diffusion stage.

    The stage's knobs are read from ``stage`` as the resolver made it (``od_config.stage.max_num_seqs``), so the
    resolver stays the one place defaults live and a new knob needs no field here; this adds only what a replica
    knows beyond its stage.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: str
    """Path of the diffusers folder (the one holding ``model_index.json``)."""

    stage: StageDeployConfig
    """The resolved stage this engine serves (every knob, with its provenance)."""

    replica: int
    """Which of the stage's replicas this engine is (0 for a stage of one)."""

    torch_threads: int | None
    """Torch (OpenMP) threads of the engine's thread; ``None``: torch's default, one per core."""

    @classmethod
    def from_stage(
        cls, model: str, stage: StageDeployConfig, replica: int = 0, torch_threads: int | None = None
    ) -> OmniDiffusionConfig:
        """The engine config of one replica of ``stage``; ``torch_threads`` from `engine_torch_threads`."""
        if stage.stage_type == "llm":
            raise ValueError(f"stage {stage.stage_id} has stage_type 'llm', which this release does not serve")
        if not 0 <= replica < stage.num_replicas:
            raise ValueError(f"stage {stage.stage_id} has {stage.num_replicas} replica(s), not a replica {replica}")
        parallel = [knob_as_written(stage, k) for k in PARALLEL_KNOBS if getattr(stage, k) > 1]
        if parallel:  # issue 43: the engine does not start a replica's ranks yet
            raise ValueError(
                f"stage {stage.stage_id}: {' x '.join(parallel)} run one request on several ranks, which this "
                "release does not serve yet: set them to 1"
            )
        return cls(model=model, stage=stage, replica=replica, torch_threads=torch_threads)
