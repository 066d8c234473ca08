"""vLLM's profiler settings (``--profiler-config``, ``profiler_config=``) as vllm-omni takes them: vLLM's own
`vllm.config.ProfilerConfig`, imported when a value is checked (vLLM takes seconds to import, and this package's
configuration stays light), and checked for what the diffusion engines can record (orchestrator/profiler.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import PlainValidator, WithJsonSchema

if TYPE_CHECKING:
    from vllm.config import ProfilerConfig

_UNSUPPORTED = {
    "capture_torch_profiler": "vLLM's CUDA-graph capture",
    "detailed_trace_annotation": "vLLM's LLM engine",
    "delay_iterations": "vLLM's engine iterations",
    "max_iterations": "vLLM's engine iterations",
    "warmup_iterations": "vLLM's engine iterations",
    "wait_iterations": "vLLM's engine iterations",
}
"""The settings the diffusion engines cannot honour, with what they belong to: refused when not at vLLM's default."""


def profiler_config(value: Any) -> ProfilerConfig | None:
    """``value`` (vLLM's `ProfilerConfig`, its fields as a mapping or JSON text, or ``None``) as vLLM's
    `ProfilerConfig`, checked: the torch profiler only (``profiler='torch'``, or ``None``: off), to a local
    ``torch_profiler_dir``, recording from start to stop. Raises ValueError naming the setting otherwise."""
    if value is None:
        return None
    from vllm_omni.config.vllm_device import set_device_hint

    set_device_hint()  # before vLLM's first import in this process
    from vllm.config import ProfilerConfig

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"profiler_config is not JSON: {value!r}") from None
    if isinstance(value, Mapping):
        value = ProfilerConfig(**value)  # vLLM's own checks (torch_profiler_dir made absolute)
    if not isinstance(value, ProfilerConfig):
        raise ValueError(f"profiler_config takes vLLM's ProfilerConfig or its fields; got {type(value).__name__}")
    if value.profiler not in (None, "torch"):
        raise ValueError(f"profiler {value.profiler!r} is not supported: the diffusion engines record with 'torch'")
    if "://" in value.torch_profiler_dir:
        raise ValueError(f"torch_profiler_dir must be a local folder; got {value.torch_profiler_dir!r}")
    default = ProfilerConfig()
    for name, belongs_to in _UNSUPPORTED.items():
        if getattr(value, name) != getattr(default, name):
            raise ValueError(
                f"{name} is not supported: it applies to {belongs_to}; a diffusion profile records everything "
                "from start_profile to stop_profile"
            )
    return value


def profiling(config: ProfilerConfig | None) -> bool:
    """Whether ``config`` turns profiling on (``profiler='torch'``)."""
    return config is not None and config.profiler is not None


ProfilerSetting = Annotated[
    Any, PlainValidator(profiler_config), WithJsonSchema({"type": ["object", "null"], "title": "ProfilerConfig"})
]
"""A `ServingConfig` field of vLLM's `ProfilerConfig` (or ``None``), checked by `profiler_config`."""
