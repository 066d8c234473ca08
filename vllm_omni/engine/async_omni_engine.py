"""`AsyncOmniEngine`: owns the stage runtimes, hands requests to them, tracks them until done."""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import Future
from dataclasses import replace

from vllm_omni.config import StageDeployConfig
from vllm_omni.diffusion.request import MAX_SEED, OmniDiffusionSamplingParams
from vllm_omni.engine.stage_runtime import StageHealth, StageRuntime
from vllm_omni.metrics.prometheus import replica_metrics


class AsyncOmniEngine:
    """Engine behind `Omni` and `AsyncOmni`; thread-safe, returns one future per request."""

    def __init__(self, model: str, stage_configs: list[StageDeployConfig]):
        if len(stage_configs) != 1:
            raise ValueError(
                f"the deploy config lists {len(stage_configs)} stages; this release runs exactly one diffusion stage"
            )
        self.stage_configs = stage_configs
        self.stages: list[StageRuntime] = []
        try:
            for stage_config in stage_configs:
                self.stages.append(StageRuntime(model, stage_config))
        except BaseException:
            self.shutdown()
            raise
        replica_metrics.add(self._replica_metrics)
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()

    def add_request(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams) -> Future:
        """Queue a request (raises `SamplingParamsError` for parameters the model cannot take)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with self._lock:
            if request_id in self._in_flight:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._in_flight.add(request_id)
        try:
            stage = self.stages[-1]
            admission = stage.admit(params)
            if admission.params.seed is None:  # drawn here, so a re-run on another replica makes the same image
                admission = replace(
                    admission, params=admission.params.model_copy(update={"seed": secrets.randbelow(MAX_SEED)})
                )
            future = stage.submit(request_id, prompt, admission)
        except BaseException:
            self._done(request_id)
            raise
        future.add_done_callback(lambda _: self._done(request_id))
        return future

    def complete_params(self, params: OmniDiffusionSamplingParams) -> OmniDiffusionSamplingParams:
        """``params`` with the model's defaults filled in, as the request would run (raises `SamplingParamsError`)."""
        return self.stages[-1].admit(params).params

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(state, fraction of denoising steps done)`` of a request in flight; state is waiting or running."""
        return self.stages[-1].progress(request_id)

    @property
    def frame_multiple(self) -> int:
        """A video's num_frames must be 1 more than a multiple of this (the VAE's temporal factor)."""
        return self.stages[-1].info.frame_multiple

    @property
    def makes_videos(self) -> bool:
        """Whether the model generates videos (its outputs fill ``videos``) rather than images."""
        return self.stages[-1].info.is_video

    def _done(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.discard(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if it is not in flight."""
        return any(stage.abort(request_id) for stage in self.stages)

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
