"""The platform hint vLLM needs before its first import in this process: vLLM reads ``VLLM_TARGET_DEVICE`` once,
and without CUDA it infers no device, after which its argument parser fails. Both the serve CLI and the llm
stage's key checks (which import vLLM's ``EngineArgs``) set it first."""

from __future__ import annotations

import os


def set_device_hint() -> None:
    """Without CUDA, tell vLLM the CPU (see vllm/platforms)."""
    if "VLLM_TARGET_DEVICE" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
