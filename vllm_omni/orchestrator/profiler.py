"""This process's one torch profiler (`PROCESS_PROFILER`), as vLLM's ``start_profile`` / ``stop_profile`` take it.

There is one per process: the server's, whose threads run the inline replicas' engines, and one in each Ray
replica's actor. Started with ``profile_all_threads``, it records every thread of its process, the engine threads
included, whichever thread started it (a profiler of one thread would miss the engine's work); on stop it writes
one trace file with torch's ``tensorboard_trace_handler`` (``NAME.TIMESTAMP.pt.trace.json.gz``), which Perfetto
(ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profiler plugin open. `EngineProfiler`
(orchestrator/engine_profiler.py) starts and stops those of every engine process together; a Ray replica's through the
control verbs ``start_profile`` and ``stop_profile`` (`EngineCore.call`), whose handlers are here (registered when
the replica module imports this one: the diffusion layer imports nothing above it).
"""

from __future__ import annotations

import glob
import os
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from vllm_omni.diffusion.engine.control import handler
from vllm_omni.errors import ProfilerStateError
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import ProfilerConfig

logger = init_logger(__name__)


def trace_name(role: str, prefix: str | None = None) -> str:
    """A process's trace name: ``[PREFIX_]HOST_pidPID_ROLE``."""
    name = f"{socket.gethostname()}_pid{os.getpid()}_{role}"
    return name if prefix is None else f"{prefix}_{name}"


class ProcessProfiler:
    """This process's one torch profiler. Started and stopped on a thread of its own, so that a start and its stop
    happen on one thread whoever calls them; each returns a future."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-omni-profiler")
        self._profile: torch.profiler.profile | None = None
        self._name = ""
        self._folder = ""

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, config: ProfilerConfig, name: str) -> Future:
        """Start recording every thread of this process; the trace will be ``name``'s (`trace_name`)."""
        return self._thread.submit(self._start, config, name)

    def stop(self) -> Future:
        """Stop and write the trace; the future holds its path once it is written."""
        return self._thread.submit(self._stop)

    def _start(self, config: ProfilerConfig, name: str) -> None:
        import torch
        from torch.profiler import ProfilerActivity

        if self._profile is not None:
            raise ProfilerStateError(f"process {os.getpid()} is being profiled already ({self._name}): stop it first")
        names = config.torch_profiler_activities or ["CPU", *(["CUDA"] if torch.cuda.is_available() else [])]
        profile = torch.profiler.profile(
            activities=[getattr(ProfilerActivity, activity.upper()) for activity in names],
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                config.torch_profiler_dir, worker_name=name, use_gzip=config.torch_profiler_use_gzip
            ),
            experimental_config=torch.profiler._ExperimentalConfig(profile_all_threads=True),
        )
        profile.start()
        self._profile, self._name, self._folder = profile, name, config.torch_profiler_dir
        logger.info("Profiling %s into %s", name, config.torch_profiler_dir)

    def _stop(self) -> str:
        if self._profile is None:
            raise ProfilerStateError(f"process {os.getpid()} is not being profiled: start a profile first")
        pattern = os.path.join(glob.escape(self._folder), f"{glob.escape(self._name)}.*.pt.trace.json*")
        before = set(glob.glob(pattern))
        profile, self._profile = self._profile, None
        profile.stop()  # tensorboard_trace_handler writes the trace
        written = sorted(set(glob.glob(pattern)) - before)
        if len(written) != 1:
            raise RuntimeError(f"the profile of {self._name} wrote {written or 'nothing'} in {self._folder}")
        logger.info("Wrote the profile of %s: %s (%d bytes)", self._name, written[0], os.path.getsize(written[0]))
        return written[0]


PROCESS_PROFILER = ProcessProfiler()
"""The profiler of this process."""


@handler("start_profile")
def start_profile(core, config: ProfilerConfig, prefix: str | None = None) -> Future:
    """Start the profiler of the engine's process (``config``: vLLM's ``ProfilerConfig``), its trace named after the
    engine's replica: for a Ray replica, alone in its actor's process (inline replicas share the server's process,
    whose profile `EngineProfiler` starts). The future resolves once it records."""
    role = f"stage{core.od_config.stage.stage_id}-replica{core.od_config.replica}"
    return PROCESS_PROFILER.start(config, trace_name(role, prefix))


@handler("stop_profile")
def stop_profile(core) -> Future:
    """Stop `start_profile`'s profiler; the future holds the trace file once it is written."""
    return PROCESS_PROFILER.stop()
