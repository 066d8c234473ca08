"""What both engines share: `EngineCore` (a stage role, its batch scheduler, request intake, outputs); how they
run a batch through it is in `denoise.py` (`run_isolated`, `denoise_step`).

The request engine (`request_engine.py`) runs one call of the role per batch; the step engine (`step_engine.py`)
one denoising step per round. `engines.make_engine` picks one by ``execution_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.batching import BatchScheduler
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.logger import init_logger
from vllm_omni.metrics.prometheus import EngineMetrics
from vllm_omni.outputs import OmniRequestOutput, Preview, RequestMetrics, StageOutput, build_output
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.diffusion.roles import StageRole

logger = init_logger(__name__)


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
        self.admission = role.admission(od_config.stage.execution_mode, self.runner.card)
        self.scheduler = scheduler
        task = "video" if self.runner.card.is_video else "image"
        self.metrics = EngineMetrics(od_config.stage.stage_id, od_config.replica, task)
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
            raise RuntimeError(f"stage {self.od_config.stage.stage_id} serves no LoRA adapters")
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
