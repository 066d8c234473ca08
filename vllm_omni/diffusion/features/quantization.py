"""What a stage loads quantized (``quantization`` and ``quantize_components``; docs/quantization.md), with diffusers'
own pieces and no kernel of ours: a ``PipelineQuantizationConfig`` of torchao or bitsandbytes configs given to
``from_pretrained`` (``int8``, ``fp8``, ``nf4``), ``enable_layerwise_casting`` after it (``fp8_storage``). A
component saved quantized (its ``config.json`` holds a ``quantization_config``) loads as saved; ``gguf`` is loaded by
the single-file path. The checks that need the model's files or the device are made here, when the stage loads;
those of the knobs alone are `vllm_omni.config.quantization`'s.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.config.resolver import knob_as_written
from vllm_omni.diffusion.features.gguf import gguf_components
from vllm_omni.diffusion.pipeline.components import DENOISERS
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.errors import SleepModeError, WeightUpdateError

if TYPE_CHECKING:
    pass

STORAGE_DTYPE = torch.float8_e4m3fn
"""What ``fp8_storage`` stores weights in."""
FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability torchao's float8 matmuls need (Ada, Hopper and later)."""
RELOADABLE = ("fp8_storage",)
"""Quantized components whose weights the model's files still describe: a weight read from them (sleep level 2's
wake-up, a weight update) is cast to the storage dtype as the load cast it. Every other quantized component holds
weights its files do not (quantized as it loaded, or saved quantized), so it cannot take either."""


def torchao_config(mode: str):
    """The torchao config of ``int8`` (int8 weight-only) and ``fp8`` (float8 weights and dynamic activations)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Int8WeightOnlyConfig

    return Int8WeightOnlyConfig() if mode == "int8" else Float8DynamicActivationFloat8WeightConfig()


def component_config(mode: str, library: str, dtype: torch.dtype):
    """The quantization config of one component made by ``library`` (``diffusers`` or ``transformers``) in ``mode``:
    what stock diffusers is given for it in a ``PipelineQuantizationConfig(quant_mapping=...)``."""
    import diffusers
    import transformers

    module = diffusers if library == "diffusers" else transformers
    if mode == "nf4":
        return module.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return module.TorchAoConfig(torchao_config(mode))


def enable_fp8_storage(module: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """Layerwise casting of one component: diffusers' ``enable_layerwise_casting`` (with the model's own skip
    patterns), or for a transformers model ``apply_layerwise_casting`` with diffusers' default patterns and the
    model's ``_keep_in_fp32_modules``, its embeddings left as they are (a transformers model reports the dtype of
    its first parameter, the embedding, and pipelines make their tensors in that dtype)."""
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
    from diffusers.models.modeling_utils import ModelMixin

    if isinstance(module, ModelMixin):
        module.enable_layerwise_casting(storage_dtype=STORAGE_DTYPE, compute_dtype=compute_dtype)
        return
    keep = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    apply_layerwise_casting(
        module,
        STORAGE_DTYPE,
        compute_dtype,
        skip_modules_pattern=DEFAULT_SKIP_MODULES_PATTERN + keep,
        skip_modules_classes=(torch.nn.Embedding,),
    )


def parameter_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters as stored: a quantized tensor subclass (torchao's) counts the tensors it
    holds (its data and scales), bitsandbytes' and GGUF's packed bytes."""

    def size(tensor: torch.Tensor) -> int:
        if hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            return sum(size(getattr(tensor, name)) for name in names)
        return tensor.numel() * tensor.element_size()

    return sum(size(p) for p in {id(p): p for p in module.parameters()}.values())


def _saved_method(config: dict[str, Any]) -> tuple[str | None, str]:
    """A folder's ``quantization_config``: the ``quantization`` value it equals (or ``None``) and how to name it."""
    method = str(config.get("quant_method", "unknown"))
    if method == "torchao":
        kind = (config.get("quant_type") or {}).get("default", {}).get("_type", "")
        mode = "int8" if kind == "Int8WeightOnlyConfig" else "fp8" if kind.startswith("Float8") else None
        return mode, f"torchao {kind}".strip()
    if method == "bitsandbytes":
        if config.get("load_in_4bit"):
            kind = config.get("bnb_4bit_quant_type", "fp4")
            return ("nf4" if kind == "nf4" else None), f"bitsandbytes {kind}"
        return None, "bitsandbytes int8"
    return None, method


