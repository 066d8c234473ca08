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
from vllm_omni.config.parallel import sequence_ranks
from vllm_omni.diffusion.batching import BatchScheduler
from vllm_omni.diffusion.finite import is_finite, non_finite_error
from vllm_omni.diffusion.lora_tensors import LoraTensors
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.diffusion.sleep import PipelineSleep, check_level, check_tags
from vllm_omni.diffusion.timings import ComponentTimer
from vllm_omni.diffusion.weights import WeightsApplied, WeightUpdateGroup, apply_weights, component_of
from vllm_omni.errors import NonFiniteOutputError, WeightUpdateError
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
        self.admission = role.admission(
            od_config.stage.execution_mode, self.runner.card, sequence_ranks(od_config.stage)
        )
        self.scheduler = scheduler
        task = "video" if self.runner.card.is_video else "image"
        self.metrics = EngineMetrics(od_config.stage.stage_id, od_config.replica, task)
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
        """Where its weights are while it sleeps (`sleep`)."""
        self.metrics.engine_sleeping.set_function(lambda: int(scheduler.paused))
        self.weights_version = 0
        """Weight updates applied since the model loaded (`update_weights`); each output reports the one it ran
        with."""
        self.weight_group: WeightUpdateGroup | None = None
        """The group a trainer broadcasts weights over (`init_weight_update_group`)."""

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

    def load_lora(self, name: str, path: str, tensors: LoraTensors | None = None) -> Future:
        """Load adapter ``name`` from ``path`` on the engine's thread at the next boundary (it checks the file, and
        evicts only adapters no request in flight uses); the future fails with `LoraLoadError` naming the file.
        ``tensors``: an adapter given as tensors, ``path`` its source tag (`LoraAdapters.load`)."""
        lora = self._lora()

        def load() -> None:
            if self.sleeper.dropped:  # PEFT would make the adapter's layers on the meta device, and lose it
                raise ValueError(f"this replica sleeps at level 2 (its weights dropped): wake it up to load {name!r}")
            lora.load(name, path, keep=self.scheduler.adapters_in_use(), tensors=tensors)

        return self.scheduler.call(load)

    def unload_lora(self, name: str) -> Future:
        """Evict adapter ``name`` at the next boundary, or, while a request in flight uses it, make it the next to
        evict (`LoraAdapters.retire`); the future holds whether it was evicted now."""
        lora = self._lora()
        return self.scheduler.call(lambda: lora.retire(name, self.scheduler.adapters_in_use()))

    def update_weights(self, weights: dict, component: str) -> Future:
        """Apply ``weights`` to ``component`` on the engine's thread once the requests in progress have finished,
        before any other starts (a batch finishes on the weights it started with); the future holds
        `WeightsApplied`, or fails with `WeightUpdateError` and nothing applied."""
        return self.scheduler.call(lambda: self._apply_weights(weights, component), drain=True)

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, backend: str | None = None
    ) -> None:
        """Join a trainer's `WeightUpdateGroup` as ``rank`` (gloo, or NCCL on CUDA), replacing any earlier group. It
        runs on the caller's thread: joining blocks until every member has joined, and it runs no tensor op, so
        the engine keeps serving meanwhile."""
        device = "cpu" if backend == "gloo" else self.runner.device
        self.weight_group = WeightUpdateGroup(
            master_address, master_port, rank, world_size, device=device, backend=backend
        )

    def update_weights_from_distributed(self, names_dtypes_shapes: list, component: str, src: int) -> Future:
        """`update_weights` with tensors received from rank ``src`` of the weight group, one broadcast each, on the
        engine's thread once it has drained. Every broadcast is received before anything is checked, so the
        trainer's broadcasts complete even when the update is refused."""

        def receive() -> WeightsApplied:
            if self.weight_group is None:
                raise WeightUpdateError(None, "this replica has not joined a group: call init_weight_update_group")
            return self._apply_weights(self.weight_group.receive(names_dtypes_shapes, src), component)

        return self.scheduler.call(receive, drain=True)

    def _apply_weights(self, weights: dict, component: str) -> WeightsApplied:
        if self.runner.group is not None:
            raise WeightUpdateError(
                None, "a replica of several ranks (the stage's parallel degrees) cannot update weights yet"
            )
        if self.od_config.stage.cpu_offload == "sequential":
            raise WeightUpdateError(
                None, "cpu_offload='sequential' keeps the weights in accelerate's hooks: serve with 'model' or 'none'"
            )
        module = component_of(self.runner.pipeline, component)
        self.runner.quantization.check_update(component)
        # A dropped weight comes back where its component's weights are now: in CPU memory while they sleep.
        home = "cpu" if "weights" in self.sleeper.asleep else self.sleeper.home
        complete = apply_weights(module, weights, component, home)
        self.weights_version += 1
        logger.info("Applied %d tensors to %s: weights version %d", len(weights), component, self.weights_version)
        return WeightsApplied(self.weights_version, complete)

    def sleep(self, level: int = 1) -> Future:
        """Sleep at ``level`` (`PipelineSleep`) once the requests in progress have finished: from then on no request
        starts (those that arrive wait) until `wake_up`; calls still run. The future is done once it sleeps."""
        check_level(level, self.od_config.stage.cpu_offload, self.od_config.stage.quantization)
        if self.runner.group is not None:
            raise ValueError("sleep: a replica of several ranks (the stage's parallel degrees) cannot sleep yet")
        self.runner.quantization.check_sleep(level)
        return self.scheduler.call(lambda: self._sleep(level), drain=True)

    def _sleep(self, level: int) -> None:
        self.scheduler.pause(True)
        self.sleeper.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> Future:
        """Wake the memory of ``tags`` (``None``: all; `WAKE_TAGS`) on the engine's thread, after a sleep that is
        still to run; requests start again once no memory sleeps. The future holds whether it serves again."""
        tags = check_tags(tags)
        return self.scheduler.call(lambda: self._wake_up(tags), drain=True)

    def _wake_up(self, tags: list[str] | None) -> bool:
        awake = self.sleeper.wake_up(tags)
        if awake and self.scheduler.paused:
            self.scheduler.pause(False)
        return awake

    @property
    def is_sleeping(self) -> bool:
        return self.scheduler.paused

    def _lora(self):
        if self.runner.lora is None:
            raise RuntimeError(f"stage {self.od_config.stage.stage_id} serves no LoRA adapters")
        return self.runner.lora

    def output(
        self, request: DiffusionRequest, result: Any, metrics: RequestMetrics
    ) -> OmniRequestOutput | StageOutput | NonFiniteOutputError:
        """The request's output from its role's ``result`` and how it ran; from the final stage, the error that fails
        it instead where that holds NaN or inf (`finite`: whichever mode or stage decoded it)."""
        if self.role.final and not is_finite(result):
            error = non_finite_error(request.request_id, self.runner.card, request.params)
            logger.warning("request %s failed: %s", request.request_id, error)
            return error
        video = self.runner.card.is_video
        if video:
            metrics.fps = request.params.fps
        metrics.components = self.timer.finish(request)
        return build_output(
            request.request_id,
            request.prompt,
            result,
            metrics,
            final=self.role.final,
            video=video,
            trajectory=request.trajectory,
        )

    def _on_oom_split(self) -> None:
        self.metrics.oom_batch_splits.inc()
        self.runner.release_cached_memory()

    def close(self, reason: str = "the engine is shutting down", *, include_running: bool = False) -> None:
        """Fail the waiting requests (and the running ones with ``include_running``, when the loop died)."""
        self.scheduler.close(reason, include_running=include_running)
