"""What both engines share: `EngineCore` (a stage role, its batch scheduler, request intake, outputs), failure
isolation (`run_isolated`) and the one denoising step (`denoise_step`).

The request engine (`request_engine.py`) runs one call of the role per batch; the step engine (`step_engine.py`)
one denoising step per round. `vllm_omni.engine.replica.make_engine` picks one by ``execution_mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.batching import BatchScheduler
from vllm_omni.diffusion.outputs import OmniRequestOutput, RequestMetrics, StageOutput, build_output
from vllm_omni.diffusion.previews import Preview, Previews, clean_latents
from vllm_omni.diffusion.request import DiffusionRequest, OmniDiffusionSamplingParams
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.logger import init_logger
from vllm_omni.metrics.prometheus import EngineMetrics

if TYPE_CHECKING:
    from vllm_omni.diffusion.roles import StageRole
    from vllm_omni.diffusion.steppers import Stepper

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


def denoise_step(
    requests: list[DiffusionRequest],
    stepper: Stepper,
    on_oom_split: Callable[[], None],
    previews: Previews | None = None,
) -> list[tuple[DiffusionRequest, BaseException]]:
    """One denoising step for every request: one denoiser forward over all their rows (a failure there is isolated
    to its request), the previews due after this step (from the predictions), then each request moves one step
    along its own schedule. Returns the requests that failed, with why; a failed scheduler update fails every
    request it held, whose state it may have changed."""
    with torch.inference_mode():
        predictions = run_isolated(
            lambda batch: stepper.predict([r.state for r in batch]),
            requests,
            what="request",
            name=lambda r: r.request_id,
            on_oom_split=on_oom_split,
        )
        failed = [(r, p) for r, p in zip(requests, predictions, strict=True) if isinstance(p, BaseException)]
        stepped = [(r, p) for r, p in zip(requests, predictions, strict=True) if not isinstance(p, BaseException)]
        if not stepped:
            return failed
        for request, prediction in stepped:
            state = request.state
            if previews is not None and previews.due(request, state.step + 1):
                index = state.offset + state.step
                clean = clean_latents(state.noise_scheduler, index, state.timestep, prediction, state.latents)
                previews.emit(request, clean)
        try:
            stepper.advance([r.state for r, _ in stepped], [p for _, p in stepped])
        except Exception as exc:  # noqa: BLE001 - a scheduler update that fails leaves its requests unusable
            logger.warning("scheduler step of %d requests failed: %s: %s", len(stepped), type(exc).__name__, exc)
            return failed + [(r, exc) for r, _ in stepped]
    for request, _ in stepped:
        request.state.forwards += 1
        request.state.batch_total += len(requests)
        request.steps_done = request.state.step
    return failed


class EngineCore:
    """One stage's engine: its role, runner, batch scheduler and metrics; request intake, abort and close.

    A subclass implements ``step`` (one scheduling round, then device work) and ``has_unfinished``.
    """

    def __init__(
        self,
        od_config: OmniDiffusionConfig,
        scheduler: BatchScheduler,
        role: type[StageRole],
    ):
        self.od_config = od_config
        self.runner = DiffusionRunner(od_config, skips=role.skips)
        self.role = role(od_config, self.runner, self._on_oom_split)
        self.admission = role.admission(od_config.execution_mode, self.runner.card)
        self.scheduler = scheduler
        task = "video" if self.runner.card.is_video else "image"
        self.metrics = EngineMetrics(od_config.stage_id, od_config.replica, task)
        self.metrics.num_requests_running.set_function(lambda: scheduler.num_running)
        self.metrics.num_requests_waiting.set_function(lambda: scheduler.num_waiting)
        lora = self.runner.lora
        self.metrics.lora_adapters_resident.set_function(lambda: 0 if lora is None else len(lora.resident))
        if self.runner.step_cache is not None:
            self.runner.step_cache.on_skip = self.metrics.cache_skipped_steps.inc

    def add_request(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> Future:
        """Queue a request with ``params`` its role has completed (and the previous stage's ``payload`` for it, in a split
        pipeline); the returned future resolves to its `OmniRequestOutput`, or a `StageOutput` from a stage that
        is not the last. ``on_preview`` takes its partial images, on the engine's thread."""
        request = DiffusionRequest.create(
            request_id, prompt, params, key=self.admission.key(params), payload=payload, on_preview=on_preview
        )
        self.runner.note_size(params)
        self.scheduler.add(request)
        return request.future

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def load_lora(self, name: str, path: str) -> Future:
        """Load adapter ``name`` from ``path`` on the engine's thread at the next boundary (it checks the file, and
        evicts only adapters no request in flight uses); the future fails with `LoraLoadError` naming the file."""
        lora = self._lora()
        return self.scheduler.call(lambda: lora.load(name, path, keep=self.scheduler.adapters_in_use()))

    def unload_lora(self, name: str) -> Future:
        """Evict adapter ``name`` at the next boundary, or, while a request in flight uses it, make it the next to
        evict (`LoraAdapters.retire`); the future holds whether it was evicted now."""
        lora = self._lora()
        return self.scheduler.call(lambda: lora.retire(name, self.scheduler.adapters_in_use()))

    def _lora(self):
        if self.runner.lora is None:
            raise RuntimeError(f"stage {self.od_config.stage_id} serves no LoRA adapters")
        return self.runner.lora

    def output(
        self, request: DiffusionRequest, result: Any, metrics: RequestMetrics
    ) -> OmniRequestOutput | StageOutput:
        """The request's output from its role's ``result`` and how it ran."""
        video = self.runner.card.is_video
        if video:
            metrics.fps = request.params.fps
        return build_output(request.request_id, request.prompt, result, metrics, final=self.role.final, video=video)

    def _on_oom_split(self) -> None:
        self.metrics.oom_batch_splits.inc()
        self.runner.release_cached_memory()

    def close(self, reason: str = "the engine is shutting down", *, include_running: bool = False) -> None:
        """Fail the waiting requests (and the running ones with ``include_running``, when the loop died)."""
        self.scheduler.close(reason, include_running=include_running)
