"""The engine of each ``execution_mode`` (`make_engine`): what a replica, inline or in a Ray actor, steps."""

from __future__ import annotations

from collections.abc import Callable

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.core import EngineCore
from vllm_omni.diffusion.engine.request_mode import RequestEngine
from vllm_omni.diffusion.engine.roles import ROLES, StageRole
from vllm_omni.diffusion.engine.step_mode import StepEngine

ENGINES: dict[str, Callable[[OmniDiffusionConfig, type[StageRole]], EngineCore]] = {
    "request": RequestEngine,
    "step": StepEngine,
}
"""The engine of each ``execution_mode``."""


def make_engine(od_config: OmniDiffusionConfig) -> EngineCore:
    """The engine for the stage's ``execution_mode``, running the role of its ``stage_type``."""
    return ENGINES[od_config.stage.execution_mode](od_config, ROLES[od_config.stage.stage_type])
