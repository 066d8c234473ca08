"""The Videos API's jobs: `VideoJob` (a job's state, its MP4 and thumbnail) and `VideoJobs` (the store, with its
expiry), and the encoders of what a job hands out (MP4 with PyAV, PNG), and the MP4 decoder a remix reads its source
video with."""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

from vllm_omni.entrypoints.openai.protocol import ErrorInfo, VideoObject, VideoStatus
from vllm_omni.metrics import prometheus as metrics

if TYPE_CHECKING:
    from vllm_omni.entrypoints.async_omni import AsyncOmni
    from vllm_omni.sampling_params import AdmittedParams


def encode_mp4(frames: list[Any], fps: int) -> bytes:
    """H.264 (or MPEG-4 Part 2 where the bundled FFmpeg has no x264) in an MP4 container."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_mp4(content: bytes) -> list[Image.Image]:
    """The frames of an MP4 that `encode_mp4` wrote, as RGB images (the input of a remix)."""
    import av

    with av.open(io.BytesIO(content), mode="r") as container:
        return [frame.to_image() for frame in container.decode(container.streams.video[0])]


def encode_png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass(eq=False)
class VideoJob:
    id: str
    model: str
    prompt: str
    admitted: AdmittedParams
    """Its parameters, completed once at creation (the model's defaults filled in, a seed drawn)."""
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: VideoStatus = "queued"
    completed_at: int | None = None
    finished_monotonic: float | None = None
    error: ErrorInfo | None = None
    content: bytes | None = None
    thumbnail: bytes | None = None
    """PNG of its latest preview while it runs (``partial_images``), then of its video's middle frame."""
    preview_index: int | None = None
    """Index of the preview in ``thumbnail`` while it runs."""
    revised_prompt: str | None = None
    """The prompt the llm stage wrote, once it completed (``None`` without an llm stage, or when it was skipped)."""
    log_probs: list[float] | None = None
    """With ``logprobs``, the log-probability of each stochastic step that made its video, once it completed."""
    remixed_from: str | None = None
    """The id of the video it remixes (``POST /v1/videos/{video_id}/remix``); ``None``: a new video."""
    task: asyncio.Task | None = None
    timer: metrics.PhaseTimer = field(default_factory=metrics.PhaseTimer)
    """Its phases (creation, engine, MP4 encoding), observed when it completes."""

    def view(self, omni: AsyncOmni) -> VideoObject:
        status, progress = self.status, 100 if self.status == "completed" else 0
        if status == "queued" and (found := omni.progress(self.id)) is not None and found[0] == "running":
            status, progress = "in_progress", int(100 * found[1])
        params = self.admitted.params
        assert params.num_frames is not None and params.fps is not None, "complete params of a video"
        return VideoObject(
            id=self.id,
            model=self.model,
            status=status,
            progress=progress,
            created_at=self.created_at,
            completed_at=self.completed_at,
            size=f"{params.width}x{params.height}",
            seconds=f"{params.num_frames / params.fps:g}",
            error=self.error,
            preview_index=self.preview_index if self.status == "queued" else None,
            revised_prompt=self.revised_prompt,
            log_probs=self.log_probs,
            remixed_from_video_id=self.remixed_from,
        )


class VideoJobs:
    """Jobs in creation order; finished ones expire after ``ttl_s`` or when their MP4s exceed ``max_bytes``."""

    def __init__(self, ttl_s: float, max_bytes: int):
        self.ttl_s, self.max_bytes = ttl_s, max_bytes
        self._jobs: dict[str, VideoJob] = {}

    def add(self, job: VideoJob) -> None:
        self._jobs[job.id] = job
        self.evict()

    def get(self, job_id: str) -> VideoJob | None:
        self.evict()
        return self._jobs.get(job_id)

    def pop(self, job_id: str) -> VideoJob | None:
        return self._jobs.pop(job_id, None)

    def newest_first(self) -> list[VideoJob]:
        self.evict()
        return list(reversed(self._jobs.values()))

    def evict(self) -> None:
        now = time.monotonic()
        finished = [(j, j.finished_monotonic) for j in self._jobs.values() if j.finished_monotonic is not None]
        total = sum(len(j.content or b"") for j, _ in finished)
        for job, finished_at in finished:  # oldest first
            if now - finished_at > self.ttl_s or total > self.max_bytes:
                total -= len(job.content or b"")
                del self._jobs[job.id]

    def cancel_all(self) -> None:
        for job in self._jobs.values():
            if job.task is not None:
                job.task.cancel()
