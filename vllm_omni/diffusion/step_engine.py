"""The diffusion engine core for step mode: requests join and leave the running batch between denoising steps.

Each `step` is one step boundary: start the encodes the scheduler asks for, drop aborted requests, run
one denoiser forward over every running request, move each along its own schedule, and hand those that
finished to the decoder. As the ``denoise`` stage of a split pipeline it takes encoded prompts instead
of encoding, and hands final latents on instead of decoding.

On CUDA, text encoding and VAE decoding run on two worker threads beside this loop, so a request that
joins or leaves does not stall the requests in flight: all three threads queue work on the default
stream, the GPU interleaves it, and the loop thread never waits for an encode or a decode. On the CPU
they run on the loop thread between steps instead: there they would share the loop's cores, and each
extra OpenMP master thread made every forward ~40 % slower (docs/performance.md), which costs more than
the stall.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine import EngineCore, run_isolated
from vllm_omni.diffusion.request import (
    DiffusionRequest,
    OmniDiffusionSamplingParams,
    OmniRequestOutput,
    RequestAbortedError,
)
from vllm_omni.diffusion.scheduler import StepScheduler
from vllm_omni.diffusion.stages import StageOutput
from vllm_omni.diffusion.steppers import Latents
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class StepEngine(EngineCore):
    """Step mode: one denoiser forward per step over the running requests (module docstring)."""

    def __init__(self, od_config: OmniDiffusionConfig, *, side_workers: bool | None = None):
        """``side_workers``: encode and decode on worker threads beside the loop; ``None``: on CUDA only."""
        super().__init__(od_config, StepScheduler(od_config))
        self.split = od_config.stage_type == "denoise"
        if side_workers is None:
            side_workers = self.runner.device.type == "cuda"
        stage = od_config.stage_id
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"vllm-omni-encode-{stage}") if side_workers else None
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix=f"vllm-omni-decode-{stage}") if side_workers else None

    def batch_key(self, params: OmniDiffusionSamplingParams) -> tuple:
        return self.stepper.key(params)

    @property
    def has_unfinished(self) -> bool:
        """Whether requests are still denoising or decoding (the loop runs until they are done)."""
        return self.scheduler.has_unfinished

    def step(self, timeout: float | None = None) -> int:
        """One step boundary and one forward; returns how many requests it stepped (0 if none in ``timeout``)."""
        plan = self.scheduler.plan(timeout)
        for request in plan.to_prepare:
            _run_on(self._encoder, self._prepare, request)
        for request in plan.dropped:
            self.scheduler.complete(request, RequestAbortedError(request.request_id))
        batch = plan.batch
        if not batch:
            return 0
        self.metrics.batch_size.observe(len(batch))
        with self.metrics.batch_execution_time.time():
            predictions = run_isolated(
                self._predict, batch, what="request", name=lambda r: r.request_id, on_oom_split=self._on_oom_split
            )
            stepped = []
            for request, prediction in zip(batch, predictions, strict=True):
                if isinstance(prediction, BaseException):
                    self.scheduler.complete(request, prediction)
                else:
                    stepped.append((request, prediction))
            self._advance(stepped, len(batch))
        done = [request for request, _ in stepped if request.state is not None and request.state.done]
        if done:
            self.scheduler.retire(done)
            _run_on(self._decoder, self._finish, done)
        return len(batch)

    def _predict(self, batch: list[DiffusionRequest]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return self.stepper.predict([request.state for request in batch])

    def _advance(self, stepped: list[tuple[DiffusionRequest, torch.Tensor]], batch_size: int) -> None:
        if not stepped:
            return
        requests = [request for request, _ in stepped]
        try:
            with torch.inference_mode():
                self.stepper.advance([r.state for r in requests], [prediction for _, prediction in stepped])
        except Exception as exc:  # noqa: BLE001 - a scheduler update that fails leaves its requests unusable
            logger.warning("scheduler step of %d requests failed: %s: %s", len(requests), type(exc).__name__, exc)
            for request in requests:
                self.scheduler.complete(request, exc)
            return
        for request in requests:
            request.state.forwards += 1
            request.state.batch_total += batch_size
            request.steps_done = request.state.step

    def _prepare(self, request: DiffusionRequest) -> None:
        """The request's prompt embeddings, noise and schedule (on the encode worker, where there is one)."""
        request.started_time = time.monotonic()
        self.metrics.queue_time.observe(request.started_time - request.arrival_time)
        try:
            with torch.inference_mode():
                if self.split:
                    state = self.stepper.start(request.payload, request.params, request.seed)
                else:
                    state = self.stepper.prepare(request.prompt, request.params, request.seed)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            logger.warning("encoding request %s failed: %s: %s", request.request_id, type(exc).__name__, exc)
            self.scheduler.fail_waiting(request, exc)
            return
        request.total_steps = len(state.timesteps)
        self.scheduler.prepared(request, state)  # dropped if aborted, cancelled or shut down meanwhile

    def _finish(self, requests: list[DiffusionRequest]) -> None:
        """The outputs of requests whose denoising is done (on the decode worker, where there is one)."""
        outputs = run_isolated(
            self._decode, requests, what="decode of request", name=lambda r: r.request_id,
            on_oom_split=self.runner.release_cached_memory,
        )  # fmt: skip
        for request, output in zip(requests, outputs, strict=True):
            self.scheduler.complete(request, output)

    def _decode(self, requests: list[DiffusionRequest]) -> list[OmniRequestOutput | StageOutput]:
        if self.split:  # the decode stage decodes
            items = [Latents(request.state.latents, request.params) for request in requests]
        else:
            with torch.inference_mode():
                items = self.stepper.decode([request.state for request in requests])
        finished = time.monotonic()
        video = self.runner.is_video
        outputs = []
        for request, mine in zip(requests, items, strict=True):
            state, started = request.state, request.started_time
            metrics_ = {
                "batch_size": round(state.batch_total / max(state.forwards, 1), 2),
                "steps": state.forwards,
                "queue_ms": (started - request.arrival_time) * 1000.0,
                "exec_ms": (finished - started) * 1000.0,
                "seed": request.seed,
                "replica": self.od_config.replica,
            }
            if self.split:
                outputs.append(StageOutput(request.request_id, mine, metrics_))
                continue
            if video:
                metrics_["fps"] = request.params.fps
            outputs.append(
                OmniRequestOutput(
                    request_id=request.request_id,
                    prompt=request.prompt,
                    images=[] if video else mine,
                    videos=mine if video else [],
                    metrics=metrics_,
                )
            )
        return outputs

    def shutdown(self) -> None:
        """Stop the encode and decode workers once the loop has stopped (pending decodes finish first)."""
        if self._encoder is not None:
            self._encoder.shutdown(wait=True, cancel_futures=True)
            self._decoder.shutdown(wait=True)


def _run_on(worker: ThreadPoolExecutor | None, fn, *args) -> None:
    """``fn(*args)`` on ``worker``, or here and now without one."""
    if worker is None:
        fn(*args)
    else:
        worker.submit(fn, *args)
