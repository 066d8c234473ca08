"""Audio samples as OpenAI's six ``response_format`` values, encoded with PyAV (FFmpeg), at once or as a stream.

An `AudioEncoder` takes float samples, ``(channels, samples)`` (a 1-D array is mono), one chunk at a time, and
returns the bytes each chunk completes; `encode_audio` is one call of it over the whole waveform. The bytes of a
stream, concatenated, decode to the same samples as the one-shot file of the same waveform, whatever the chunking
(tests/entrypoints/openai/audio/test_encoding.py checks every format): the encoder sees the same codec frames either
way, because PyAV's `AudioResampler` re-frames the samples to the codec's frame size before the codec.

| format | what | media type | rate | decoded length |
|---|---|---|---|---|
| ``wav`` | 16-bit PCM in RIFF WAVE | ``audio/wav`` | any | exact |
| ``pcm`` | raw 16-bit signed little-endian, channels interleaved | ``audio/pcm`` | any | exact |
| ``flac`` | 16-bit FLAC | ``audio/flac`` | any | exact |
| ``mp3`` | LAME's MP3, no ID3 tag, no Xing/Info frame | ``audio/mpeg`` | MPEG's 9 | 1,105 more, whole frames |
| ``opus`` | Opus in Ogg | ``audio/ogg`` | 48 kHz | exact |
| ``aac`` | AAC-LC in ADTS | ``audio/aac`` | AAC's 13 | 1,024 more, whole frames |

Samples beyond [-1, 1] are clipped to it, never wrapped. A rate the codec cannot take is resampled (PyAV's
`AudioResampler`, FFmpeg's swresample) to the lowest rate it takes above it, or its highest; `AudioEncoder.sample_rate`
is the rate of the answer, known before the first byte (`response_headers`). Opus is always 48 kHz: every decoder
plays Opus at 48 kHz (RFC 7845 §5.1: the input rate in its header is only a hint), so the answer's rate is the rate a
client hears. MP3 and ADTS have nowhere to say how many samples the encoder primed and padded: the decoded waveform
starts with the codec's delay (silence) and ends on a whole frame.

Streamed containers (``stream=True``):

- ``wav``: the RIFF and ``data`` sizes are 0xFFFFFFFF, the "unknown length" that OpenAI's streamed WAV and upstream
  vllm-omni's streamed speech write; decoders read such a file to its end. A one-shot WAV has its true sizes.
- ``flac``: STREAMINFO's total samples and MD5 are 0 ("unknown", as the FLAC format allows); a one-shot FLAC has them.
- ``mp3``: no ID3v2 tag and no Xing/Info frame in either mode, so a stream is MPEG frames only and any concatenation of
  its chunks plays as one stream (the price: the decoder cannot drop the priming, see above).
- ``opus``: one Opus packet (20 ms) per Ogg page, so a chunk's audio leaves with its call rather than with the next;
  the muxer keeps the last page of a call back (it marks the end of the stream in ``finish``). One-shot Ogg uses
  FFmpeg's 1-second pages.
- ``aac``, ``pcm``: no header; every chunk is frames only.

A codec frame that a chunk leaves incomplete comes out with a later chunk: MP3 and AAC hold about a frame and their
look-ahead, FLAC a block (about 0.1 s: 4,608 samples at 44.1 or 48 kHz), Opus its 20 ms frame and last page.

Encoding is CPU work that blocks: a caller on the event loop runs it in a thread.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal, cast, get_args

import av
import numpy as np
from av.audio.stream import AudioStream

from vllm_omni.errors import SamplingParamsError

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
"""OpenAI's ``response_format`` values for audio, in its order; a request model declares its field with it."""

AUDIO_FORMATS: tuple[str, ...] = get_args(AudioFormat)

SAMPLE_RATE_HEADER = "X-Sample-Rate"
"""The response header that gives the answer's sample rate (Hz): what a ``pcm`` client must know to play the bytes;
the name OpenAI-compatible speech servers use for it (sglang-omni's among them; OpenAI and upstream vllm-omni send
none)."""

CHANNELS_HEADER = "X-Channels"
"""The response header that gives the answer's number of channels (interleaved in ``pcm``)."""

_CHANNEL_LAYOUTS = {1: "mono", 2: "stereo"}

