"""`OmniDiffusionConfig`: what a diffusion engine needs, derived from a resolved stage config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from vllm_omni.config.cache import CacheBackendName
from vllm_omni.config.stage import (
    CompileMode,
    CpuOffload,
    DType,
    ExecutionMode,
    LoRAModulePath,
    StageDeployConfig,
    StageType,
)


class OmniDiffusionConfig(BaseModel):
    """Engine-side view of one resolved diffusion stage.

    It has no defaults of its own: every value comes from the resolved
    `StageDeployConfig`, so the resolver stays the one place defaults live.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model: str
    """Path of the diffusers folder (the one holding ``model_index.json``)."""

    stage_id: int
    """The stage this engine serves."""

    replica: int
    """Which of the stage's replicas this engine is (0 for a stage of one)."""

    stage_type: StageType
    """What the engine runs: the whole pipeline (``diffusion``) or one part of a split one."""

    max_num_seqs: int
    """Scheduler capacity: most requests in one batch."""

    request_batch_max_wait_ms: float
    """Admission wait of an idle engine for a fuller batch (request mode only)."""

    execution_mode: ExecutionMode
    """``request``: one pipeline call per batch; ``step``: one denoiser forward per step, requests join and leave."""

    dtype: DType
    """Requested dtype (``auto`` resolved by the runner for its device)."""

    devices: str | None
    """CUDA device indices, or ``None`` for the default device."""

    torch_threads: int | None
    """Torch (OpenMP) threads of the engine's thread; ``None``: torch's default, one per core."""

    lora_enabled: bool
    """Whether the engine serves LoRA adapters (``enable_lora`` or ``lora_modules``)."""

    lora_modules: tuple[LoRAModulePath, ...]
    """Adapters loaded at start-up (each checked; the last ``max_loras`` stay resident)."""

    max_loras: int
    """Adapters resident at once, and most in one batch."""

    max_lora_rank: int
    """Highest adapter rank it loads."""

    max_batch_pixels: int | None
    """Most ``width × height × frames × n`` in one batch or step-mode forward; ``None``: no budget."""

    vae_tiling: bool
    """Whether the VAE runs over tiles."""

    vae_slicing: bool
    """Whether the VAE runs one image of a batch at a time."""

    cpu_offload: CpuOffload
    """diffusers' CPU offload of the pipeline (CUDA only)."""

    compile: CompileMode
    """torch.compile of the denoiser."""

    compile_sizes: tuple[str, ...]
    """Sizes compiled at warm-up (``WxH`` or ``WxHxF``)."""

    cache_backend: CacheBackendName
    """Step caching of the denoiser (diffusers' cache hooks), or ``none``."""

    cache_config: dict[str, Any] | None
    """The cache backend's settings; ``None``: its defaults."""

    @classmethod
    def from_stage(
        cls, model: str, stage: StageDeployConfig, replica: int = 0, torch_threads: int | None = None
    ) -> OmniDiffusionConfig:
        """The engine config of one replica of ``stage``; ``torch_threads`` from `engine_torch_threads`."""
        if stage.stage_type == "llm":
            raise ValueError(f"stage {stage.stage_id} has stage_type 'llm', which this release does not serve")
        if not 0 <= replica < stage.num_replicas:
            raise ValueError(f"stage {stage.stage_id} has {stage.num_replicas} replica(s), not a replica {replica}")
        return cls(
            model=model,
            stage_id=stage.stage_id,
            replica=replica,
            stage_type=stage.stage_type,
            max_num_seqs=stage.max_num_seqs,
            request_batch_max_wait_ms=stage.request_batch_max_wait_ms,
            execution_mode=stage.execution_mode,
            dtype=stage.dtype,
            devices=stage.devices,
            torch_threads=torch_threads,
            lora_enabled=stage.lora_enabled,
            lora_modules=stage.lora_modules,
            max_loras=stage.max_loras,
            max_lora_rank=stage.max_lora_rank,
            max_batch_pixels=stage.max_batch_pixels,
            vae_tiling=stage.vae_tiling,
            vae_slicing=stage.vae_slicing,
            cpu_offload=stage.cpu_offload,
            compile=stage.compile,
            compile_sizes=stage.compile_sizes,
            cache_backend=stage.cache_backend,
            cache_config=stage.cache_config,
        )
