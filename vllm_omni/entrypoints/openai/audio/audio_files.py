"""The answer of ``POST /v1/audio/generate``: each waveform at the request's speed, encoded in its format off the
event loop (`encode_waveforms`), and the file itself, or a zip of several, with its media type, rate, channels and
usage headers (`audio_response`)."""

from __future__ import annotations

import asyncio
import io
import zipfile
from typing import TYPE_CHECKING

import numpy as np
from fastapi.responses import Response

from vllm_omni.entrypoints.openai.audio.encoding import EncodedAudio, encode_audio
from vllm_omni.entrypoints.openai.audio.tempo import change_speed
from vllm_omni.entrypoints.openai.images.image_files import attachment

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.protocol import AudioGenerationRequest
    from vllm_omni.entrypoints.openai.server_state import ServerState

INPUT_TOKENS_HEADER = "X-Usage-Input-Tokens"
"""The request's usage, as the Images API counts its ``usage.input_tokens`` (the tokens of ``input`` and
``negative_prompt`` by the model's prompt tokenizer): a header, since the answer's body is the audio itself."""


def _encode(waveform: np.ndarray, sample_rate: int, response_format: str, speed: float) -> EncodedAudio:
    return encode_audio(change_speed(waveform, sample_rate, speed), sample_rate, response_format)


async def encode_waveforms(
    waveforms: list[np.ndarray], sample_rate: int, response_format: str, speed: float
) -> list[EncodedAudio]:
    """The waveforms played at ``speed`` (`change_speed`) in ``response_format``, off the event loop: one worker
    thread each (FFmpeg's filters and encoders run without the GIL)."""
    return await asyncio.gather(
        *(asyncio.to_thread(_encode, waveform, sample_rate, response_format, speed) for waveform in waveforms)
    )


def usage_headers(state: ServerState, body: AudioGenerationRequest) -> dict[str, str]:
    """`INPUT_TOKENS_HEADER`, for a model folder with a tokenizer (none without, as the Images API answers without
    ``usage``). One tokenizer call: it runs on the event loop."""
    tokenizer = state.prompt_tokenizer
    if tokenizer is None:
        return {}
    texts = [text for text in (body.input, body.negative_prompt) if text]
    return {INPUT_TOKENS_HEADER: str(sum(len(tokenizer(text, verbose=False).input_ids) for text in texts))}


def audio_response(encoded: list[EncodedAudio], name: str, headers: dict[str, str]) -> Response:
    """The audio file, or for several a zip of ``audio_0.<format>``, ``audio_1.<format>``, ... (stored: the audio is
    compressed already, or raw), as an attachment named ``<name>.<format|zip>`` (``name``: the request's id), with
    the rate and channels of its audio (`EncodedAudio.headers`) and ``headers``."""
    first = encoded[0]
    extension = first.response_format
    headers = {**first.headers(), **headers}  # one model, one rate: every waveform of a request has the same
    if len(encoded) == 1:
        headers |= attachment(f"{name}.{extension}")
        return Response(first.data, media_type=first.media_type, headers=headers)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zipped:
        for i, audio in enumerate(encoded):
            zipped.writestr(f"audio_{i}.{extension}", audio.data)
    return Response(archive.getvalue(), media_type="application/zip", headers={**headers, **attachment(f"{name}.zip")})