_COMMON_OPTIONS = {"fflags": "+bitexact"}
"""No FFmpeg version strings in the files (WAV's LIST/INFO chunk, the Vorbis comment's, AAC's fill element)."""

_STREAM_OPTIONS = {"flush_packets": "1"}
"""A stream's muxer hands each packet's bytes to the sink at once, not when its 32 KiB buffer fills (FFmpeg's
default leaves that to the output)."""


@dataclass(frozen=True)
class _Format:
    """How one ``response_format`` is made."""

    container: str
    """FFmpeg's muxer."""
    codec: str
    """FFmpeg's encoder."""
    sample_format: str
    """The encoder's input sample format (``s16``: 16-bit integers, ``flt``/``fltp``: float)."""
    media_type: str
    rates: tuple[int, ...] | None = None
    """The rates the answer may have; ``None``: those the encoder lists (any rate when it lists none)."""
    options: dict[str, str] = field(default_factory=dict)
    """The muxer's options, streamed or not."""
    stream_options: dict[str, str] = field(default_factory=dict)
    """The muxer's options when streaming."""


FORMATS: dict[str, _Format] = {
    "mp3": _Format("mp3", "libmp3lame", "fltp", "audio/mpeg", options={"id3v2_version": "0", "write_xing": "0"}),
    "opus": _Format("ogg", "libopus", "flt", "audio/ogg", rates=(48000,), stream_options={"page_duration": "20000"}),
    "aac": _Format("adts", "aac", "fltp", "audio/aac"),
    "flac": _Format("flac", "flac", "s16", "audio/flac", options={"metadata_header_padding": "0"}),
    "wav": _Format("wav", "pcm_s16le", "s16", "audio/wav"),
    "pcm": _Format("s16le", "pcm_s16le", "s16", "audio/pcm"),
}
"""Each ``response_format``: upstream vllm-omni's media types (``opus`` is Opus in Ogg, as OpenAI serves it)."""


def check_response_format(response_format: str) -> AudioFormat:
    """``response_format`` if it is one of `AUDIO_FORMATS`; else a `SamplingParamsError` naming the field and them."""
    if response_format not in FORMATS:
        raise SamplingParamsError(
            "response_format",
            f"response_format must be one of {', '.join(AUDIO_FORMATS)}; got {response_format!r}",
        )
    return cast(AudioFormat, response_format)


def output_sample_rate(response_format: str, sample_rate: int) -> int:
    """The rate ``response_format`` answers audio made at ``sample_rate`` with: the same rate where the format takes
    it, else the lowest rate it takes above it, or its highest."""
    spec = FORMATS[check_response_format(response_format)]
    rates = spec.rates or av.Codec(spec.codec, "w").audio_rates
    if not rates or sample_rate in rates:
        return sample_rate
    return min((rate for rate in rates if rate > sample_rate), default=max(rates))


def response_headers(sample_rate: int, channels: int) -> dict[str, str]:
    """The headers that say an audio answer's rate and channels (`SAMPLE_RATE_HEADER`, `CHANNELS_HEADER`): needed
    to play ``pcm``, which has no header of its own; the same on every format."""
    return {SAMPLE_RATE_HEADER: str(sample_rate), CHANNELS_HEADER: str(channels)}


@dataclass(frozen=True)
class EncodedAudio:
    """A whole waveform, encoded."""

    data: bytes
    response_format: AudioFormat
    media_type: str
    """The ``Content-Type`` of the answer."""
    sample_rate: int
    """The rate of the encoded audio (after any resampling), in Hz."""
    channels: int

    def headers(self) -> dict[str, str]:
        """`response_headers` of this audio."""
        return response_headers(self.sample_rate, self.channels)


