"""Per-model adapters of step mode (``execution_mode: step``); `make_stepper` picks one for a pipeline."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.families.steppers.base import Conditioning, Latents, Stepper, StepState
from vllm_omni.diffusion.families.steppers.flow import FluxStepper, SD3Stepper, WanStepper
from vllm_omni.diffusion.families.steppers.modular import ModularStepper
from vllm_omni.diffusion.families.steppers.unet import UNetStepper

STEPPERS: tuple[type[Stepper], ...] = (FluxStepper, SD3Stepper, WanStepper, UNetStepper, ModularStepper)

SPLIT = "a split pipeline (encode / denoise / decode stages)"
STEP_MODE = "execution_mode 'step'"


def stepper_class(pipeline_name: str) -> type[Stepper] | None:
    """The stepper of a pipeline class, or ``None`` when it has none."""
    return next((cls for cls in STEPPERS if pipeline_name in cls.pipeline_classes), None)


SUPPORTED_PIPELINES: tuple[str, ...] = tuple(name for cls in STEPPERS for name in cls.pipeline_classes)
"""Pipeline classes that ``execution_mode: step`` can serve, split into stages and show partial images of."""


def make_stepper(pipeline, device: torch.device, purpose: str = STEP_MODE) -> Stepper:
    """The stepper for ``pipeline``, for ``purpose`` (`STEP_MODE` or `SPLIT`); ValueError naming the class and the
    supported ones when there is none."""
    name = type(pipeline).__name__
    remedy = (
        "Serve this model as one diffusion stage (stage_type: diffusion)"
        if purpose == SPLIT
        else "Serve this model with execution_mode 'request' (--execution-mode request)"
    )
    cls = stepper_class(name)
    if cls is None:
        raise ValueError(f"{purpose} does not support {name}; it supports {', '.join(SUPPORTED_PIPELINES)}. {remedy}")
    try:
        cls.check_pipeline(pipeline)
    except ValueError as exc:
        raise ValueError(f"{purpose} does not support {exc}. {remedy}") from None
    return cls(pipeline, device)


__all__ = [
    "SPLIT",
    "STEPPERS",
    "STEP_MODE",
    "SUPPORTED_PIPELINES",
    "Conditioning",
    "Latents",
    "ModularStepper",
    "StepState",
    "Stepper",
    "make_stepper",
    "stepper_class",
]
