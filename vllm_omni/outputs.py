"""What a request produces: its output, its previews and the typed record of how it ran, built in one place
(`build_output`). Public, and imported by every layer; it imports nothing of the package."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

OutputKind = Literal["image", "video", "audio", "speech"]
"""What a model makes (`ModelCard.output`): which field of `OmniRequestOutput` carries it."""


class _Record(Mapping[str, Any]):
    """A typed record that also reads as a mapping of its set fields (``metrics["batch_size"]``, ``dict(metrics)``),
    the shape `OmniRequestOutput.metrics` has always had."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # each subclass is a dataclass

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
    audio_seconds: float | None = None
    """Audio models: the seconds of audio it made, over its ``num_outputs_per_prompt`` waveforms (each waveform's
    samples over `OmniRequestOutput.sample_rate`); what ``vllm_omni:audio_seconds_total`` counts."""
    stages: list[StageMetrics] | None = None
    """A split pipeline: one record per stage, in request order."""
    weights_version: int | None = None
    """The version of the weights it ran with: the weight updates (``update_weights``) its replica had applied, 0
    for the model's own (of the stage that holds the denoiser, in a split pipeline)."""
    prompt_tokens: int | None = None
    """Speech models: the talker's prompt tokens (the text framed in the family's format)."""
    generated_tokens: int | None = None
    """Speech models: the code tokens the talker generated."""
    first_audio_ms: float | None = None
    """Speech models: time from arrival until its first audio chunk was ready (``vllm_omni:time_to_first_audio``)."""
    underrun_gap_s: float | None = None
    """Speech models: the seconds of silence a listener playing its chunks as they came would have heard after the
    first one (``vllm_omni:speech_underrun_gap_seconds``)."""
    components: dict[str, float] | None = None
    """Milliseconds each pipeline component took on the work it took part in (``component_timings``): each text
    encoder, ``denoise`` (its steps), ``denoise_step`` (the mean step), ``vae_decode``, ``vae_encode``, ``preview``,
    ``postprocess``; a component shared by a batch counts whole for each of its requests. Summed over the stages of
    a split pipeline."""


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
        audio_seconds=last.audio_seconds,
        stages=stages,
        weights_version=denoiser.weights_version,
        components=_summed_components(stages, denoiser),
    )


def _summed_components(stages: list[StageMetrics], denoiser: StageMetrics) -> dict[str, float] | None:
    """Each component's time summed over the stages; the mean step is the denoising stage's."""
    summed: dict[str, float] = {}
    for stage in stages:
        for name, ms in (stage.components or {}).items():
            summed[name] = round(summed.get(name, 0.0) + ms, 3)
    if denoiser.components and "denoise_step" in denoiser.components:
        summed["denoise_step"] = denoiser.components["denoise_step"]
    return summed or None


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


@dataclass
class Trajectory:
    """What a request that sampled stochastically recorded (docs/rl.md): float32 tensors on the CPU, its latents in
    the layout its denoiser takes (Flux: packed tokens), over the ``W`` steps of its SDE window (every step without
    one). `OmniRequestOutput` carries each field as ``trajectory_*`` (and ``prompt_embeds``)."""

    latents: Any
    """``[n, W + 1, ...]``: each output's latents before the window's first step and after each of its steps."""
    timesteps: Any
    """``[W]``: the timestep of each window step."""
    sigmas: Any
    """``[W + 1]``: the σ of each recorded latent (the last is the σ the window's last step goes to)."""
    log_probs: Any | None
    """``[n, W]``: each step's log-probability per output (`sde.log_prob`); ``None`` without ``logprobs``."""
    prompt_embeds: dict[str, Any]
    """The denoiser's text inputs of the request's ``n`` rows, by the pipeline argument that takes them
    (``prompt_embeds``, ``pooled_prompt_embeds`` or ``prompt_embeds_mask``; ``negative_*`` where classifier-free
    guidance ran), so ``pipeline(**prompt_embeds)`` or a trainer's forward needs no text encoder."""


@dataclass(frozen=True)
class Preview:
    """One partial result of a request: ``index`` counts from 0; ``images`` holds one image per output (for a
    video model, one frame of each video)."""

    index: int
    images: list[Any]


@dataclass(frozen=True)
class AudioChunk:
    """One streamed piece of a speech request's audio: ``index`` counts from 0; ``samples`` is float32
    ``(channels, samples)`` at ``sample_rate``; the chunks in order are the whole waveform."""

    index: int
    samples: Any
    sample_rate: int


@dataclass
class OmniRequestOutput:
    """The result of one request."""

    request_id: str
    prompt: str
    images: list[Any] = field(default_factory=list)
    """``num_outputs_per_prompt`` images (PIL images, or arrays for ``output_type='np'``); empty for videos."""
    videos: list[list[Any]] = field(default_factory=list)
    """``num_outputs_per_prompt`` videos, each a list of frames like ``images``; empty for images and audio."""
    audios: list[Any] = field(default_factory=list)
    """``num_outputs_per_prompt`` waveforms of an audio model, each a float32 NumPy array shaped ``(channels,
    samples)``, the values as its VAE (or vocoder) made them: nominally in [-1, 1], not clipped (an encoder clips);
    empty for images and videos."""
    sample_rate: int | None = None
    """The rate of ``audios`` in Hz; ``None`` for images and videos."""
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
    trajectory_latents: Any | None = None
    """Stochastic sampling (``extra_args.sde_type`` ...): `Trajectory.latents`; ``None`` for plain sampling."""
    trajectory_timesteps: Any | None = None
    """`Trajectory.timesteps`."""
    trajectory_sigmas: Any | None = None
    """`Trajectory.sigmas`."""
    trajectory_log_probs: Any | None = None
    """`Trajectory.log_probs`: ``None`` without ``extra_args.logprobs``."""
    prompt_embeds: dict[str, Any] | None = None
    """`Trajectory.prompt_embeds`: the text inputs its denoiser saw."""


@dataclass
class StageOutput:
    """A request's result from a stage that is not the last: what the next stage takes, and how it ran."""

    request_id: str
    payload: Any
    """The encoded prompt (`Conditioning`, from ``encode``) or the final latents (`Latents`, from ``denoise``)."""
    metrics: RequestMetrics


def build_output(
    request_id: str,
    prompt: str,
    result: Any,
    metrics: RequestMetrics,
    *,
    final: bool,
    kind: OutputKind,
    sample_rate: int | None = None,
    trajectory: Trajectory | None = None,
) -> OmniRequestOutput | StageOutput:
    """The one place a request's output is made: images, videos or waveforms (``kind``; audio at ``sample_rate``)
    from a final stage (``result``: its ``num_outputs_per_prompt`` items) with the ``trajectory`` it recorded, else
    the payload the next stage takes."""
    if not final:
        return StageOutput(request_id, result, metrics)
    recorded = {}
    if trajectory is not None:
        recorded = {f"trajectory_{f.name}": getattr(trajectory, f.name) for f in dataclasses.fields(Trajectory)}
        recorded["prompt_embeds"] = recorded.pop("trajectory_prompt_embeds")
    return OmniRequestOutput(
        request_id=request_id,
        prompt=prompt,
        images=result if kind == "image" else [],
        videos=result if kind == "video" else [],
        audios=result if kind == "audio" else [],
        sample_rate=sample_rate if kind == "audio" else None,
        metrics=metrics,
        **recorded,
    )
