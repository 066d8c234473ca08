"""Per-model adapters of step mode (``execution_mode: step``); `make_stepper` picks one for a pipeline."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.steppers.base import Stepper, StepState
from vllm_omni.diffusion.steppers.flow import FluxStepper, SD3Stepper, WanStepper
from vllm_omni.diffusion.steppers.unet import UNetStepper

STEPPERS: tuple[type[Stepper], ...] = (FluxStepper, SD3Stepper, WanStepper, UNetStepper)

SUPPORTED_PIPELINES: tuple[str, ...] = tuple(name for cls in STEPPERS for name in cls.pipeline_classes)
"""Pipeline classes that ``execution_mode: step`` can serve."""


def make_stepper(pipeline, device: torch.device) -> Stepper:
    """The stepper for ``pipeline``; ValueError naming the class and the supported ones when there is none."""
    name = type(pipeline).__name__
    for cls in STEPPERS:
        if name in cls.pipeline_classes:
            cls.check_pipeline(pipeline)
            return cls(pipeline, device)
    raise ValueError(
        f"execution_mode 'step' does not support {name}; it supports {', '.join(SUPPORTED_PIPELINES)}. "
        "Serve this model with execution_mode 'request' (--execution-mode request)"
    )


__all__ = ["STEPPERS", "SUPPORTED_PIPELINES", "StepState", "Stepper", "make_stepper"]
