"""The diffusion engine core for request mode: ``schedule → run → finish``, one stage work call per batch.

`make_engine` picks this engine or the step engine (`step_engine.py`) from ``execution_mode``; the stage
type picks the work (`stages.py`): a whole pipeline call, or one part of a split pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import DiffusionRequest, OmniDiffusionSamplingParams, OmniRequestOutput
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.diffusion.scheduler import Scheduler
from vllm_omni.diffusion.stages import StageOutput, make_work
from vllm_omni.diffusion.steppers import SPLIT, STEP_MODE, make_stepper
from vllm_omni.logger import init_logger
from vllm_omni.metrics.prometheus import EngineMetrics

logger = init_logger(__name__)

T = TypeVar("T")


def run_isolated(
    run: Callable[[list[T]], Sequence[Any]],
    items: list[T],
    *,
    what: str,
    name: Callable[[T], str],
    on_oom_split: Callable[[], None],
) -> list[Any]:
    """``run(items)``, with failures isolated: one result or exception per item.

    Out of memory: split the items in halves and retry each (``on_oom_split`` frees
    cached memory first). Any other error: run the items one by one, so only an
    item that fails on its own fails.
    """
    try:
        return list(run(items))
    except torch.OutOfMemoryError as exc:
        if len(items) == 1:
            logger.warning("%s %s ran out of memory alone: %s", what, name(items[0]), exc)
            return [exc]
        half = len(items) // 2
        logger.warning("out of memory with a batch of %d; retrying as %d + %d", len(items), half, len(items) - half)
        on_oom_split()
        kwargs = dict(what=what, name=name, on_oom_split=on_oom_split)
        return run_isolated(run, items[:half], **kwargs) + run_isolated(run, items[half:], **kwargs)
    except Exception as exc:  # noqa: BLE001 - any pipeline error is isolated to its request below
        if len(items) == 1:
            logger.warning("%s %s failed: %s: %s", what, name(items[0]), type(exc).__name__, exc)
            return [exc]
        logger.warning(
            "batch of %d failed (%s: %s); re-running its requests one at a time", len(items), type(exc).__name__, exc
        )
        return [run_isolated(run, [item], what=what, name=name, on_oom_split=on_oom_split)[0] for item in items]


class EngineCore:
    """What both execution modes share: the runner, a scheduler, request intake, abort and close.

    A subclass sets its scheduler and implements ``step`` (one scheduling round, then device work).
    """

    def __init__(self, od_config: OmniDiffusionConfig, scheduler: Scheduler):
        self.od_config = od_config
        self.runner = DiffusionRunner(od_config)
        split = od_config.stage_type != "diffusion"
        self.stepper = (
            make_stepper(self.runner.pipeline, self.runner.device, SPLIT if split else STEP_MODE)
            if split or od_config.execution_mode == "step"
            else None
        )
        """The model's `Stepper` when the engine steps or splits the pipeline, else ``None``."""
        self.scheduler = scheduler
        task = "video" if self.runner.is_video else "image"
        self.metrics = EngineMetrics(od_config.stage_id, od_config.replica, task)
        self.metrics.num_requests_running.set_function(lambda: scheduler.num_running)
        self.metrics.num_requests_waiting.set_function(lambda: scheduler.num_waiting)

    @property
    def completes_params(self) -> bool:
        """Whether this stage fills in the model's defaults: the stage that holds the denoiser (its config
        sizes them). The stages of a split pipeline around it take complete parameters."""
        return self.od_config.stage_type in ("diffusion", "denoise")

    def complete_params(self, params: OmniDiffusionSamplingParams) -> OmniDiffusionSamplingParams:
        """``params`` with the model's defaults filled in where this stage holds them, checked against what the
        stage can run (raises `SamplingParamsError`)."""
        if self.completes_params:
            params = self.runner.complete_params(params)
        if self.stepper is not None:
            self.stepper.check_params(params)
        return params

    def batch_key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        """What must match for complete ``params`` to share a batch."""
        raise NotImplementedError

    def add_request(
        self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams, payload: Any = None
    ) -> Future:
        """Queue a request (with the previous stage's ``payload`` for it, in a split pipeline); the returned
        future resolves to its `OmniRequestOutput`, or a `StageOutput` from a stage that is not the last."""
        params = self.complete_params(params)
        request = DiffusionRequest.create(request_id, prompt, params, key=self.batch_key(params), payload=payload)
        self.scheduler.add(request)
        return request.future

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def _on_oom_split(self) -> None:
        self.metrics.oom_batch_splits.inc()
        self.runner.release_cached_memory()

    def close(self, reason: str = "the engine is shutting down", *, include_running: bool = False) -> None:
        """Fail the waiting requests (and the running ones with ``include_running``, when the loop died)."""
        self.scheduler.close(reason, include_running=include_running)


class DiffusionEngine(EngineCore):
    """Request mode: one call of the stage's work per batch."""

    def __init__(self, od_config: OmniDiffusionConfig):
        super().__init__(od_config, Scheduler(od_config))
        self.work = make_work(od_config.stage_type, self.runner, self.stepper)

    def batch_key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        return self.work.key(params)

    @property
    def has_unfinished(self) -> bool:
        """Whether accepted requests are still in the engine (a batch ends within `step`, so never here)."""
        return False

    def step(self, timeout: float | None = None) -> int:
        """Run at most one batch; returns how many requests it held (0 if none was due in ``timeout``)."""
        batch = self.scheduler.schedule(timeout)
        if not batch:
            return 0
        started = time.monotonic()
        for request in batch:
            self.metrics.queue_time.observe(started - request.arrival_time)
        outputs = run_isolated(
            self._run, batch, what="request", name=lambda r: r.request_id, on_oom_split=self._on_oom_split
        )
        for request, output in zip(batch, outputs, strict=True):
            if not isinstance(output, BaseException):
                output.metrics["queue_ms"] = (started - request.arrival_time) * 1000.0
                output.metrics["replica"] = self.od_config.replica
        self.scheduler.finish(batch, outputs)
        return len(batch)

    def _run(self, batch: list[DiffusionRequest]) -> list[OmniRequestOutput | StageOutput]:
        self.metrics.batch_size.observe(len(batch))
        with self.metrics.batch_execution_time.time():
            return self.work.run(batch)

    def shutdown(self) -> None:
        """Release what the engine holds once its loop has stopped: request mode has no workers to stop."""


def make_engine(od_config: OmniDiffusionConfig):
    """The engine for the stage's ``execution_mode``."""
    if od_config.execution_mode == "step":
        from vllm_omni.diffusion.step_engine import StepEngine

        return StepEngine(od_config)
    return DiffusionEngine(od_config)
