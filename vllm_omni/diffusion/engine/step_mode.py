"""The step engine (``execution_mode: step``): requests join and leave the running batch between denoising steps.

Each `step` is one step boundary: start the encodes the scheduler asks for, drop aborted requests (and count the
preempted ones, which wait with their state for a slot: `StepBatchScheduler`), run
one denoiser forward over every running request, move each along its own schedule (`denoise_step`, the same
step the request engine's denoising loop takes), and hand those that finished to the decoder. How a request
begins and ends is its stage role's: a ``diffusion`` stage encodes and decodes, a ``denoise`` stage starts from
the encoded prompt and hands the final latents on.

On CUDA, text encoding and VAE decoding run on two worker threads beside this loop, so a request that
joins or leaves does not stall the requests in flight: all three threads queue work on the default
stream, the GPU interleaves it, and the loop thread never waits for an encode or a decode. On the CPU
they run on the loop thread between steps instead: there they would share the loop's cores, and each
extra OpenMP master thread made every forward ~40 % slower (docs/performance.md), which costs more than
the stall. There the requests encoded at a boundary join its forward (`StepEngine._schedule`), and the prompts
that start at one boundary are encoded in one text-encoder call per encode key, as a request-mode batch's are.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.core import EngineCore
from vllm_omni.diffusion.engine.denoise import denoise_step, run_isolated
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import StepBatchScheduler, StepPlan
from vllm_omni.diffusion.families.steppers.state import kept_nbytes
from vllm_omni.errors import RequestAbortedError
from vllm_omni.logger import init_logger
from vllm_omni.outputs import RequestMetrics

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.roles import StageRole

logger = init_logger(__name__)


class StepEngine(EngineCore):
    """Step mode: one denoiser forward per step over the running requests (module docstring)."""

    scheduler: StepBatchScheduler

    def __init__(self, od_config: OmniDiffusionConfig, role: type[StageRole], *, side_workers: bool | None = None):
        """``side_workers``: encode and decode on worker threads beside the loop; ``None``: on CUDA only."""
        super().__init__(od_config, StepBatchScheduler(od_config, measure=kept_nbytes), role)
        self.metrics.preempted_state_bytes.set_function(lambda: self.scheduler.kept_bytes)
        if side_workers is None:
            side_workers = self.runner.device.type == "cuda"
        stage = od_config.stage.stage_id
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix=f"vllm-omni-encode-{stage}") if side_workers else None
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix=f"vllm-omni-decode-{stage}") if side_workers else None

    @property
    def has_unfinished(self) -> bool:
        """Whether requests are still denoising or decoding (the loop runs until they are done)."""
        return self.scheduler.has_unfinished

    def step(self, timeout: float | None = None) -> int:
        """One step boundary: schedule (start the encodes the plan asks for, drop aborted requests), run one forward
        over the running requests, finish those done (to the decoder); returns how many requests it stepped (0 if
        none in ``timeout``)."""
        batch = self._schedule(timeout)
        if batch:
            self.metrics.batch_num_requests.observe(len(batch))
            self._run(batch)
            self._retire(batch)
        return len(batch)

    def _schedule(self, timeout: float | None) -> list[DiffusionRequest]:
        """The requests to step now, once the calls due have run, the encodes of those that join have started and
        the aborted ones have been dropped."""
        self.scheduler.run_calls()
        plan = self.scheduler.plan(timeout)
        while True:
            self._start(plan)
            if not plan.to_prepare or self._encoder is not None:
                return plan.batch
            # Encoded here and now: they join this step, and so do those that arrived while they were encoded (a
            # closed loop's other clients, moments behind the first). Stepped a step later, they would form a second
            # group a step behind the first for as long as the loop runs, each group with forwards, text-encoder and
            # VAE calls of its own. Bounded: the encode look-ahead stops at max_num_seqs waiting requests.
            plan = self.scheduler.plan(0)

    def _start(self, plan: StepPlan) -> None:
        """Start the encodes ``plan`` asks for (one `_begin` per `StageRole.begin_key`), fail the aborted requests it
        dropped and count the preempted ones."""
        groups: dict[Hashable, list[DiffusionRequest]] = {}
        for request in plan.to_prepare:  # best first, within each group too
            groups.setdefault(self.role.begin_key(request), []).append(request)
        for group in groups.values():
            _run_on(self._encoder, self._begin, group)
        for request in plan.dropped:
            self.scheduler.complete(request, RequestAbortedError(request.request_id))
        if plan.preempted:
            self.metrics.num_preemptions.inc(len(plan.preempted))
            for request in plan.preempted:
                logger.debug(
                    "request %s preempted at step %d (%d bytes kept)",
                    request.request_id,
                    request.steps_done,
                    request.kept_bytes,
                )

    def _run(self, batch: list[DiffusionRequest]) -> None:
        """One denoising step of ``batch`` (`denoise_step`, inside the extensions' `Extensions.around_step`)."""
        with self.metrics.batch_execution_time.time(), self.timer.recording(batch):
            around_step = self.runner.extensions.around_step
            for request, error in denoise_step(
                batch, self.role.stepping, self._on_oom_split, self.role.previews, around_step
            ):
                self.scheduler.complete(request, error)

    def _retire(self, batch: list[DiffusionRequest]) -> None:
        """Hand the requests of ``batch`` whose denoising is done to the decoder."""
        done = [request for request in batch if request.state is not None and request.state.done]
        if done:
            self.scheduler.retire(done)
            _run_on(self._decoder, self._finish, done)

    def _begin(self, requests: list[DiffusionRequest]) -> None:
        """The denoising states of requests of one `StageRole.begin_key`, from their role in one call (on the encode
        worker, where there is one); a request whose encoding fails (alone: `run_isolated`) fails by itself."""
        started = time.monotonic()
        for request in requests:
            request.started_time = started
            self.metrics.queue_time.observe(started - request.arrival_time)

        def begin(group: list[DiffusionRequest]) -> list:
            with torch.inference_mode(), self.timer.recording(group):
                self.runner.load_adapters(group, keep=self.scheduler.adapters_in_use())
                return self.role.begin(group)

        states = run_isolated(
            begin,
            requests,
            what="encoding of request",
            name=lambda r: r.request_id,
            on_oom_split=self.runner.release_cached_memory,
        )
        for request, state in zip(requests, states, strict=True):
            if isinstance(state, BaseException):
                self.scheduler.fail_waiting(request, state)
            else:
                request.total_steps = len(state.timesteps)
                self.scheduler.prepared(request, state)  # dropped if aborted, cancelled or shut down meanwhile

    def _finish(self, requests: list[DiffusionRequest]) -> None:
        """The outputs of requests whose denoising is done (on the decode worker, where there is one)."""
        outputs = run_isolated(
            self._end,
            requests,
            what="decode of request",
            name=lambda r: r.request_id,
            on_oom_split=self.runner.release_cached_memory,
        )
        self.scheduler.complete_all(requests, outputs)

    def _end(self, requests: list[DiffusionRequest]) -> list:
        with torch.inference_mode(), self.timer.recording(requests):
            results = self.role.end(requests)
        finished = time.monotonic()
        self.timer.log_batch(self.od_config.stage.stage_id, requests)
        return [
            self.output(
                request,
                result,
                RequestMetrics(
                    batch_size=round(request.state.batch_total / max(request.state.forwards, 1), 2),
                    steps=request.state.forwards,
                    queue_ms=(request.started - request.arrival_time) * 1000.0,
                    exec_ms=(finished - request.started) * 1000.0,
                    seed=request.seed,
                    replica=self.od_config.replica,
                    weights_version=self.weights_version,
                ),
            )
            for request, result in zip(requests, results, strict=True)
        ]

    def shutdown(self) -> None:
        """Stop the encode and decode workers once the loop has stopped (pending decodes finish first)."""
        if self._encoder is not None:
            self._encoder.shutdown(wait=True, cancel_futures=True)
        if self._decoder is not None:  # the two exist together
            self._decoder.shutdown(wait=True)


def _run_on(worker: ThreadPoolExecutor | None, fn, *args) -> None:
    """``fn(*args)`` on ``worker``, or here and now without one."""
    if worker is None:
        fn(*args)
    else:
        worker.submit(fn, *args)