class _StreamSink:
    """Where a stream's muxer writes: no ``seek``, so FFmpeg writes each header once, as a stream needs it."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        """The bytes written since the last call."""
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class AudioEncoder:
    """One waveform in ``response_format``, made at ``sample_rate`` Hz with ``channels`` channels (1 or 2), fed a
    chunk at a time (`encode`), then `finish`.

    ``stream=True``: each call returns the bytes it completed, to send as they come (the containers' streamed
    shapes, in the module's docstring). ``stream=False``: the container's header is completed at the end (WAV's
    sizes, FLAC's total samples and MD5), so `encode` returns nothing and `finish` the whole file."""

    def __init__(self, response_format: str, sample_rate: int, channels: int, *, stream: bool = True):
        self.response_format = check_response_format(response_format)
        if channels not in _CHANNEL_LAYOUTS:
            raise ValueError(f"audio has {channels} channels; 1 (mono) or 2 (stereo) are encoded")
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be a positive number of Hz; got {sample_rate}")
        spec = FORMATS[self.response_format]
        self.media_type = spec.media_type
        self.input_rate = sample_rate
        """The rate of the samples `encode` takes."""
        self.sample_rate = output_sample_rate(self.response_format, sample_rate)
        """The rate of the encoded audio."""
        self.channels = channels
        self._layout = _CHANNEL_LAYOUTS[channels]
        self._sink: _StreamSink | io.BytesIO = _StreamSink() if stream else io.BytesIO()
        options = {**_COMMON_OPTIONS, **spec.options, **(_STREAM_OPTIONS | spec.stream_options if stream else {})}
        self._container = av.open(self._sink, "w", format=spec.container, container_options=options)
        # PyAV's encode resamples each frame with an AudioResampler to this format, rate and layout, and re-frames
        # it to the codec's frame size.
        self._stream = cast(
            AudioStream,
            self._container.add_stream(
                spec.codec, rate=self.sample_rate, layout=self._layout, options={"flags": "+bitexact"}
            ),
        )
        self._stream.format = spec.sample_format
        self._container.start_encoding()  # the header, also for a waveform that never gets a sample
        self._samples_in = 0
        self._finished = False

    def headers(self) -> dict[str, str]:
        """`response_headers` of this audio, known before the first byte."""
        return response_headers(self.sample_rate, self.channels)

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode the next chunk (float, ``(channels, samples)``, or 1-D for mono); what it completed when
        streaming, else ``b""``."""
        if self._finished:
            raise RuntimeError("the encoder is finished")
        chunk = self._checked(samples)
        if chunk.shape[1]:
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=self._layout)
            frame.sample_rate = self.input_rate
            frame.time_base = Fraction(1, self.input_rate)
            frame.pts = self._samples_in
            self._samples_in += chunk.shape[1]
            self._container.mux(self._stream.encode(frame))
        return self._sink.take() if isinstance(self._sink, _StreamSink) else b""

    def finish(self) -> bytes:
        """Flush the resampler, the codec and the muxer: the stream's last bytes, or the whole file."""
        if self._finished:
            raise RuntimeError("the encoder is finished")
        self._finished = True
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._sink.take() if isinstance(self._sink, _StreamSink) else self._sink.getvalue()

    def _checked(self, samples: np.ndarray) -> np.ndarray:
        """``samples`` as the planar float32 ``(channels, samples)`` array a frame is made of, clipped to [-1, 1]."""
        array = np.asarray(samples)
        if array.ndim == 1:
            array = array[np.newaxis]
        if array.ndim != 2 or array.shape[0] != self.channels:
            raise ValueError(f"audio samples must be (channels={self.channels}, samples); got shape {array.shape}")
        if array.dtype.kind != "f":
            raise ValueError(f"audio samples must be floats in [-1, 1]; got {array.dtype}")
        if not np.isfinite(array).all():
            raise ValueError("audio samples must be finite; got NaN or infinity")
        # Clipped here, in float: a 16-bit format then saturates at full scale, and a float codec is not fed
        # beyond it (it would not wrap, but would clip on playback).
        return np.ascontiguousarray(np.clip(array, -1.0, 1.0), dtype=np.float32)


def encode_audio(samples: np.ndarray, sample_rate: int, response_format: str) -> EncodedAudio:
    """The whole waveform ``samples`` (float, ``(channels, samples)`` or 1-D mono, at ``sample_rate`` Hz) as one
    ``response_format`` file."""
    channels = 1 if np.ndim(samples) == 1 else int(np.shape(samples)[0])
    encoder = AudioEncoder(response_format, sample_rate, channels, stream=False)
    encoder.encode(samples)
    data = encoder.finish()
    return EncodedAudio(data, encoder.response_format, encoder.media_type, encoder.sample_rate, channels)
