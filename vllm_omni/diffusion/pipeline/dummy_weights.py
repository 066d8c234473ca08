"""``load_format: dummy`` (vLLM's ``--load-format dummy``): the model components of a diffusers folder built from
their configs with random weights, where they run, in the stage's dtype; nothing is read from weight files. The
classes, shapes and dtypes are those a real load gives, so the work and the memory are too, and the outputs are
noise: speed measured at full size from a folder of configs and tokenizers alone (``vllm-omni make-tiny-model DIR
--family flux --full-size --configs-only``), with nothing downloaded.

A component is built with its parameters on the ``meta`` device (accelerate's ``init_empty_weights``; its buffers,
rotary tables and position ids, are computed as usual), then each parameter is allocated on the device and filled
in place (`materialize_`), so a 12 B-parameter transformer is ready in seconds on a GPU where the classes' own
initialisation on the CPU takes minutes."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

SEED = 0
"""Every component draws from a generator seeded with it: every replica and rank holds the same weights."""

RANDOM_LIBRARIES = ("diffusers", "transformers")
"""The libraries whose model classes are built from their configs (``ModelMixin``, ``PreTrainedModel``); other
components (tokenizers, schedulers, feature extractors) load from the folder as they always do."""


def fill_(tensor: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """``tensor`` (the parameter ``name``) filled in place: a matrix or kernel from a normal distribution of standard
    deviation fan-in^-1/2, so that activations keep their scale through the layers and outputs stay finite; a
    vector named ``bias`` (or a non-float one) 0; any other vector (a norm's scale) 1."""
    if not tensor.is_floating_point() or (tensor.dim() < 2 and name == "bias"):
        tensor.zero_()
    elif tensor.dim() < 2:
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, tensor[0].numel() ** -0.5, generator=generator)


def materialize_(module: torch.nn.Module, device: torch.device, dtype: torch.dtype, float32: tuple[str, ...] = ()):
    """``module``'s ``meta`` parameters allocated on ``device`` in ``dtype`` (in float32 for a parameter under a
    submodule named in ``float32``) and filled (`fill_`), in place; a tied parameter stays one tensor. Its buffers
    move to ``device`` as they are. Returns ``module``, in eval mode."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    made: dict[int, torch.nn.Parameter] = {}
    replaced = []  # the meta parameters, alive until the end: an id is unique only among live objects
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for key, param in list(owner._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                wanted = dtype if param.is_floating_point() else param.dtype
                if float32 and set(f"{prefix}.{key}".split(".")) & set(float32):
                    wanted = torch.float32
                tensor = torch.empty(param.shape, dtype=wanted, device=device)
                fill_(tensor, key, generator)
                made[id(param)] = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
                replaced.append(param)
            owner._parameters[key] = made[id(param)]
    return module.to(device).eval()


def float32_modules(model_class: type, dtype: torch.dtype) -> tuple[str, ...]:
    """The submodules a real load keeps in float32 at ``dtype``: diffusers' ``_keep_in_fp32_modules`` always;
    transformers' ``_keep_in_fp32_modules_strict`` in a half dtype, its ``_keep_in_fp32_modules`` in float16 only."""
    if _is_diffusers(model_class):
        return tuple(getattr(model_class, "_keep_in_fp32_modules", None) or ())
    names = list(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ()) if dtype != torch.float32 else []
    if dtype == torch.float16:
        names += list(getattr(model_class, "_keep_in_fp32_modules", None) or ())
    return tuple(names)


def _is_diffusers(cls: type) -> bool:
    from diffusers.models.modeling_utils import ModelMixin

    return issubclass(cls, ModelMixin)


def meta_model(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model ``build`` makes (a diffusers or transformers model class called on its config) with its parameters
    on the ``meta`` device: its shapes, no memory."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # a transformers model: accelerate's meta parameters untied what it tied
        tie()
    return model


def random_model(build: Callable[[], torch.nn.Module], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model ``build`` makes, built on the ``meta`` device (`meta_model`) and then materialised with random
    weights (`materialize_`)."""
    model = meta_model(build)
    return materialize_(model, device, dtype, float32_modules(type(model), dtype))


def model_class(library: str, class_name: str) -> type | None:
    """The class ``library.class_name`` if it is a diffusers or transformers model (built from its config), else
    ``None`` (loaded from the folder)."""
    if library not in RANDOM_LIBRARIES:
        return None
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    found = getattr(importlib.import_module(library), class_name, None)
    return found if isinstance(found, type) and issubclass(found, ModelMixin | PreTrainedModel) else None


def from_config(cls: type, folder: str) -> Callable[[], torch.nn.Module]:
    """What builds ``cls`` from the ``config.json`` in ``folder``, as its ``from_pretrained`` would."""
    if _is_diffusers(cls):
        config = cls.load_config(folder)  # type: ignore[attr-defined]
        return lambda: cls.from_config(config)  # type: ignore[attr-defined]
    config = cls.config_class.from_pretrained(folder)  # type: ignore[attr-defined]
    return lambda: cls(config)


def dummy_components(
    model: str, dtype: torch.dtype, device: torch.device, skips: tuple[str, ...] = ()
) -> dict[str, torch.nn.Module]:
    """Each diffusers or transformers model component that the folder ``model``'s ``model_index.json`` names (but
    ``skips``), built from its ``config.json`` with random weights on ``device``: the components to pass to
    ``from_pretrained``, which then loads only the others."""
    with open(os.path.join(model, "model_index.json"), encoding="utf-8") as file:
        index = json.load(file)
    built = {}
    for name, entry in index.items():
        if name.startswith("_") or name in skips or not (isinstance(entry, list) and len(entry) == 2):
            continue
        cls = model_class(*entry) if all(isinstance(part, str) for part in entry) else None
        if cls is not None:
            built[name] = random_model(from_config(cls, os.path.join(model, name)), device, dtype)
    return built


def pipeline_loader(index: Mapping[str, Any], passed: bool) -> Any:
    """The class whose ``from_pretrained`` loads the folder of ``index`` (its ``model_index.json``):
    ``DiffusionPipeline``, or where some components are ``passed`` already built (random ones, a GGUF denoiser), the
    pipeline's own class: ``DiffusionPipeline.from_pretrained`` loads an optional component (Wan's transformer) from
    the folder even when it is passed, and such a folder holds no weights for it."""
    import diffusers

    name = index.get("_class_name")
    if passed and isinstance(name, str) and isinstance(getattr(diffusers, name, None), type):
        return getattr(diffusers, name)
    return diffusers.DiffusionPipeline
