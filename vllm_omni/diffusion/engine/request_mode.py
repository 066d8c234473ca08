"""The request engine (``execution_mode: request``): ``schedule → run → finish``, one call of the stage's role per
batch."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.core import EngineCore
from vllm_omni.diffusion.engine.denoise import run_isolated
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import BatchScheduler, adapters_of
from vllm_omni.logger import init_logger
from vllm_omni.outputs import RequestMetrics

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.roles import StageRole

logger = init_logger(__name__)


class RequestEngine(EngineCore):
    """A batch runs together from its first step to its last: one call of the role per batch."""

    def __init__(self, od_config: OmniDiffusionConfig, role: type[StageRole]):
        super().__init__(od_config, BatchScheduler(od_config), role)
        self.scheduler.on_schedule = self._started

    @property
    def has_unfinished(self) -> bool:
        """Whether accepted requests are still in the engine (a batch ends within `step`, so never here)."""
        return False

    def step(self, timeout: float | None = None) -> int:
        """Run at most one batch: schedule, run, finish; returns how many requests it held (0 if none was due in
        ``timeout``)."""
        self.scheduler.run_calls()
        batch = self.scheduler.schedule(timeout)  # observed by `_started`
        if not batch:
            return 0
        outputs = run_isolated(
            self._run, batch, what="request", name=lambda r: r.request_id, on_oom_split=self._on_oom_split
        )
        group = self.runner.group
        if group is not None and group.lost is not None:  # the replica is down: its loop ends, failing the batch
            raise RuntimeError(group.lost)
        self.scheduler.finish(batch, outputs)
        return len(batch)

    def _started(self, batch: list[DiffusionRequest]) -> None:
        """The scheduler's observer: a batch starts now; each request's queue time, and the admission decision."""
        started = time.monotonic()
        logger.debug(  # the batch scheduler's admission decision, as the report in docs/observability.md reads it
            "admission wait done waiting=%d max_batch=%d batch=%d waited_ms=%.1f",
            *(self.scheduler.num_waiting + len(batch), self.scheduler.capacity, len(batch)),
            (started - batch[0].arrival_time) * 1000.0,
        )
        for request in batch:
            request.started_time = started
            self.metrics.queue_time.observe(started - request.arrival_time)

    def _run(self, batch: list[DiffusionRequest]) -> list:
        """One call of the role for ``batch`` (all of a scheduled batch, or part of one that failed)."""
        self.metrics.batch_num_requests.observe(len(batch))
        started = time.monotonic()
        with self.metrics.batch_execution_time.time(), torch.inference_mode(), self.timer.recording(batch):
            self.runner.load_adapters(batch, keep=adapters_of(batch))
            results = self.role.run(batch)
        finished = time.monotonic()
        self.timer.log_batch(self.od_config.stage.stage_id, batch)
        return [
            result
            if isinstance(result, BaseException)
            else self.output(
                request,
                result,
                RequestMetrics(
                    batch_size=len(batch),
                    queue_ms=(request.started - request.arrival_time) * 1000.0,
                    exec_ms=(finished - started) * 1000.0,
                    seed=request.seed,
                    replica=self.od_config.replica,
                    weights_version=self.weights_version,
                ),
            )
            for request, result in zip(batch, results, strict=True)
        ]

    def shutdown(self) -> None:
        """Release what the engine holds once its loop has stopped: its ranks, if it has several."""
        if self.runner.group is not None:
            self.runner.group.close()
