"""`EngineProfiler`: vLLM's ``start_profile`` / ``stop_profile`` over every engine process of a deploy, each
recorded by its own torch profiler (orchestrator/profiler.py)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from vllm_omni.config import STAGE_TYPES
from vllm_omni.config.profiler import profiling
from vllm_omni.config.vllm_device import set_device_hint
from vllm_omni.errors import ProfilerStateError
from vllm_omni.logger import init_logger
from vllm_omni.orchestrator.profiler import PROCESS_PROFILER, trace_name
from vllm_omni.orchestrator.replica import Replica, ReplicaLostError

if TYPE_CHECKING:
    from vllm.config import ProfilerConfig

    from vllm_omni.orchestrator.stage_runtime import StageRuntime

logger = init_logger(__name__)


class EngineProfiler:
    """Profiles of this process (the inline replicas' engine threads, and the serving itself unless the config's
    ``ignore_frontend``) and of every live Ray replica of the diffusers stages, one trace file each, started and
    stopped together, one session at a time. An llm stage's vLLM engine is not profiled."""

    def __init__(self, stages: list[StageRuntime], config: ProfilerConfig | None):
        self.config = config
        self._stages = [stage for stage in stages if STAGE_TYPES[stage.stage_config.stage_type].runs != "vllm"]
        self._inline = [stage for stage in self._stages if stage.stage_config.distributed_executor_backend != "ray"]
        self._lock = threading.Lock()
        self._started: list[Replica] | None = None
        """The Ray replicas recording in this session; ``None`` when there is none."""
        self._here = False
        """Whether this process records in this session."""

    @property
    def active(self) -> bool:
        """Whether a session records now."""
        return self._started is not None

    def _role(self) -> str:
        """This process's part of its trace name: ``server``, then its inline replicas."""
        replicas = [f"stage{stage.stage_id}-replica{r.info.index}" for stage in self._inline for r in stage.replicas]
        return "_".join(["server", *replicas])

    def start(self, prefix: str | None = None) -> None:
        """Start recording in every engine process; returns once all record. ``prefix`` (vLLM's
        ``profile_prefix``) begins each trace's name. Raises `ProfilerStateError` when profiling is off or a
        session records already."""
        with self._lock:
            if not profiling(self.config):
                raise ProfilerStateError(
                    "profiling is off: start the server with --profiler-config "
                    '\'{"profiler": "torch", "torch_profiler_dir": "DIR"}\' (in Python: profiler_config=...)'
                )
            if self._started is not None:
                raise ProfilerStateError("a profile is being recorded already: stop it first (POST /stop_profile)")
            set_device_hint()
            from vllm.config.profiler import validate_profile_prefix

            validate_profile_prefix(prefix)
            assert self.config is not None, "profiling(config) holds"
            self._here = bool(self._inline) or not self.config.ignore_frontend
            if self._here:
                PROCESS_PROFILER.start(self.config, trace_name(self._role(), prefix)).result()
            remote = [r for stage in self._stages if stage not in self._inline for r in stage.replicas if r.is_alive]
            self._started, failure = [], None
            for replica, future in [(r, r.call("start_profile", self.config, prefix)) for r in remote]:
                try:
                    future.result()
                    self._started.append(replica)
                except ReplicaLostError as exc:  # restarting: it is not recorded
                    logger.warning("replica %d is not profiled: %s", replica.info.index, exc)
                except Exception as exc:  # noqa: BLE001 - raised once the others are stopped
                    failure = failure or exc
            if failure is not None:
                self._stop()
                raise failure

    def stop(self) -> list[str]:
        """Stop every recording; returns the trace files, once all are written. Raises `ProfilerStateError` when no
        session records."""
        with self._lock:
            if self._started is None:
                raise ProfilerStateError("no profile is being recorded: start one first (POST /start_profile)")
            return self._stop()

    def _stop(self) -> list[str]:
        started, self._started = self._started, None
        assert started is not None, "called while a session records"
        futures = [replica.call("stop_profile") for replica in started]
        written = [PROCESS_PROFILER.stop().result()] if self._here else []
        for replica, future in zip(started, futures, strict=True):
            try:
                written.append(future.result())
            except Exception as exc:  # noqa: BLE001 - restarted meanwhile: its trace was lost with its process
                logger.warning("the profile of replica %d is lost: %s", replica.info.index, exc)
        return written
