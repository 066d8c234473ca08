"""Servers forked from a process that has already imported the serving stack.

A ``vllm serve MODEL --omni`` interpreter spends most of its start importing vLLM, torch, diffusers and
transformers again. The tests start dozens of servers, so `RemoteOmniServer` can instead ask a
`multiprocessing` forkserver whose preload is this module: it imports the stack once, and each server is a
fork of it that runs vLLM's own CLI ``main`` on the same argv (`serve`), in a session of its own, with its output
in the log file. Everything after the imports is the real CLI: argument parsing, the resolver, the engine, uvicorn,
SIGTERM and the drain, the exit code.

A fork runs with the starter's environment as it is when the server starts; what it cannot give is an environment
read at import time (``HF_HUB_OFFLINE``, Ray's signal handler,
``VLLM_TARGET_DEVICE``): those were read once, by the forkserver. A server with an environment of its own is
therefore started as a real ``vllm`` process (`RemoteOmniServer` decides).
"""

from __future__ import annotations

import sys

from vllm_omni.config.vllm_device import set_device_hint

# Imported here, in the forkserver, so that every fork starts with them (the forkserver's preload).
set_device_hint()  # vLLM reads its platform once, at its first import: as the CLI sets it before
# Everything a server imports before it loads its model, found with ``python -X importtime`` on a real start:
# vLLM's serve parser (its engine arguments import vllm.config and the quantization registry), its executors,
# our API server and diffusers' pipeline registry (the auto pipelines import every pipeline class).
# vllm_omni.diffusion first: it tells diffusers, before diffusers' first import, that flashinfer is absent on a host
# without CUDA (2 s of CPU per forkserver otherwise).
import vllm_omni.diffusion  # noqa: E402, F401, I001
import diffusers  # noqa: E402, F401
import diffusers.pipelines.auto_pipeline  # noqa: E402, F401
import torch  # noqa: E402, F401
import vllm.entrypoints.cli.main  # noqa: E402
import vllm.entrypoints.common.cli_args  # noqa: E402, F401
import vllm.v1.executor  # noqa: E402, F401

import vllm_omni.entrypoints.cli.serve  # noqa: E402, F401
import vllm_omni.entrypoints.openai.api_server  # noqa: E402, F401


def serve(argv: list[str]) -> None:
    """A fork's body once `vllm_omni.testing.processes.server` set up its session, directory, environment and log:
    vLLM's CLI
    as the ``vllm`` script runs it."""
    sys.argv = argv
    vllm.entrypoints.cli.main.main()
