"""What a request-mode stage does to one batch, by stage type (docs/stages.md).

A `StageWork` has a ``key`` (what requests must share to be batched by this stage) and ``run`` (one batch, one
output per request). A ``diffusion`` stage makes one pipeline call; the three stages of a split pipeline
use the model's `Stepper`: ``encode`` batches prompts (a text-shaped key), ``denoise`` runs the whole
denoising loop for a batch, ``decode`` batches latents (a latent-shaped key). A ``denoise`` stage in
``execution_mode: step`` is the step engine instead (`step_engine.py`).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.diffusion.request import BatchKey, DiffusionRequest, OmniDiffusionSamplingParams, OmniRequestOutput
from vllm_omni.diffusion.runner import DiffusionRunner
from vllm_omni.diffusion.steppers import Conditioning, Latents, Stepper


@dataclass
class StageOutput:
    """A request's result from a stage that is not the last: what the next stage takes, and how it ran."""

    request_id: str
    payload: Conditioning | Latents
    """The encoded prompt (from ``encode``) or the final latents (from ``denoise``)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """``batch_size``, ``exec_ms``, ``queue_ms``, ``replica``, as in `OmniRequestOutput.metrics`."""


class StageWork:
    """One stage type's work on a batch of requests."""

    def key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        raise NotImplementedError

    def run(self, batch: list[DiffusionRequest]) -> list[OmniRequestOutput | StageOutput]:
        raise NotImplementedError


class PipelineWork(StageWork):
    """``diffusion``: one call of the whole pipeline per batch."""

    def __init__(self, runner: DiffusionRunner):
        self.runner = runner

    def key(self, params: OmniDiffusionSamplingParams) -> BatchKey:
        return BatchKey.of(params)

    def run(self, batch: list[DiffusionRequest]) -> list[OmniRequestOutput]:
        return self.runner.run(batch)


class _SplitWork(StageWork):
    def __init__(self, runner: DiffusionRunner, stepper: Stepper):
        self.runner, self.stepper = runner, stepper

    def run(self, batch: list[DiffusionRequest]) -> list[OmniRequestOutput | StageOutput]:
        started = time.perf_counter()
        with torch.inference_mode():
            results = self._run(batch)
        metrics = {"batch_size": len(batch), "exec_ms": (time.perf_counter() - started) * 1000.0}
        return [self._output(r, result, metrics) for r, result in zip(batch, results, strict=True)]

    def _run(self, batch: list[DiffusionRequest]) -> list[Any]:
        raise NotImplementedError

    def _output(self, request: DiffusionRequest, result: Any, metrics: dict) -> OmniRequestOutput | StageOutput:
        return StageOutput(request.request_id, result, dict(metrics))


class EncodeWork(_SplitWork):
    """``encode``: the text encoders, once for the whole batch of prompts."""

    def key(self, params: OmniDiffusionSamplingParams) -> tuple:
        return self.stepper.encode_key(params)

    def _run(self, batch: list[DiffusionRequest]) -> list[Conditioning]:
        return self.stepper.encode([r.prompt for r in batch], [r.params for r in batch])


class DenoiseWork(_SplitWork):
    """``denoise`` in request mode: the batch runs its denoising steps together, one forward per step over the
    requests that still have steps (each on its own schedule); it stops early once all of them are aborted."""

    def key(self, params: OmniDiffusionSamplingParams) -> tuple:
        return self.stepper.key(params)

    def _run(self, batch: list[DiffusionRequest]) -> list[Latents]:
        states = [self.stepper.start(r.payload, r.params, r.seed) for r in batch]
        for request, state in zip(batch, states, strict=True):
            request.total_steps = len(state.timesteps)
        while not all(request.aborted for request in batch):
            pending = [(r, s) for r, s in zip(batch, states, strict=True) if not s.done]
            if not pending:
                break
            running = [s for _, s in pending]
            self.stepper.advance(running, self.stepper.predict(running))
            for request, state in pending:
                request.steps_done = state.step
        return [Latents(state.latents, state.params) for state in states]


class DecodeWork(_SplitWork):
    """``decode``: the VAE, once for the whole batch of latents, then each request's images or frames."""

    def key(self, params: OmniDiffusionSamplingParams) -> tuple:
        return self.stepper.decode_key(params)

    def _run(self, batch: list[DiffusionRequest]) -> list[list[Any]]:
        # The denoise stage may run on another device or in another dtype; on the same ones nothing is copied.
        device, dtype = self.stepper.device, self.stepper.pipeline.vae.dtype
        return self.stepper.decode([Latents(r.payload.latents.to(device, dtype), r.params) for r in batch])

    def _output(self, request: DiffusionRequest, result: list[Any], metrics: dict) -> OmniRequestOutput:
        video = self.runner.is_video
        extra = {"seed": request.seed} | ({"fps": request.params.fps} if video else {})
        return OmniRequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            images=[] if video else result,
            videos=result if video else [],
            metrics=metrics | extra,
        )


def make_work(stage_type: str, runner: DiffusionRunner, stepper: Stepper | None) -> StageWork:
    """The work of a request-mode stage of ``stage_type`` (``stepper``: the model's, for a split stage)."""
    if stage_type == "diffusion":
        return PipelineWork(runner)
    return {"encode": EncodeWork, "denoise": DenoiseWork, "decode": DecodeWork}[stage_type](runner, stepper)
