"""What a request produces: its output, its previews and the typed record of how it ran, built in one place
(`build_output`). Public, and imported by every layer; it imports nothing of the package."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class _Record(Mapping[str, Any]):
    """A typed record that also reads as a mapping of its set fields (``metrics["batch_size"]``, ``dict(metrics)``),
    the shape `OmniRequestOutput.metrics` has always had."""

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name, None) if name in self._names() else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._names() if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(kw_only=True)
class RequestMetrics(_Record):
    """How a request ran, as `OmniRequestOutput.metrics` reports it."""

    batch_size: float
    """Requests in the batch it ran in; in step mode the mean over the forwards it took part in."""
    queue_ms: float
    """Time from arrival until the engine started on it (summed over the stages of a split pipeline)."""
    exec_ms: float
    """Time from the start of its work until its output was ready (summed over the stages)."""
    seed: int
    """The seed of its generator (drawn when the request gave none)."""
    replica: int
    """Which replica of the stage ran it (of the stage that holds the denoiser, in a split pipeline)."""
    steps: int | None = None
    """Step mode: the engine steps it took part in."""
    fps: int | None = None
    """Video models: the frame rate its videos are meant to play at."""
    stages: list[StageMetrics] | None = None
    """A split pipeline: one record per stage, in request order."""


@dataclass(kw_only=True)
class StageMetrics(RequestMetrics):
    """How a request ran in one stage of a split pipeline."""

    stage_id: int
    stage_type: str

    @classmethod
    def of(cls, stage_id: int, stage_type: str, metrics: RequestMetrics) -> StageMetrics:
        return cls(stage_id=stage_id, stage_type=stage_type, **{k: v for k, v in metrics.items() if k != "stages"})


def across_stages(stages: list[StageMetrics], denoiser_id: int) -> RequestMetrics:
    """A multi-stage request's metrics: the batch size and replica of the stage that holds the denoiser (stage id
    ``denoiser_id``; a skipped llm stage has no record), the time summed over the stages, and one record per
    stage."""
    last = stages[-1]
    denoiser = next(s for s in stages if s.stage_id == denoiser_id)
    return RequestMetrics(
        batch_size=denoiser.batch_size,
        replica=denoiser.replica,
        steps=denoiser.steps,
        queue_ms=sum(s.queue_ms for s in stages),
        exec_ms=sum(s.exec_ms for s in stages),
        seed=last.seed,
        fps=last.fps,
        stages=stages,
    )


@dataclass(frozen=True)
class IgnoredField:
    """A request field that the served model would not use (a negative prompt without the guidance that reads it,
    a guidance scale without a guidance embedding, ...). Admission drops it, so the pipeline never sees it and the
    request makes what it makes without it; it is reported, never silent (docs/serving.md, "Ignored fields"), and
    refused as `SamplingParamsError` with the same ``param`` and message under ``strict_fields``."""

    param: str
    """The sampling parameter, named as `SamplingParamsError.param` names one (``extra_args.KEY`` for an
    extension)."""
    reason: str
    """Why the model would not use it, and what would make it act: its refusal's message under ``strict_fields``."""


@dataclass(frozen=True)
class Preview:
    """One partial result of a request: ``index`` counts from 0; ``images`` holds one image per output (for a
    video model, one frame of each video)."""

    index: int
    images: list[Any]


@dataclass
class OmniRequestOutput:
    """The result of one request."""

    request_id: str
    prompt: str
    images: list[Any] = field(default_factory=list)
    """``num_outputs_per_prompt`` images (PIL images, or arrays for ``output_type='np'``); empty for videos."""
    videos: list[list[Any]] = field(default_factory=list)
    """``num_outputs_per_prompt`` videos, each a list of frames like ``images``; empty for images."""
    metrics: RequestMetrics | None = None
    """How it ran; ``None`` when it failed."""
    error: str | None = None
    """Why the request failed; ``None`` on success."""
    finished: bool = True
    """``False`` for a partial result (`AsyncOmni.generate` yields them for ``partial_images``): ``images`` holds a
    preview of each output (for video, one frame of each), and ``metrics`` is ``None``."""
    partial_image_index: int | None = None
    """Which preview a partial result is, from 0."""
    revised_prompt: str | None = None
    """The prompt the deploy's llm stage wrote from ``prompt``, which the diffusion stages ran on; ``None`` when no
    llm stage ran (none is deployed, or the request set ``enhance_prompt=False``)."""
    ignored_fields: list[IgnoredField] = field(default_factory=list)
    """The fields of its sampling parameters that the model would not use: dropped before it ran."""


@dataclass
class StageOutput:
    """A request's result from a stage that is not the last: what the next stage takes, and how it ran."""

    request_id: str
    payload: Any
    """The encoded prompt (`Conditioning`, from ``encode``) or the final latents (`Latents`, from ``denoise``)."""
    metrics: RequestMetrics


def build_output(
    request_id: str, prompt: str, result: Any, metrics: RequestMetrics, *, final: bool, video: bool
) -> OmniRequestOutput | StageOutput:
    """The one place a request's output is made: images or videos from a final stage (``result``: its
    ``num_outputs_per_prompt`` items), else the payload the next stage takes."""
    if not final:
        return StageOutput(request_id, result, metrics)
    return OmniRequestOutput(
        request_id=request_id,
        prompt=prompt,
        images=[] if video else result,
        videos=result if video else [],
        metrics=metrics,
    )
