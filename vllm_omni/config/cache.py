"""Step-cache backends (``cache_backend``): diffusers' cache hooks, and the ``cache_config`` each one takes.

The resolver checks a stage's ``cache_config`` against its backend here, before anything loads; the engine builds
the same diffusers config from it (`cache_hook_config`) when it enables the hooks (``diffusion/step_cache.py``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

CacheBackendName = Literal["none", "first_block", "taylorseer", "magcache", "faster_cache", "pab"]
"""Step caching of the denoiser: none, or one of diffusers' cache hooks (docs/performance.md)."""

CACHE_BACKENDS: dict[str, str] = {
    "first_block": "FirstBlockCacheConfig",
    "taylorseer": "TaylorSeerCacheConfig",
    "magcache": "MagCacheConfig",
    "faster_cache": "FasterCacheConfig",
    "pab": "PyramidAttentionBroadcastConfig",
}
"""Each backend's diffusers config class (in ``diffusers.hooks``)."""

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
    import diffusers.hooks

    return getattr(diffusers.hooks, CACHE_BACKENDS[backend])


def cache_config_keys(backend: str) -> list[str]:
    """The ``cache_config`` keys ``backend`` takes: its diffusers config's fields, less the callbacks (code, which a
    deploy file cannot hold) and private ones."""
    return [
        f.name
        for f in dataclasses.fields(_config_class(backend))
        if not f.name.startswith("_") and not f.name.endswith("_callback")
    ]


def cache_hook_config(backend: str, options: Mapping[str, Any], current_timestep: Callable[[], Any] | None = None):
    """The diffusers config of ``backend`` with ``options``; ValueError naming an unknown key, with the allowed
    ones, or repeating diffusers' own message for a value it refuses."""
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
