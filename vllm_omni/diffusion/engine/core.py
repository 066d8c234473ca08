"""What both engines share: `EngineCore` (a stage role, its batch scheduler, request intake, outputs); how they
run a batch through it is in `denoise.py` (`run_isolated`, `denoise_step`).

The request engine (`request_mode.py`) runs one call of the role per batch; the step engine (`step_mode.py`)
one denoising step per round. `modes.make_engine` picks one by ``execution_mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.config.parallel import sequence_ranks
from vllm_omni.diffusion.engine.control import HANDLERS
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import BatchScheduler
from vllm_omni.diffusion.features.sleep import PipelineSleep
from vllm_omni.diffusion.features.weights import WeightUpdateGroup

# The feature modules whose handlers of the control verbs fill HANDLERS (`EngineCore.call`):
from vllm_omni.diffusion.lora import adapters as _lora  # noqa: F401
from vllm_omni.diffusion.pipeline.finite import is_finite, non_finite_error
from vllm_omni.diffusion.pipeline.runner import DiffusionRunner
from vllm_omni.diffusion.pipeline.timings import ComponentTimer
from vllm_omni.errors import NonFiniteOutputError
from vllm_omni.logger import init_logger
from vllm_omni.metrics.prometheus import EngineMetrics
from vllm_omni.outputs import OmniRequestOutput, Preview, RequestMetrics, StageOutput, build_output
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.roles import StageRole

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
        self.admission = role.admission(
            od_config.stage.execution_mode, self.runner.card, sequence_ranks(od_config.stage)
        )
        self.scheduler = scheduler
        self.metrics = EngineMetrics(od_config.stage.stage_id, od_config.replica, self.runner.card.output)
        self.metrics.num_requests_running.set_function(lambda: scheduler.num_running)
        self.metrics.num_requests_waiting.set_function(lambda: scheduler.num_waiting)
        lora = self.runner.lora
        self.metrics.lora_adapters_resident.set_function(lambda: 0 if lora is None else len(lora.resident))
        self.timer = ComponentTimer(
            self.runner.device,
            self.metrics.component,
            enabled=self.runner.timed,
            log=od_config.stage.log_pipeline_timings,
        )
        """Where its requests' time goes inside the pipeline (``component_timings``)."""
        if self.runner.step_cache is not None:
            self.runner.step_cache.on_skip = self.metrics.cache_skipped_steps.inc
        self.sleeper = PipelineSleep(
            self.runner.pipeline, od_config.model, self.runner.device, od_config.stage.cpu_offload
        )
        """Where its weights are while it sleeps (the ``sleep`` verb)."""
        self.metrics.engine_sleeping.set_function(lambda: int(scheduler.paused))
        self.weights_version = 0
        """Weight updates applied since the model loaded (the ``update_weights`` verb); each output reports the one
        it ran with."""
        self.weight_group: WeightUpdateGroup | None = None
        """The group a trainer broadcasts weights over (the ``init_weight_update_group`` verb)."""

    @property
    def has_unfinished(self) -> bool:
        """Whether requests are in flight (the loop runs until none is, once stopping)."""
        raise NotImplementedError

    def step(self, timeout: float | None = None) -> int:
        """One scheduling round, then the device work it chose; what it ran."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what the engine holds once its loop has stopped."""
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> Future:
        """Queue a request with ``params`` its role has completed (and the previous stage's ``payload`` for it, in a
        split pipeline); the returned future resolves to its `OmniRequestOutput`, or a `StageOutput` from a stage that
        is not the last. ``on_preview`` takes its partial images, on the engine's thread."""
        request = DiffusionRequest.create(
            request_id, prompt, params, key=self.admission.key(params), payload=payload, on_preview=on_preview
        )
        self.runner.note_size(params)
        self.scheduler.add(request)
        return request.future

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def call(self, method: str, *args) -> Future:
        """Control verb ``method`` (``sleep``, ``update_weights``, ``load_lora``, ...) with ``args``: its handler in
        `HANDLERS`, filled by the feature modules (diffusion/engine/control.py), given this engine first. The future
        holds its answer; a handler may raise at once for arguments it refuses, and an unknown ``method`` is a
        ValueError naming the known ones."""
        try:
            handle = HANDLERS[method]
        except KeyError:
            known = ", ".join(sorted(HANDLERS))
            raise ValueError(f"unknown control method {method!r}: the engine knows {known}") from None
        return handle(self, *args)

    def output(
        self, request: DiffusionRequest, result: Any, metrics: RequestMetrics
    ) -> OmniRequestOutput | StageOutput | NonFiniteOutputError:
        """The request's output from its role's ``result`` and how it ran; from the final stage, the error that fails
        it instead where that holds NaN or inf (`finite`: whichever mode or stage decoded it)."""
        if self.role.final and not is_finite(result):
            error = non_finite_error(request.request_id, self.runner.card, request.params)
            logger.warning("request %s failed: %s", request.request_id, error)
            return error
        card = self.runner.card
        if card.output == "video":
            metrics.fps = request.params.fps
        rate = None if card.audio is None else card.audio.sample_rate
        if rate is not None and self.role.final:
            metrics.audio_seconds = sum(waveform.shape[-1] for waveform in result) / rate
            self.metrics.audio_seconds.inc(metrics.audio_seconds)
        metrics.components = self.timer.finish(request)
        return build_output(
            request.request_id,
            request.prompt,
            result,
            metrics,
            final=self.role.final,
            kind=card.output,
            sample_rate=rate,
            trajectory=request.trajectory,
        )

    def _on_oom_split(self) -> None:
        self.metrics.oom_batch_splits.inc()
        self.runner.release_cached_memory()

    def close(self, reason: str = "the engine is shutting down", *, include_running: bool = False) -> None:
        """Fail the waiting requests (and the running ones with ``include_running``, when the loop died)."""
        self.scheduler.close(reason, include_running=include_running)
