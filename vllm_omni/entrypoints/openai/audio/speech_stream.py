"""The body of a ``POST /v1/audio/speech`` answer, sent as the speech is made: each chunk the engine yields is played
at the request's ``speed`` (`Tempo`) and encoded in its ``response_format`` (`AudioEncoder`, streamed), and the bytes
it completes go out at once, as they are (``stream_format: audio``) or in OpenAI's server-sent events
(``speech.audio.delta``, then ``speech.audio.done`` with the usage). Every format streams: the bytes, concatenated,
are the file (encoding.py); ``atempo`` streams too, so ``speed`` holds back only its window (tempo.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import types
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import numpy as np
from fastapi import Request

from vllm_omni.entrypoints.openai.audio.encoding import AudioEncoder
from vllm_omni.entrypoints.openai.audio.tempo import Tempo
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.errors import APIError, error_info
from vllm_omni.entrypoints.openai.outcomes import Outcome, next_output
from vllm_omni.entrypoints.openai.protocol import SpeechAudioDeltaEvent, SpeechAudioDoneEvent, SpeechUsage
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


class SpeechAudio:
    """One request's audio as it is made, at ``sample_rate`` Hz with ``channels`` channels: played ``speed`` times
    as fast, then encoded in ``response_format``, a chunk at a time (`encode`), then to its end (`finish`). CPU
    work that blocks: the stream runs it in a worker thread."""

    def __init__(self, response_format: str, sample_rate: int, channels: int, speed: float):
        self.encoder = AudioEncoder(response_format, sample_rate, channels, stream=True)
        self.tempo = Tempo(sample_rate, channels, speed) if speed != 1.0 else None
        self.samples = 0
        """Samples of the waveform that chunks carried so far."""

    def encode(self, chunk: np.ndarray) -> bytes:
        """The next chunk of the waveform; the bytes it completed."""
        self.samples += chunk.shape[-1]
        return self.encoder.encode(chunk if self.tempo is None else self.tempo.push(chunk))

    def finish(self, waveform: np.ndarray) -> bytes:
        """The whole ``waveform`` is made: what no chunk carried of it (all of it from an engine that does not
        stream), then the end of the tempo filter and of the file."""
        rest = waveform[..., self.samples :]
        data = self.encode(rest) if rest.shape[-1] else b""
        if self.tempo is not None:
            data += self.encoder.encode(self.tempo.finish())
        return data + self.encoder.finish()


async def speech_body(
    raw_request: Request,
    sse: bool,
    audio: SpeechAudio,
    first: OmniRequestOutput,
    generation: AsyncGenerator[OmniRequestOutput, None],
    timer: metrics.PhaseTimer,
    params: OmniDiffusionSamplingParams,
) -> AsyncIterator[bytes | str]:
    """The answer's body from its ``first`` output on: the audio's bytes as each output completes them, or with
    ``sse`` the events that carry them, counted in ``vllm_omni:speech_generation_requests`` when it ends. A client
    that goes away aborts the request. A failure after the first output is an ``error`` event of the error envelope
    in ``sse``; a stream of audio bytes has no place for it, so its connection is closed before the file's end
    (the client sees a body cut short, not a complete file)."""
    with Outcome(metrics.speech_requests, value="failed") as outcome:
        try:
            output = first
            while True:
                part = audio.finish if output.finished else audio.encode
                data = await asyncio.to_thread(part, output.audios[0])
                if data:
                    yield _delta(data) if sse else data
                if output.finished:
                    timer.mark_engine(output, params)
                    if sse:
                        yield _sse(SpeechAudioDoneEvent(usage=_usage(output)).model_dump())
                    outcome.completed()
                    timer.mark("response")
                    timer.observe("speech")
                    return
                try:
                    output = await next_output(raw_request, generation, outcome)
                except ClientDisconnected:
                    return
                except APIError as error:
                    if not sse:
                        raise
                    envelope = error_info(error.status, error.message, error.param, error.code).model_dump()
                    yield _sse({"type": "error", "error": envelope})
                    return
        finally:
            # Aborts the request if it is still running (as the Images API's stream: image_stream.py).
            if not cast(types.AsyncGeneratorType, generation).ag_running:
                await generation.aclose()


def _usage(output: OmniRequestOutput) -> SpeechUsage:
    """The talker's tokens: its prompt's (the text in the family's format) and the codec tokens it generated."""
    ran = output.metrics
    assert ran is not None, "a finished output has its metrics"
    prompt, generated = ran.prompt_tokens or 0, ran.generated_tokens or 0
    return SpeechUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)


def _delta(data: bytes) -> str:
    return _sse(SpeechAudioDeltaEvent(audio=base64.b64encode(data).decode()).model_dump())


def _sse(data: dict[str, Any]) -> str:
    """An event of OpenAI's speech stream: a ``data`` line alone, as OpenAI sends them (no ``event`` line)."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
