"""OpenAI's ``POST /v1/audio/speech`` and upstream's ``GET /v1/audio/voices``.

First the answer's body without a server (`SpeechAudio`: each chunk at its speed, encoded as it comes): what leaves
chunk by chunk is byte for byte what one call over the whole waveform makes, at any speed, in every format.
"""

import numpy as np
import pytest

from vllm_omni.entrypoints.openai.audio.encoding import AUDIO_FORMATS
from vllm_omni.entrypoints.openai.audio.speech_stream import SpeechAudio

RATE = 24000  # Orpheus's SNAC
FRAME = 2048
"""Samples per SNAC frame: the engine's chunks are whole frames."""


def _speech(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    rising = 0.4 * np.sin(2 * np.pi * (180 * t + 300 * t * t))
    return (rising + 0.02 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)[np.newaxis]


@pytest.mark.parametrize("speed", [1.0, 1.25, 0.5])
@pytest.mark.parametrize("response_format", AUDIO_FORMATS)
def test_the_chunks_of_a_stream_make_the_bytes_of_the_whole_waveform(response_format, speed):
    """Chunks of 2 then 16 frames, as the engine sizes them, then the finished output's whole waveform: the bytes,
    concatenated, are those an engine that yields no chunk gets for the same waveform, and most leave before the
    end (a codec frame and atempo's window are all they hold back)."""
    waveform = _speech()
    streamed = SpeechAudio(response_format, RATE, 1, speed)
    pieces, start = [], 0
    for frames in (2, 16, 16):
        pieces.append(streamed.encode(waveform[:, start : start + frames * FRAME]))
        start += frames * FRAME
    pieces.append(streamed.finish(waveform))
    whole = SpeechAudio(response_format, RATE, 1, speed).finish(waveform)
    assert b"".join(pieces) == whole
    assert sum(len(piece) for piece in pieces[:-1]) > len(whole) / 2, [len(piece) for piece in pieces]
