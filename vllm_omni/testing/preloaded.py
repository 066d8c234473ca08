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

import os
import sys

from vllm_omni.config.vllm_device import set_device_hint

# Imported here, in the forkserver, so that every fork starts with them (the forkserver's preload).
set_device_hint()  # vLLM reads its platform once, at its first import: as the CLI sets it before
# Everything a server imports before it loads its model, found with ``python -X importtime`` on a real start:
# vLLM's serve parser (its engine arguments import vllm.config and the quantization registry), its executors,
# our API server and diffusers' pipeline registry (the auto pipelines import every pipeline class).
import diffusers  # noqa: E402, F401
import diffusers.pipelines.auto_pipeline  # noqa: E402, F401
import torch  # noqa: E402, F401
import vllm.entrypoints.cli.main  # noqa: E402
import vllm.entrypoints.common.cli_args  # noqa: E402, F401
import vllm.v1.executor  # noqa: E402, F401

import vllm_omni.entrypoints.cli.serve  # noqa: E402, F401
import vllm_omni.entrypoints.openai.api_server  # noqa: E402, F401


def serve(argv: list[str], log_path: str | None, cwd: str, environ: dict[str, str]) -> None:
    """A fork's body: a session of its own (so that a process-group kill reaches what it starts, as for a
    ``Popen(start_new_session=True)``), the starter's working directory and environment, stdout and stderr to the
    log, then vLLM's CLI as the ``vllm`` script runs it."""
    os.setsid()
    os.chdir(cwd)
    os.environ.update(environ)  # over what the preload set (the device hint), which the starter may lack
    log = os.open(log_path or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = argv
    vllm.entrypoints.cli.main.main()
