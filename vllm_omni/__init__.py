"""vllm-omni: serve diffusion models with vLLM; ``max_num_seqs`` sets how many requests batch together."""

from vllm_omni.diffusion.outputs import OmniRequestOutput, RequestMetrics
from vllm_omni.diffusion.request import (
    OmniDiffusionSamplingParams,
    RequestAbortedError,
    RequestFailedError,
    SamplingParamsError,
    StageUnavailableError,
)
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.version import __version__

__all__ = [
    "AsyncOmni",
    "Omni",
    "OmniDiffusionSamplingParams",
    "OmniRequestOutput",
    "RequestMetrics",
    "RequestAbortedError",
    "RequestFailedError",
    "SamplingParamsError",
    "StageUnavailableError",
    "__version__",
]
