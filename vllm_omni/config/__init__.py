"""Configuration: typed stage configs, the deploy YAML loader and the one resolver."""

from vllm_omni.config.diffusion import OmniDiffusionConfig
from vllm_omni.config.loader import load_deploy_config
from vllm_omni.config.lora import LoRAModulePath
from vllm_omni.config.resolver import engine_torch_threads, resolve_stage_configs
from vllm_omni.config.stage import (
    STAGE_KNOBS,
    DeployConfig,
    ExecutionMode,
    Source,
    StageDeployConfig,
)
from vllm_omni.config.stage_types import STAGE_TYPES, StageTypeSpec

__all__ = [
    "STAGE_KNOBS",
    "STAGE_TYPES",
    "DeployConfig",
    "ExecutionMode",
    "OmniDiffusionConfig",
    "Source",
    "LoRAModulePath",
    "StageDeployConfig",
    "StageTypeSpec",
    "engine_torch_threads",
    "load_deploy_config",
    "resolve_stage_configs",
]
