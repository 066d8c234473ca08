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
        _check_rank_group(stage)
        return cls(model=model, stage=stage, replica=replica, torch_threads=torch_threads)


_NOT_ON_RANKS = {
    "execution_mode": ("request", "the ranks run whole pipeline calls (request mode), not one step at a time"),
    "enable_lora": (False, "the ranks load no adapters"),
    "cache_backend": ("none", "the ranks run no step cache"),
    "compile": ("none", "the ranks do not compile their denoisers"),
    "cpu_offload": ("none", "each rank holds its whole pipeline on its device"),
    "quantization": ("none", "the ranks load the folder's weights as saved"),
    "vae_tiling": (False, "the ranks decode as the VAE's defaults do (vae_patch_parallel_size tiles it)"),
    "vae_slicing": (False, "the ranks decode as the VAE's defaults do"),
}
"""The knobs a replica of several ranks (`RankGroup`) does not run yet: the value it runs, and why."""


def _check_rank_group(stage: StageDeployConfig) -> None:
    """Refuse, naming the knobs as written, what a replica of several ranks does not run yet (issue 43)."""
    parallel = [knob_as_written(stage, k) for k in PARALLEL_KNOBS if getattr(stage, k) > 1]
    if not parallel:
        return
    given = " x ".join(parallel)
    if stage.stage_type != "diffusion":
        raise ValueError(
            f"stage {stage.stage_id}: {given} run one request on several ranks, which a split stage "
            f"({knob_as_written(stage, 'stage_type')}) does not do yet: use stage_type 'diffusion' or set them to 1"
        )
    if stage.lora_modules:
        raise ValueError(
            f"stage {stage.stage_id}: {given} run one request on several ranks, and the ranks load no adapters: "
            f"remove {knob_as_written(stage, 'lora_modules')} or set the degrees to 1"
        )
    for knob, (runs, why) in _NOT_ON_RANKS.items():
        if getattr(stage, knob) != runs:
            raise ValueError(
                f"stage {stage.stage_id}: {given} run one request on several ranks, and {knob_as_written(stage, knob)} "
                f"is not run there yet ({why}): set {knob} to {runs!r} or the degrees to 1"
            )
