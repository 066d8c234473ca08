"""The quantization knobs (``quantization``, ``quantize_components``; docs/quantization.md) on the config side: their
values, and the rules the resolver checks before anything loads. What a stage loads quantized, and the checks that
need the model's files or the device, are `vllm_omni.diffusion.features.quantization`'s.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

Quantization = Literal["none", "int8", "fp8", "fp8_storage", "nf4", "gguf"]
"""How a stage's components are quantized: ``int8`` torchao int8 weight-only, ``fp8`` torchao float8 (weights and
activations), ``fp8_storage`` float8 storage with computation in the stage's dtype (diffusers' layerwise casting),
``nf4`` bitsandbytes 4-bit, ``gguf`` a ``.gguf`` model file's own quantization."""

QUANTIZATIONS: tuple[str, ...] = typing.get_args(Quantization)

GGUF_SOURCE: Final = "model"
"""The provenance of ``quantization: gguf`` that a ``.gguf`` model file set."""

LOADING_MODES = ("int8", "fp8", "nf4", "gguf")
"""The modes that quantize the weights as they are read from the files (``fp8_storage`` casts them after the
load)."""

LORA_MODES = ("none", "int8", "fp8_storage", "gguf")
"""The modes whose quantized layers serve LoRA adapters per row (PEFT's torchao layer takes int8 weights only;
bitsandbytes' LoRA layers are not per-row layers here; a GGUF layer is an ``nn.Linear`` that PEFT wraps as any
other, tests/entrypoints/test_omni_gguf.py)."""


def parse_components(value: Any) -> Any:
    """``quantize_components``: the CLI's comma-separated text as a list; each a component's name, given once."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, list | tuple):
        bad = [v for v in value if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)]
        if bad:
            raise ValueError(
                f"quantize_components are component names such as transformer or text_encoder_2; got {bad}"
            )
        repeated = sorted({v for v in value if value.count(v) > 1})
        if repeated:
            raise ValueError(f"quantize_components names {', '.join(repeated)} more than once")
    return value


def is_gguf(model: Any) -> bool | None:
    """Whether ``model`` (a `ModelSource`) is a ``.gguf`` file; ``None`` when no model is given (nothing to check)."""
    return None if model is None else bool(model.is_gguf)


def check_quantization(
    stage_id: int, values: Mapping[str, Any], written: Callable[..., str], model: Any, lora: bool
) -> None:
    """The quantization knobs against the model (a `ModelSource`, or ``None``: not known here) and the other knobs,
    after the resolver has set ``gguf`` for a ``.gguf`` file; ValueError naming each knob as it was written."""
    mode = values["quantization"]
    gguf = is_gguf(model)
    if gguf and mode != "gguf":
        raise ValueError(
            f"stage {stage_id}: {written('quantization')}, but model {model.model!r} is a GGUF file, whose denoiser "
            "loads quantized as the file holds it (quantization 'gguf'): remove quantization, or serve the base "
            "model's diffusers folder to quantize it another way"
        )
    if gguf is False and mode == "gguf":
        raise ValueError(
            f"stage {stage_id}: {written('quantization')} is what a .gguf model file sets, and model "
            f"{model.model!r} is not one: serve a .gguf file (MODEL FILE.gguf --model-config BASE), or use one of "
            f"{', '.join(q for q in QUANTIZATIONS if q != 'gguf')}"
        )
    if values["quantize_components"]:
        if mode == "none":
            raise ValueError(
                f"stage {stage_id}: {written('quantize_components')} chooses what quantization quantizes, but "
                f"{written('quantization', 'is ')}: set quantization, or remove quantize_components"
            )
        if mode == "gguf":
            raise ValueError(
                f"stage {stage_id}: {written('quantize_components')}: a GGUF file quantizes the denoiser it holds, "
                "and nothing else; remove quantize_components"
            )
    if mode in LOADING_MODES and values["load_format"] == "dummy":
        raise ValueError(
            f"stage {stage_id}: {written('quantization')} quantizes the weights as they are read from the files, "
            f"and {written('load_format', 'is ')}, which reads none: use quantization 'fp8_storage' or 'none', or "
            "load_format 'auto'"
        )
    if mode != "none" and values["cpu_offload"] == "sequential":
        raise ValueError(
            f"stage {stage_id}: {written('cpu_offload')} moves each submodule's weights by value through accelerate's "
            f"hooks, which quantized weights ({written('quantization')}) do not survive: use cpu_offload 'model'"
        )
    if lora and mode not in LORA_MODES:
        serving = written("lora_modules" if values["lora_modules"] else "enable_lora")
        why = (
            "PEFT's LoRA layer on a torchao weight takes int8 weights only"
            if mode == "fp8"
            else f"{'bitsandbytes' if mode == 'nf4' else 'GGUF'}'s LoRA layers are not served with per-row adapters"
        )
        raise ValueError(
            f"stage {stage_id}: {written('quantization')} with {serving}: {why}; serve LoRA with quantization "
            f"{' or '.join(repr(m) for m in LORA_MODES[1:] if m != 'gguf')}, or without quantization"
        )
