"""The platform hint vLLM needs before its first import in this process: vLLM resolves its platform once, at the
first use of ``vllm.platforms.current_platform`` (which importing ``vllm.config`` or ``vllm.engine`` does), from
``VLLM_TARGET_DEVICE`` or what it detects; without CUDA the CUDA wheel detects nothing, and the unspecified platform it
keeps makes vLLM's ``DeviceConfig`` (and so its argument parser) fail for the rest of the process.

So every import of vLLM in this package (outside type checking) follows a call of `set_device_hint` in the same
function or module, whichever the first to run in a process: tests/test_ownership.py checks that rule on the source,
and the suite's conftest fails a test that leaves vLLM's platform unresolvable.
"""

from __future__ import annotations

import os


def set_device_hint() -> None:
    """Without CUDA, tell vLLM the CPU (see vllm/platforms); a hint already set, by the user or earlier, stays."""
    if "VLLM_TARGET_DEVICE" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
