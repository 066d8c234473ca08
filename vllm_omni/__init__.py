"""vllm-omni: serve diffusion models with vLLM; ``max_num_seqs`` sets how many requests batch together."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from vllm_omni.version import __version__

if TYPE_CHECKING:
    from vllm_omni.diffusion.features.weights import WeightUpdateGroup
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.entrypoints.omni import Omni
    from vllm_omni.errors import (
        RequestAbortedError,
        RequestFailedError,
        SamplingParamsError,
        StageUnavailableError,
        WeightUpdateError,
    )
    from vllm_omni.outputs import IgnoredField, OmniRequestOutput, RequestMetrics
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

# The public names resolve on first use: importing the engines pulls in torch, diffusers and vLLM (seconds), which
# `import vllm_omni.config` (the CLI's argument checks, the deploy YAML loader) and the unit tests do not need.
_PUBLIC = {
    "AsyncOmni": "vllm_omni.entrypoints.async_omni",
    "IgnoredField": "vllm_omni.outputs",
    "Omni": "vllm_omni.entrypoints.omni",
    "OmniDiffusionSamplingParams": "vllm_omni.sampling_params",
    "OmniRequestOutput": "vllm_omni.outputs",
    "RequestMetrics": "vllm_omni.outputs",
    "RequestAbortedError": "vllm_omni.errors",
    "RequestFailedError": "vllm_omni.errors",
    "SamplingParamsError": "vllm_omni.errors",
    "StageUnavailableError": "vllm_omni.errors",
    "WeightUpdateError": "vllm_omni.errors",
    "WeightUpdateGroup": "vllm_omni.diffusion.features.weights",
}

# Spelled out (not derived from the table) so that linters and type checkers read it.
__all__ = [
    "AsyncOmni",
    "IgnoredField",
    "Omni",
    "OmniDiffusionSamplingParams",
    "OmniRequestOutput",
    "RequestMetrics",
    "RequestAbortedError",
    "RequestFailedError",
    "SamplingParamsError",
    "StageUnavailableError",
    "WeightUpdateError",
    "WeightUpdateGroup",
    "__version__",
]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
