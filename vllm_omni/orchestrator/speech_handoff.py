"""The chunked hand-off of a speech request from its talker (an ``llm`` stage in ``mode: tts``) to its codec stage,
and of its audio, in order, to whoever streams it: the one owner of a request's stream.

The talker's new token ids arrive as vLLM makes them (`tokens`, on the thread that reads the talker's stream). Each
time enough complete frames are there for the next chunk (`ChunkPlan`), the chunk's window (its new frames after a
left context, and the frames its decoder looks ahead to) goes to a codec replica, due when the stream would run out
of audio played in real time. Decoded windows come back in any order; their new frames' samples are handed on in
order (``on_chunk``), and when the talker has finished (`close`) and every chunk is out, the whole waveform is the
request's output (``on_done``). Whole-request stages never come here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from vllm_omni.codec.chunking import ChunkPlan
from vllm_omni.codec.engine.window_queue import WindowJob
from vllm_omni.codec.pipeline.codecs import CodeWindow
from vllm_omni.errors import RequestAbortedError, StageUnavailableError
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.orchestrator.codec_replicas import DecodedWindow, Speech
from vllm_omni.orchestrator.stage_runtime import StageRuntime
from vllm_omni.outputs import AudioChunk, OmniRequestOutput, RequestMetrics, StageOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

Done = Callable[[OmniRequestOutput | None, BaseException | None], None]
"""What a stream calls once: its output, or why it failed."""


@dataclass(eq=False)
class _Stream:
    """One speech request's stream, from its talker's first token to its last chunk."""

    request_id: str
    prompt: str
    params: OmniDiffusionSamplingParams
    plan: ChunkPlan
    on_chunk: Callable[[AudioChunk], None] | None
    on_done: Done
    size: int
    """The frames of the next chunk."""
    arrived: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    skip: int = 0
    """Tokens a talker re-run makes again (same seed) that this stream has already."""
    emitted: int = 0
    """Frames whose samples are in a chunk sent to the codec stage."""
    submitted: list[float] = field(default_factory=list)
    """Each chunk sent, by index: the seconds of audio it holds."""
    decoded: dict[int, tuple[np.ndarray, DecodedWindow]] = field(default_factory=dict)
    delivered: list[np.ndarray] = field(default_factory=list)
    talker: StageOutput | None = None
    """The talker's output once it has finished."""
    first_audio: float | None = None
    runs_out: float = 0.0
    """When a listener who started at the first chunk has played everything delivered so far."""
    gap: float = 0.0
    windows: list[DecodedWindow] = field(default_factory=list)
    over: bool = False


