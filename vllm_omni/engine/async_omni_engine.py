"""`AsyncOmniEngine`: owns the stage runtimes, routes each request through the stage graph, tracks it until done.

A deploy is one ``diffusion`` stage, or a split pipeline ``encode → denoise → decode`` (docs/stages.md).
Each stage has its own runtime, replicas, scheduler and batch key; a request enters the next stage when
the previous one hands on its output (by reference when both run in this process).
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_omni.config import StageDeployConfig
from vllm_omni.config.stage import check_stage_graph
from vllm_omni.diffusion.request import MAX_SEED, OmniDiffusionSamplingParams, RequestAbortedError
from vllm_omni.diffusion.runner import read_model_index
from vllm_omni.diffusion.steppers import SUPPORTED_PIPELINES
from vllm_omni.engine.replica import Admission
from vllm_omni.engine.stage_runtime import StageHealth, StageRuntime
from vllm_omni.metrics.prometheus import replica_metrics


def check_splittable(model: str, stage_configs: list[StageDeployConfig]) -> None:
    """Fail before anything loads when a split stage is asked of a pipeline that has no split."""
    split = [s for s in stage_configs if s.stage_type != "diffusion"]
    if not split:
        return
    name = read_model_index(model).get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"stage {split[0].stage_id} ({split[0].stage_type}): {name} cannot be split into encode / denoise / "
            f"decode stages; splittable pipelines: {', '.join(SUPPORTED_PIPELINES)}. Serve it as one stage with "
            "stage_type: diffusion"
        )


@dataclass
class _Flight:
    """A request on its way through the stages."""

    request_id: str
    prompt: str
    admissions: list[Admission]
    """Its complete parameters and batch key at each stage, in request order."""
    future: Future = field(default_factory=Future)
    stage: int = 0
    """Index (in request order) of the stage that holds it."""
    aborted: bool = False
    stage_metrics: list[dict] = field(default_factory=list)


class AsyncOmniEngine:
    """Engine behind `Omni` and `AsyncOmni`; thread-safe, returns one future per request."""

    def __init__(self, model: str, stage_configs: list[StageDeployConfig]):
        order = check_stage_graph(stage_configs)
        check_splittable(model, order)
        self.stage_configs = stage_configs
        self.stages: list[StageRuntime] = []
        """The stage runtimes in the order a request passes them."""
        try:
            for stage_config, next_stage in zip(order, order[1:] + [None], strict=True):
                self.stages.append(StageRuntime(model, stage_config, next_stage))
        except BaseException:
            self.shutdown()
            raise
        self._denoiser = next(
            i for i, s in enumerate(self.stages) if s.stage_config.stage_type in ("diffusion", "denoise")
        )
        """The stage that holds the denoiser: it fills in the model's defaults and reports progress."""
        replica_metrics.add(self._replica_metrics)
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()

    def admit(self, params: OmniDiffusionSamplingParams) -> list[Admission]:
        """``params`` completed by the denoising stage, then each stage's batch key for them (raises
        `SamplingParamsError` for parameters the model cannot take)."""
        first = self.stages[self._denoiser].admit(params)
        return [first if i == self._denoiser else stage.admit(first.params) for i, stage in enumerate(self.stages)]

    def add_request(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams) -> Future:
        """Queue a request (raises `SamplingParamsError` for parameters the model cannot take)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with self._lock:
            if request_id in self._flights:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._flights[request_id] = None  # reserved while it is admitted
        try:
            if params.seed is None:  # drawn here, so a re-run on another replica makes the same image
                params = params.model_copy(update={"seed": secrets.randbelow(MAX_SEED)})
            admissions = self.admit(params)
        except BaseException:
            with self._lock:
                del self._flights[request_id]
            raise
        flight = _Flight(request_id, prompt, admissions)
        with self._lock:
            self._flights[request_id] = flight
        # A caller that cancels the future (asyncio cancellation) aborts the request, wherever it is.
        flight.future.add_done_callback(lambda done: done.cancelled() and self.abort(request_id))
        self._enter(flight, 0, None)
        return flight.future

    def _finish(self, flight: _Flight, output=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._flights.pop(flight.request_id, None)
        if flight.future.done():  # cancelled by its caller
            return
        if error is not None:
            flight.future.set_exception(error)
        else:
            flight.future.set_result(output)

    def _enter(self, flight: _Flight, index: int, payload) -> None:
        """Hand ``flight`` to stage ``index`` with the previous stage's ``payload``."""
        with self._lock:
            flight.stage, aborted = index, flight.aborted
        if aborted:
            self._finish(flight, error=RequestAbortedError(flight.request_id))
            return
        stage = self.stages[index]
        try:
            inner = stage.submit(flight.request_id, flight.prompt, flight.admissions[index], payload)
        except BaseException as exc:  # noqa: BLE001 - the request fails; the caller's future says why
            self._finish(flight, error=exc)
            return
        inner.add_done_callback(lambda done: self._settle(flight, index, done))

    def _settle(self, flight: _Flight, index: int, done: Future) -> None:
        if done.exception() is not None:
            self._finish(flight, error=done.exception())
            return
        output = done.result()
        if len(self.stages) == 1:
            self._finish(flight, output)
            return
        config = self.stages[index].stage_config
        flight.stage_metrics.append({"stage_id": config.stage_id, "stage_type": config.stage_type} | output.metrics)
        if index + 1 < len(self.stages):
            self._enter(flight, index + 1, output.payload)
            return
        denoise = flight.stage_metrics[self._denoiser]
        output.metrics = output.metrics | {
            "batch_size": denoise["batch_size"],
            "replica": denoise["replica"],
            "queue_ms": sum(m["queue_ms"] for m in flight.stage_metrics),
            "exec_ms": sum(m["exec_ms"] for m in flight.stage_metrics),
            "stages": flight.stage_metrics,
        }
        self._finish(flight, output)

    def complete_params(self, params: OmniDiffusionSamplingParams) -> OmniDiffusionSamplingParams:
        """``params`` with the model's defaults filled in, as the request would run (raises `SamplingParamsError`)."""
        return self.stages[self._denoiser].admit(params).params

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(state, fraction of denoising steps done)`` of a request in flight; state is waiting or running."""
        flight = self._flights.get(request_id)
        if flight is None:
            return None
        if flight.stage < self._denoiser:
            return "waiting", 0.0
        if flight.stage > self._denoiser:
            return "running", 1.0
        return self.stages[self._denoiser].progress(request_id)

    @property
    def frame_multiple(self) -> int:
        """A video's num_frames must be 1 more than a multiple of this (the VAE's temporal factor)."""
        return self.stages[self._denoiser].info.frame_multiple

    @property
    def makes_videos(self) -> bool:
        """Whether the model generates videos (its outputs fill ``videos``) rather than images."""
        return self.stages[self._denoiser].info.is_video

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if it is not in flight."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None:
                return False
            flight.aborted = True
            index = flight.stage
        self.stages[index].abort(request_id)
        return True

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch, over all stages."""
        return sum(stage.num_waiting for stage in self.stages)

    @property
    def is_alive(self) -> bool:
        """Whether every stage has a live replica."""
        return all(stage.is_alive for stage in self.stages)

    def health(self) -> list[StageHealth]:
        return [stage.health() for stage in self.stages]

    def _replica_metrics(self) -> list:
        return [families for stage in self.stages for families in stage.collect_metrics()]

    def shutdown(self) -> None:
        replica_metrics.discard(self._replica_metrics)
        for stage in self.stages:
            stage.shutdown()
