"""Per-model adapters of step mode (``execution_mode: step``); `make_stepper` picks one for a pipeline."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.steppers.base import Conditioning, Latents, Stepper, StepState
from vllm_omni.diffusion.steppers.flow import FluxStepper, SD3Stepper, WanStepper
from vllm_omni.diffusion.steppers.modular import ModularStepper
from vllm_omni.diffusion.steppers.unet import UNetStepper

STEPPERS: tuple[type[Stepper], ...] = (FluxStepper, SD3Stepper, WanStepper, UNetStepper, ModularStepper)

SPLIT = "a split pipeline (encode / denoise / decode stages)"
STEP_MODE = "execution_mode 'step'"
PREVIEWS = "partial images"


def stepper_class(pipeline_name: str, purpose: str = STEP_MODE) -> type[Stepper] | None:
    """The stepper of a pipeline class for ``purpose``, or ``None`` when it has none: split stages and previews
    need a `Stepper.splittable` one."""
    cls = next((cls for cls in STEPPERS if pipeline_name in cls.pipeline_classes), None)
    return cls if cls is not None and (purpose == STEP_MODE or cls.splittable) else None


SUPPORTED_PIPELINES: tuple[str, ...] = tuple(name for cls in STEPPERS for name in cls.pipeline_classes)
"""Pipeline classes that ``execution_mode: step`` can serve."""
SPLITTABLE_PIPELINES: tuple[str, ...] = tuple(name for name in SUPPORTED_PIPELINES if stepper_class(name, SPLIT))
"""Pipeline classes that can be split into stages and show partial images."""


def make_stepper(pipeline, device: torch.device, purpose: str = STEP_MODE) -> Stepper:
    """The stepper for ``pipeline``, for ``purpose`` (`STEP_MODE` or `SPLIT`); ValueError naming the class and the
    supported ones when there is none."""
    name = type(pipeline).__name__
    remedy = (
        "Serve this model as one diffusion stage (stage_type: diffusion)"
        if purpose == SPLIT
        else "Serve this model with execution_mode 'request' (--execution-mode request)"
    )
    cls = stepper_class(name, purpose)
    if cls is None:
        supported = SUPPORTED_PIPELINES if purpose == STEP_MODE else SPLITTABLE_PIPELINES
        raise ValueError(f"{purpose} does not support {name}; it supports {', '.join(supported)}. {remedy}")
    try:
        cls.check_pipeline(pipeline)
    except ValueError as exc:
        raise ValueError(f"{purpose} does not support {exc}. {remedy}") from None
    return cls(pipeline, device)


__all__ = [
    "PREVIEWS",
    "SPLIT",
    "SPLITTABLE_PIPELINES",
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