@dataclass
class QuantizationPlan:
    """What one stage quantizes as it loads, and what it loads quantized as saved."""

    mode: str = "none"
    dtype: torch.dtype = torch.float32
    quantize: dict[str, str] = field(default_factory=dict)
    """The components this stage quantizes as they load, by name, with the library that made each."""
    saved: dict[str, str] = field(default_factory=dict)
    """The components this stage loads quantized as the folder saved them, with how
    (``torchao Int8WeightOnlyConfig``)."""

    @classmethod
    def of(
        cls, model: str, stage: StageDeployConfig, device: torch.device, dtype: torch.dtype, skips: tuple[str, ...]
    ) -> QuantizationPlan:
        """The plan of ``stage`` for the diffusers folder ``model``; ValueError, naming the knob as it was written, for
        a component the model lacks, a mode the device cannot run, or a knob the folder contradicts."""
        with open(os.path.join(model, "model_index.json"), encoding="utf-8") as f:
            index = json.load(f)
        modules = {  # the torch components: those with a config.json (not tokenizers, schedulers, processors)
            name: entry[0]
            for name, entry in index.items()
            if isinstance(entry, list) and entry[0] and os.path.isfile(os.path.join(model, name, "config.json"))
        }
        mode, written = stage.quantization, knob_as_written(stage, "quantization")
        unknown = [name for name in stage.quantize_components if name not in modules]
        if unknown:
            raise ValueError(
                f"{knob_as_written(stage, 'quantize_components')} names {', '.join(unknown)}, which "
                f"{index.get('_class_name', 'the pipeline')} in {model} does not have; its components: "
                f"{', '.join(sorted(modules))}"
            )
        loaded = [name for name in modules if name not in skips]
        targets = [n for n in stage.quantize_components or DENOISERS if n in loaded]
        plan = cls(mode=mode, dtype=dtype)
        ggufs = gguf_components(model, index)
        for name in loaded:
            if name in ggufs:  # the single-file path loads it from the file (vllm_omni.diffusion.features.gguf)
                plan.saved[name] = f"gguf ({os.path.basename(ggufs[name])})"
                continue
            config = _read_config(model, name).get("quantization_config")
            if config is None:
                continue
            same, how = _saved_method(config)
            if mode != "none" and name in targets and same != mode:
                raise ValueError(
                    f"{written} would quantize {name}, which {os.path.join(model, name, 'config.json')} holds "
                    f"quantized already ({how}): remove quantization to load it as saved, or leave {name} out of "
                    "quantize_components"
                )
            if config.get("quant_method") == "bitsandbytes" and device.type != "cuda":
                raise ValueError(
                    f"{name} of {model} is saved in bitsandbytes' {how}, which runs on CUDA; "
                    f"this stage runs on {device}"
                )
            plan.saved[name] = how
        if mode in ("int8", "fp8", "nf4"):
            plan.quantize = {name: modules[name] for name in targets if name not in plan.saved}
            other = sorted({lib for lib in plan.quantize.values() if lib not in ("diffusers", "transformers")})
            if other:
                raise ValueError(f"{written}: diffusers quantizes diffusers and transformers models, not {other}")
        elif mode == "fp8_storage":
            plan.quantize = {name: modules[name] for name in targets}
        if plan.quantize:
            plan._check_device(device, written)
        return plan

    def _check_device(self, device: torch.device, written: str) -> None:
        if self.mode == "nf4" and device.type != "cuda":
            raise ValueError(
                f"{written}: bitsandbytes' 4-bit kernels run on CUDA, and this stage runs on {device} (no CUDA "
                "device): use int8 or fp8_storage"
            )
        if self.mode == "fp8":
            if device.type != "cuda":
                raise ValueError(
                    f"{written}: torchao's float8 matmuls run on CUDA devices of compute capability 8.9 or higher, "
                    f"and this stage runs on {device} (no CUDA device): use int8 or fp8_storage"
                )
            capability = torch.cuda.get_device_capability(device)
            if capability < FP8_CAPABILITY:
                raise ValueError(
                    f"{written}: torchao's float8 matmuls need a CUDA device of compute capability 8.9 or higher, and "
                    f"{device} ({torch.cuda.get_device_name(device)}) has {capability[0]}.{capability[1]}: use int8 "
                    "or fp8_storage"
                )
        module, package = {
            "int8": ("torchao",) * 2,
            "fp8": ("torchao",) * 2,
            "nf4": ("bitsandbytes", "vllm-omni[nf4]"),
        }.get(self.mode, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ValueError(f"{written} needs {module}, which is not installed: pip install '{package}'")

    def pipeline_config(self):
        """The ``quantization_config`` for ``DiffusionPipeline.from_pretrained``, or ``None``."""
        if self.mode not in ("int8", "fp8", "nf4") or not self.quantize:
            return None
        from diffusers import PipelineQuantizationConfig

        mapping = {name: component_config(self.mode, lib, self.dtype) for name, lib in self.quantize.items()}
        return PipelineQuantizationConfig(quant_mapping=mapping)

    def apply(self, pipeline) -> None:
        """What follows ``from_pretrained``: ``fp8_storage``'s layerwise casting."""
        if self.mode == "fp8_storage":
            for name in self.quantize:
                enable_fp8_storage(getattr(pipeline, name), self.dtype)

    @property
    def quantized(self) -> dict[str, str]:
        """Every component the stage holds quantized, with how."""
        how = {"int8": "torchao int8 weight-only", "fp8": "torchao float8", "nf4": "bitsandbytes nf4"}
        how["fp8_storage"] = f"float8 storage, {str(self.dtype).removeprefix('torch.')} compute"
        return {name: how.get(self.mode, self.mode) for name in self.quantize} | {
            name: f"{saved} (as saved)" for name, saved in self.saved.items()
        }

    def describe(self) -> str:
        """The quantized components for the stage's start-up log line."""
        return ", ".join(f"{name} {how}" for name, how in self.quantized.items()) or "none"

    def _fixed(self, components) -> list[str]:
        """Those of ``components`` whose weights the model's files do not hold as they run (a GGUF denoiser is
        `vllm_omni.diffusion.features.gguf`'s to refuse)."""
        return [
            name
            for name in components
            if (name in self.saved and not self.saved[name].startswith("gguf"))
            or (name in self.quantize and self.mode not in RELOADABLE)
        ]

    def check_sleep(self, level: int) -> None:
        """Refuse level 2 where a component's files cannot give back the weights it holds (`SleepModeError`)."""
        fixed = self._fixed(self.quantized)
        if level == 2 and fixed:
            raise SleepModeError(
                "level",
                f"level 2 drops the weights and wake_up reloads them from the model's files, which do not hold "
                f"{', '.join(f'{n} as it runs ({self.quantized[n]})' for n in fixed)}: use level 1",
            )

    def check_update(self, component: str) -> None:
        """Refuse a weight update of a component whose quantized weights a full-precision copy cannot replace."""
        if self._fixed([component]):
            raise WeightUpdateError(
                None,
                f"{component} runs quantized ({self.quantized[component]}), and an update copies full-precision "
                f"weights: serve it unquantized (quantize_components without it) or with fp8_storage to update it",
            )


class QuantizationExtension(Extension):
    """``quantization`` as an extension (`vllm_omni.diffusion.pipeline.extensions`): its plan is made before the
    pipeline loads (`load_pipeline` loads with it), and it refuses sleep level 2 and weight updates of what the
    model's files cannot give back (`QuantizationPlan.check_sleep`, `QuantizationPlan.check_update`)."""

    name = "quantization"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.plan = QuantizationPlan.of(od_config.model, od_config.stage, device, dtype, skips)
        """What the stage holds quantized (``quantization``, or a folder saved quantized)."""

    def refuse(self, verb: str, argument: Any) -> None:
        if verb == "sleep":
            self.plan.check_sleep(argument)
        elif verb == "update_weights":
            self.plan.check_update(argument)


def _read_config(model: str, name: str) -> dict[str, Any]:
    with open(os.path.join(model, name, "config.json"), encoding="utf-8") as f:
        return json.load(f)
