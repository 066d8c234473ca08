"""What makes a `StageDeployConfig` field a stage knob (`Knob`: the stages it applies to, its flag), and the stage
types of each scope."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_omni.config.stage_types import STAGE_TYPES

KnobScope = Literal["every", "pipeline", "denoising", "decoding", "lora", "ray", "llm", "model", "codec"]
"""Which stages a knob applies to (`knob_applies`): every stage; those that run a diffusers pipeline (``runs:
diffusers``); those that hold the denoiser (`StageTypeSpec.denoises`); those that decode with the VAE (the
diffusers stages whose outputs are images, `StageTypeSpec.final`); those that serve LoRA adapters
(`StageTypeSpec.adapts`); Ray replicas (``distributed_executor_backend: ray``); ``llm`` stages; the stages that
load a model of their own (``model``: ``llm`` and ``codec``); ``codec`` stages."""


@dataclass(frozen=True)
class Knob:
    """What makes a `StageDeployConfig` field a stage knob, beside its type, default and docstring: which stages it
    applies to and its command-line flag. Declared once, as the field's metadata (``Annotated[T, Knob(...)]``);
    the YAML key, the ``Omni`` keyword and ``stage_overrides`` are the field's name, and every list of knobs (the
    groups below, the CLI's omni flags, the resolver's checks, the start-up line, ``stage_knob_info``) reads it."""

    scope: KnobScope = "every"
    """The stages it applies to; set for another it is refused (a global flag or keyword skips that stage)."""

    flag: Literal["omni", "vllm", "none"] = "omni"
    """Its flag: ``omni`` one of the Omni group's, ``--name-with-dashes``; ``vllm`` vLLM's own flag of that name;
    ``none`` no flag (deploy YAML, ``Omni`` keyword and ``stage_overrides`` only)."""

    metavar: str | None = None
    """The omni flag's value in ``--help`` (``N`` unless given; a choice lists its values)."""


STAGE_TYPES_OF_SCOPE: dict[KnobScope, tuple[str, ...]] = {
    "pipeline": tuple(t for t, spec in STAGE_TYPES.items() if spec.runs == "diffusers"),
    "denoising": tuple(t for t, spec in STAGE_TYPES.items() if spec.denoises),
    "decoding": tuple(t for t, spec in STAGE_TYPES.items() if spec.final and spec.runs == "diffusers"),
    "lora": tuple(t for t, spec in STAGE_TYPES.items() if spec.adapts),
    "llm": tuple(t for t, spec in STAGE_TYPES.items() if spec.runs == "vllm"),
    "model": tuple(t for t, spec in STAGE_TYPES.items() if spec.runs != "diffusers"),
    "codec": tuple(t for t, spec in STAGE_TYPES.items() if spec.runs == "codec"),
}
"""The stage types of each scope that a stage's type decides (``every`` and ``ray`` are not among them)."""
