"""LoRA adapters given as tensors rather than a file (``add_lora(name, tensors, peft_config)``): the tensors and
their PEFT config as plain data, and how diffusers' ``load_lora_weights`` takes them with that config. `LoraAdapters`
(`adapters.py`) keeps them while the adapter is served, so that one evicted loads again."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.diffusion.pipeline.components import DENOISERS

TENSOR_SOURCE = "tensors://"
"""How the source of an adapter given as tensors begins: it stands where a file's path would (`LoraSelection.path`,
`LoraAdapters.resident`, the listing), and names no file."""


@dataclass(frozen=True)
class LoraTensors:
    """An adapter given as tensors (``add_lora(name, tensors, peft_config)``): its state dict as diffusers'
    ``save_lora_weights`` writes it (``transformer.…lora_A.weight``; keys without a component prefix are the
    denoiser's), and its PEFT config as a dict: what diffusers reads from a file's adapter metadata. Plain data,
    sent to Ray replicas through the object store."""

    tensors: dict[str, Any]
    config: dict[str, Any]

    @classmethod
    def of(cls, tensors: Mapping[str, Any], peft_config: Any) -> LoraTensors:
        """Checked: a non-empty mapping of names to tensors, and a ``peft.LoraConfig`` or the keywords of one."""
        from peft import LoraConfig

        if not isinstance(tensors, Mapping) or not tensors:
            raise ValueError("a LoRA adapter given as tensors needs a non-empty mapping of names to tensors")
        if bad := next((k for k, v in tensors.items() if not isinstance(v, torch.Tensor)), None):
            raise ValueError(f"LoRA tensor {bad!r} is a {type(tensors[bad]).__name__}, not a torch.Tensor")
        if peft_config is None:
            raise ValueError("a LoRA adapter given as tensors needs its peft_config (a peft.LoraConfig or a dict)")
        if isinstance(peft_config, Mapping):
            try:
                peft_config = LoraConfig(**peft_config)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"peft_config is not a LoraConfig's keywords: {exc}") from exc
        if not isinstance(peft_config, LoraConfig):
            raise ValueError(f"peft_config is a {type(peft_config).__name__}: give a peft.LoraConfig or a dict")
        return cls(dict(tensors), peft_config.to_dict())

    def copy(self) -> LoraTensors:
        """Its own copy of the tensors (on the engine's thread): a caller that changes its tensors in place later
        does not change the adapter, which loads again from them after an eviction."""
        return LoraTensors({k: v.detach().clone() for k, v in self.tensors.items()}, self.config)

    @staticmethod
    def source(name: str) -> str:
        """A new source tag for adapter ``name`` (a new one each time it is given, so a replica can tell them apart)."""
        return f"{TENSOR_SOURCE}{name}/{uuid.uuid4().hex[:12]}"

    def state_dict(self, pipeline) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tensors keyed as ``load_lora_weights`` reads them, and the adapter metadata of each component they
        adapt (``{component}.{key}``, as diffusers packs it in a file)."""
        names = set(pipeline.components)
        state = dict(self.tensors)
        if not any(key.split(".", 1)[0] in names for key in state):
            denoiser = next((n for n in DENOISERS if getattr(pipeline, n, None) is not None), None)
            state = {f"{denoiser}.{key}": value for key, value in state.items()}
        prefixes = {key.split(".", 1)[0] for key in state} & names
        return state, {f"{prefix}.{k}": v for prefix in prefixes for k, v in self.config.items()}


@contextlib.contextmanager
def adapter_metadata(pipeline, metadata: dict[str, Any]):
    """Make ``pipeline.load_lora_weights`` read ``metadata`` with an in-memory state dict: diffusers reads an
    adapter's config (``lora_alpha``, ``rank_pattern``, ...) only from a file's header, and infers the rest from the
    tensors (alpha = rank) otherwise. Every loader reads it as the last item of ``lora_state_dict``'s answer."""
    read = pipeline.lora_state_dict

    def lora_state_dict(*args, **kwargs):
        answer = read(*args, **kwargs)
        if not kwargs.get("return_lora_metadata"):
            return answer
        if not isinstance(answer, tuple) or answer[-1] is not None:
            raise ValueError(f"{type(pipeline).__name__} cannot take an adapter's peft_config with its tensors")
        return (*answer[:-1], metadata)

    pipeline.lora_state_dict = lora_state_dict
    try:
        yield
    finally:
        del pipeline.lora_state_dict
