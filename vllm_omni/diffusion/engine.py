"""The diffusion engine core: ``schedule → run → finish``, one batch per step."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import (
    DiffusionRequest,
    OmniDiffusionSamplingParams,
    OmniRequestOutput,
)
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.diffusion.scheduler import Scheduler
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics

logger = init_logger(__name__)


class DiffusionEngine:
    def __init__(self, od_config: OmniDiffusionConfig):
        self.od_config = od_config
        self.runner = DiffusionRunner(od_config)
        self.scheduler = Scheduler(od_config)
        self._labels = (str(od_config.stage_id), "video" if self.runner.is_video else "image")

    def add_request(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams) -> Future:
        """Queue a request; the returned future resolves to its `OmniRequestOutput`."""
        request = DiffusionRequest.create(request_id, prompt, self.runner.complete_params(params))
        self.scheduler.add(request)
        return request.future

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def step(self, timeout: float | None = None) -> int:
        """Run at most one batch; returns how many requests it held (0 if none was due in ``timeout``)."""
        batch = self.scheduler.schedule(timeout)
        if not batch:
            return 0
        started = time.monotonic()
        for request in batch:
            metrics.queue_time.labels(*self._labels).observe(started - request.arrival_time)
        outputs = self._execute(batch, started)
        self.scheduler.finish(batch, outputs)
        return len(batch)

    def _execute(self, batch: list[DiffusionRequest], started: float) -> list[OmniRequestOutput | BaseException]:
        """Run the batch. Out of memory: split it in halves and retry each. Any other error: run its
        requests one by one, so only the request that fails on its own fails."""
        metrics.batch_size.labels(*self._labels).observe(len(batch))
        try:
            with metrics.batch_execution_time.labels(*self._labels).time():
                outputs: list[OmniRequestOutput | BaseException] = list(self.runner.run(batch))
        except torch.OutOfMemoryError as exc:
            if len(batch) == 1:
                logger.warning("request %s ran out of memory alone: %s", batch[0].request_id, exc)
                return [exc]
            half = len(batch) // 2
            logger.warning("out of memory with a batch of %d; retrying as %d + %d", len(batch), half, len(batch) - half)
            metrics.oom_batch_splits.labels(self._labels[0]).inc()
            self.runner.release_cached_memory()
            return self._execute(batch[:half], started) + self._execute(batch[half:], started)
        except Exception as exc:  # noqa: BLE001 - any pipeline error is isolated to its request below
            if len(batch) == 1:
                logger.warning("request %s failed: %s: %s", batch[0].request_id, type(exc).__name__, exc)
                return [exc]
            logger.warning(
                "batch of %d failed (%s: %s); re-running its requests one at a time",
                len(batch), type(exc).__name__, exc,
            )  # fmt: skip
            return [self._execute([request], started)[0] for request in batch]
        for request, output in zip(batch, outputs, strict=True):
            output.metrics["queue_ms"] = (started - request.arrival_time) * 1000.0
        return outputs

    def close(self, reason: str = "the engine is shutting down") -> None:
        self.scheduler.close(reason)
