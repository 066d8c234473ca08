"""Step-cache backends (``cache_backend``): diffusers' cache hooks and cache-dit, and the ``cache_config`` each one
takes.

The resolver checks a stage's ``cache_config`` against its backend here, before anything loads; the engine builds
the same config from it (`cache_hook_config`) when it enables the cache (``diffusion/features/step_cache.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

CACHE_BACKENDS: dict[str, tuple[str, str]] = {
    "first_block": ("diffusers.hooks", "FirstBlockCacheConfig"),
    "taylorseer": ("diffusers.hooks", "TaylorSeerCacheConfig"),
    "magcache": ("diffusers.hooks", "MagCacheConfig"),
    "faster_cache": ("diffusers.hooks", "FasterCacheConfig"),
    "pab": ("diffusers.hooks", "PyramidAttentionBroadcastConfig"),
    "cache_dit": ("cache_dit", "DBCacheConfig"),
}
"""Each backend's config class: (module, class name)."""

CacheBackendName = Literal["none", "first_block", "taylorseer", "magcache", "faster_cache", "pab", "cache_dit"]
"""Step caching of the denoiser: none, one of diffusers' cache hooks, or cache-dit (docs/performance.md). Spelled
out for the type checker: "none", then the table's keys in its order (tests/config/test_cache_knobs.py checks)."""

REFUSED_BACKENDS = ("faster_cache",)
"""Backends no pipeline served here can run: diffusers' FasterCache needs the negative and positive rows of
classifier-free guidance in one denoiser call, and Flux and Wan make two."""

WHOLE_CALL_BACKENDS = ("cache_dit",)
"""Backends whose cache context and decisions cover a whole pipeline call, all its rows together: they can serve one
request per call only (``max_num_seqs`` 1, request mode)."""

PER_REQUEST_BACKENDS = tuple(b for b in CACHE_BACKENDS if b not in (*WHOLE_CALL_BACKENDS, *REFUSED_BACKENDS))
"""Backends that decide for each request on its own, in any batch and in step mode: what a refusal suggests."""

CALL_SUPPLIED_KEYS: dict[str, tuple[str, ...]] = {"cache_dit": ("num_inference_steps",)}
"""Config fields the engine sets for every call, from the request (not ``cache_config`` keys)."""

TIMESTEP_CALLBACK = "current_timestep_callback"
"""The config field of the hooks that skip by timestep range; the engine supplies it (each request's timestep)."""


def parse_cache_config(value: Any) -> Any:
    """The CLI's JSON text as a mapping (anything else is left to validation)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cache_config must be a JSON object such as '{{\"threshold\": 0.2}}' ({exc})") from None
    return value


def _config_class(backend: str) -> type:
    module, name = CACHE_BACKENDS[backend]
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise ValueError(
            f"cache_backend {backend!r} needs the {module.replace('_', '-')} package: "
            f"pip install 'vllm-omni[{module.replace('_', '-')}]'"
        ) from None


def cache_config_keys(backend: str) -> list[str]:
    """The ``cache_config`` keys ``backend`` takes: its config's fields, less the callbacks (code, which a deploy
    file cannot hold), the fixed ones (an enum default: cache-dit's ``cache_type``), those the engine sets per call
    and private ones."""
    return [
        f.name
        for f in dataclasses.fields(_config_class(backend))
        if not f.name.startswith("_")
        and not f.name.endswith("_callback")
        and not isinstance(f.default, enum.Enum)
        and f.name not in CALL_SUPPLIED_KEYS.get(backend, ())
    ]


def cache_hook_config(backend: str, options: Mapping[str, Any], current_timestep: Callable[[], Any] | None = None):
    """The config of ``backend`` with ``options``; ValueError naming an unknown key, with the allowed ones, or
    repeating the backend's own message for a value it refuses."""
    import torch

    allowed = cache_config_keys(backend)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"cache_config key(s) {', '.join(unknown)} are not taken by cache_backend {backend!r}; "
            f"allowed: {', '.join(allowed)}"
        )
    cls = _config_class(backend)
    values = dict(options)
    for f in dataclasses.fields(cls):
        if isinstance(f.default, torch.dtype) and isinstance(values.get(f.name), str):  # JSON names a dtype
            values[f.name] = getattr(torch, values[f.name])
    if TIMESTEP_CALLBACK in {f.name for f in dataclasses.fields(cls)}:
        values[TIMESTEP_CALLBACK] = current_timestep or (lambda: 0)
    try:
        return cls(**values)
    except (TypeError, ValueError, AttributeError) as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"cache_config {dict(options)!r} for cache_backend {backend!r}: {message}") from None