class SpeechHandoff:
    """The streams of a speech deploy's requests: from the talker's tokens to the codec stage's windows to the
    request's chunks. Thread-safe (the talker's readers, the codec replicas' threads and the engine call it)."""

    def __init__(self, codec: StageRuntime, speech: Speech):
        self.codec = codec
        self.speech = speech
        self.card = speech.card
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.RLock()

    def talker_input(self, prompt: str, params: OmniDiffusionSamplingParams) -> dict:
        """What the talker's actor takes for a request: the prompt framed in the family's format with its voice,
        and the family's sampling (only code tokens and the stop token may be generated), under the stage's own;
        its ``max_new_tokens`` goes as vLLM's ``max_tokens`` (`LlmReplica`)."""
        return self.speech.talker.talker_input(prompt, params.voice)

    def open(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        on_chunk: Callable[[AudioChunk], None] | None,
        on_done: Done,
    ) -> None:
        plan = ChunkPlan.of(self.speech.family, params.initial_codec_chunk_frames)
        with self._lock:
            self._streams[request_id] = _Stream(request_id, prompt, params, plan, on_chunk, on_done, plan.first)

    def rerun(self, request_id: str) -> None:
        """The talker runs the request again (its replica was lost): the tokens it makes again are skipped."""
        with self._lock:
            if (stream := self._streams.get(request_id)) is not None:
                stream.skip = len(stream.tokens)

    def tokens(self, request_id: str, delta: list[int]) -> None:
        """The talker's new token ids; sends every chunk they complete."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.over:
                return
            skipped = min(stream.skip, len(delta))
            stream.skip -= skipped
            stream.tokens += delta[skipped:]
            self._cut(stream, final=False)

    def close(self, request_id: str, talker: StageOutput) -> None:
        """The talker has finished: the frames left go as the last chunk."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.over:
                return
            stream.talker = talker
            self._cut(stream, final=True)
            self._deliver(stream)

    def abort(self, request_id: str) -> None:
        """Stop the stream (its waiting windows are dropped) and fail it `RequestAbortedError`."""
        self._end(request_id, None, RequestAbortedError(request_id))

    def discard(self, request_id: str) -> None:
        """Forget the stream of a request that ended elsewhere (its talker failed or was aborted)."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.over = True
        if stream is not None:
            self._drop_windows(request_id)

    def _cut(self, stream: _Stream, final: bool) -> None:
        """Send each chunk that the frames so far complete (``final``: and the rest)."""
        family = self.speech.family
        frames = self.speech.talker.frames(stream.tokens)
        while len(frames) - stream.emitted - family.lookahead_frames >= stream.size:
            end = stream.emitted + stream.size
            self._send(stream, frames, end, end + family.lookahead_frames)
            waiting = self.codec.num_waiting
            stream.size = stream.plan.grow(stream.size, waiting, self.codec.stage_config.max_num_seqs)
        if final and len(frames) > stream.emitted:
            self._send(stream, frames, len(frames), len(frames))

    def _send(self, stream: _Stream, frames: np.ndarray, end: int, window_end: int) -> None:
        """The chunk of frames ``[stream.emitted, end)`` to a codec replica, decoded from ``left_context_frames``
        before it up to ``window_end``."""
        family, card = self.speech.family, self.card
        start = max(0, stream.emitted - family.left_context_frames)
        keep = slice((stream.emitted - start) * card.samples_per_frame, (end - start) * card.samples_per_frame)
        index = len(stream.submitted)
        # Due when a listener runs out of what came before it (the first chunk: at once).
        started = stream.first_audio if stream.first_audio is not None else stream.arrived
        due = started + stream.gap + sum(stream.submitted)
        stream.submitted.append((end - stream.emitted) * card.samples_per_frame / card.sample_rate)
        stream.emitted = end
        window = CodeWindow(frames[start:window_end], start, stream.params.seed or 0)
        job = WindowJob(stream.request_id, window, due, stream.params.priority)
        replica = self.codec.route("speech")
        if replica is None:
            error = StageUnavailableError(self.codec.stage_id, "no replica is alive", stream.request_id)
            self._end(stream.request_id, None, error)
            return
        future = self.codec.replicas[replica].submit(stream.request_id, "", stream.params, job)
        future.add_done_callback(lambda done: self._decoded(stream, index, replica, keep, done))

    def _decoded(self, stream: _Stream, index: int, replica: int, keep: slice, done: Future) -> None:
        self.codec.release(replica, "speech")
        if done.exception() is not None:
            self._end(stream.request_id, None, done.exception())
            return
        with self._lock:
            if stream.over:
                return
            window: DecodedWindow = done.result()
            stream.decoded[index] = (window.samples[keep], window)
            self._deliver(stream)

    def _deliver(self, stream: _Stream) -> None:
        """Hand on the decoded chunks that are next in order; finish once the talker is done and all are out."""
        while len(stream.delivered) in stream.decoded:
            index = len(stream.delivered)
            samples, window = stream.decoded.pop(index)
            now = time.monotonic()
            seconds = len(samples) / self.card.sample_rate
            if stream.first_audio is None:
                stream.first_audio, stream.runs_out = now, now
            stream.gap += max(0.0, now - stream.runs_out)
            stream.runs_out = max(now, stream.runs_out) + seconds
            stream.delivered.append(samples)
            stream.windows.append(window)
            if stream.on_chunk is not None:
                stream.on_chunk(AudioChunk(index, samples[None, :], self.card.sample_rate))
        if stream.talker is not None and len(stream.delivered) == len(stream.submitted):
            self._end(stream.request_id, self._output(stream), None)

    def _output(self, stream: _Stream) -> OmniRequestOutput:
        assert stream.talker is not None, "a stream finishes after its talker"
        waveform = np.concatenate(stream.delivered) if stream.delivered else np.zeros(0, np.float32)
        elapsed = time.monotonic() - stream.arrived
        seconds = len(waveform) / self.card.sample_rate
        talker = stream.talker.metrics
        first_audio = None if stream.first_audio is None else stream.first_audio - stream.arrived
        if first_audio is not None:
            metrics.time_to_first_audio.observe(first_audio)
            metrics.speech_underrun_gap.observe(stream.gap)
        if seconds:
            metrics.speech_real_time_factor.observe(elapsed / seconds)
        windows = stream.windows or [DecodedWindow(waveform, 1, 0.0, 0.0)]
        return OmniRequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt,
            audios=[waveform[None, :]],
            sample_rate=self.card.sample_rate,
            metrics=RequestMetrics(
                batch_size=sum(w.batch_size for w in windows) / len(windows),
                queue_ms=talker.queue_ms + 1000.0 * sum(w.queue_s for w in stream.windows),
                exec_ms=elapsed * 1000.0,
                seed=talker.seed,
                replica=talker.replica,
                audio_seconds=seconds,
                prompt_tokens=stream.talker.payload["prompt_tokens"],
                generated_tokens=stream.talker.payload["generated_tokens"],
                first_audio_ms=None if first_audio is None else first_audio * 1000.0,
                underrun_gap_s=stream.gap,
            ),
        )

    def _end(self, request_id: str, output: OmniRequestOutput | None, error: BaseException | None) -> None:
        """The stream is over: its callback, once."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None or stream.over:
                return
            stream.over = True
        if error is not None:
            self._drop_windows(request_id)
        stream.on_done(output, error)

    def _drop_windows(self, request_id: str) -> None:
        for replica in self.codec.replicas:
            replica.abort(request_id)
