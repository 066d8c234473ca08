"""The audio encoder (vllm_omni/entrypoints/openai/audio/encoding.py): each of the six formats decodes with PyAV at
its rate, channels and length; samples out of range are clipped; rates a codec cannot take are resampled; ``pcm`` is
raw 16-bit little-endian; MP3 has no ID3 tag or Xing/Info frame; a stream's chunks decode to the one-shot samples.
A quarter second of audio per case: the module runs in about a second."""

import io
import struct

import av
import numpy as np
import pytest

from vllm_omni.entrypoints.openai.audio.encoding import (
    AUDIO_FORMATS,
    AudioEncoder,
    encode_audio,
    output_sample_rate,
)
from vllm_omni.errors import SamplingParamsError

RATE = 24000
SECONDS = 0.25
LAYOUTS = {1: "mono", 2: "stereo"}

PRIMING = {"mp3": 1105, "aac": 1024}
"""Samples of codec delay before the audio, which MP3 without a Xing/LAME frame and ADTS cannot tell a decoder to
drop: LAME's 576-sample encoder delay plus the MP3 decoder's 529; AAC's 1,024. The decoded length is the asked length
plus this, rounded up to a whole frame (less than one frame more: `FRAME`). Opus's priming is its pre-skip, which the
Ogg header gives and decoders drop, and its padding is trimmed by the last page's granule position: exact, as the
uncompressed formats are."""

FRAME = {"mp3": 1152, "aac": 1024}
"""Samples per frame: the most the last frame's padding adds (an MP3 at 24 kHz or less has 576-sample frames)."""

DECODED_AS = {
    "wav": ("wav", "pcm_s16le"),
    "pcm": ("s16le", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "mp3float"),
    "opus": ("ogg", "opus"),
    "aac": ("aac", "aac"),  # FFmpeg's ADTS demuxer is named aac
}
"""What FFmpeg finds in each format: its demuxer and its decoder."""

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}

LOSSLESS = ("wav", "pcm", "flac")


def _chirp(rate: int, samples: int, channels: int) -> np.ndarray:
    """A different rising tone per channel: no two delays of it look alike, so a decoded copy is found at one place."""
    t = np.arange(samples) / rate
    tones = [0.5 * np.sin(2 * np.pi * (200 * t + 800 * t * t)), 0.4 * np.sin(2 * np.pi * (300 * t + 600 * t * t))]
    return np.stack(tones[:channels])


def _decode(data: bytes, response_format: str, rate: int = RATE, channels: int = 1):
    """``(demuxer, decoder, rate, channels, samples)``, the samples as float ``(channels, n)`` in [-1, 1]. ``pcm``
    has no header: it is read as the s16le demuxer with ``rate`` and ``channels``, as its response headers give."""
    options = {"sample_rate": str(rate), "ch_layout": LAYOUTS[channels]} if response_format == "pcm" else {}
    fmt = "s16le" if response_format == "pcm" else None
    with av.open(io.BytesIO(data), format=fmt, options=options) as container:
        stream = container.streams.audio[0]
        frames = [_planar(frame) for frame in container.decode(stream)]
        context = stream.codec_context
        samples = np.concatenate(frames, axis=1) if frames else np.zeros((context.channels, 0))
        return container.format.name, context.name, context.sample_rate, context.channels, samples


def _planar(frame: av.AudioFrame) -> np.ndarray:
    array = frame.to_ndarray()
    if not frame.format.is_planar:  # (1, samples × channels), interleaved
        array = array.reshape(-1, len(frame.layout.channels)).T
    return array / 32768.0 if array.dtype == np.int16 else array.astype(np.float64)


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("response_format", AUDIO_FORMATS)
def test_every_format_decodes_at_its_rate_channels_and_length(response_format, channels):
    asked = int(RATE * SECONDS)
    samples = _chirp(RATE, asked, channels)
    encoded = encode_audio(samples[0] if channels == 1 else samples, RATE, response_format)  # mono as a 1-D array

    rate = 48000 if response_format == "opus" else RATE  # every Opus decoder plays 48 kHz: the encoder answers it
    demuxer, decoder, decoded_rate, decoded_channels, decoded = _decode(encoded.data, response_format, rate, channels)
    assert (demuxer, decoder) == DECODED_AS[response_format]
    assert (encoded.media_type, encoded.sample_rate, encoded.channels) == (MEDIA_TYPES[response_format], rate, channels)
    assert (decoded_rate, decoded_channels) == (rate, channels)
    assert encoded.headers() == {"X-Sample-Rate": str(rate), "X-Channels": str(channels)}
    assert b"Lavf" not in encoded.data and b"Lavc" not in encoded.data  # no FFmpeg version strings

    asked_at_rate = asked * rate // RATE
    priming = PRIMING.get(response_format, 0)
    assert asked_at_rate + priming <= decoded.shape[1] < asked_at_rate + priming + FRAME.get(response_format, 1)
    # The audio itself, after the priming: the tone at the answer's rate.
    expected, heard = _chirp(rate, asked_at_rate, channels), decoded[:, priming : priming + asked_at_rate]
    for channel in range(channels):
        if response_format in LOSSLESS:
            np.testing.assert_allclose(heard[channel], expected[channel], atol=1 / 32768)
        else:
            assert np.corrcoef(heard[channel], expected[channel])[0, 1] > 0.95


@pytest.mark.parametrize(
    ("response_format", "rate", "answered"),
    [
        ("opus", 22050, 48000),
        ("opus", 16000, 48000),
        ("mp3", 96000, 48000),  # above MPEG's rates: the highest
        ("mp3", 7000, 8000),  # between: the next one up
        ("aac", 7000, 7350),
        ("aac", 96000, 96000),
        ("wav", 22050, 22050),  # any rate
        ("flac", 7000, 7000),
    ],
)
def test_rates_a_format_cannot_take_are_resampled(response_format, rate, answered):
    asked = int(rate * SECONDS)
    tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(asked) / rate)
    encoded = encode_audio(tone, rate, response_format)

    assert encoded.sample_rate == answered == output_sample_rate(response_format, rate)
    _, _, decoded_rate, _, decoded = _decode(encoded.data, response_format, answered)
    assert decoded_rate == answered
    # Resampled, not relabelled: the same seconds (up to the resampler's rounding, a sample), the same 440 Hz.
    priming, length = PRIMING.get(response_format, 0), round(asked * answered / rate)
    assert length + priming - 1 <= decoded.shape[1] <= length + priming + FRAME.get(response_format, 1)
    heard = decoded[0, priming:]
    peak_hz = np.argmax(np.abs(np.fft.rfft(heard))) * answered / len(heard)
    assert abs(peak_hz - 440) < 10


@pytest.mark.parametrize("response_format", AUDIO_FORMATS)
def test_out_of_range_samples_are_clipped_not_wrapped(response_format):
    """A 100 Hz square wave between 1.5 and -3. Wrapped into 16 bits, 1.5 would come back as -0.5; unclipped, a
    float codec would give back 1.5 and 3."""
    t = np.arange(int(RATE * SECONDS)) / RATE
    square = np.where(np.sin(2 * np.pi * 100 * t) >= 0, 1.5, -3.0)
    encoded = encode_audio(square, RATE, response_format)
    _, _, rate, _, decoded = _decode(encoded.data, response_format)

    expected = np.repeat(np.sign(square), rate // RATE)  # the clipped wave, at the answer's rate (Opus: twice)
    heard = decoded[0, PRIMING.get(response_format, 0) :][: len(expected)]
    if response_format in LOSSLESS:  # full scale: 32767 and -32768
        np.testing.assert_array_equal(heard * 32768, np.where(expected > 0, 32767, -32768))
    else:  # a lossy codec rings at the edges, but keeps the signs and the full-scale level
        assert np.mean(np.sign(heard) == expected) > 0.95
        assert 0.85 < np.median(np.abs(heard)) < 1.15


@pytest.mark.parametrize("response_format", LOSSLESS)
def test_lossless_formats_carry_16_bit_samples_exactly(response_format):
    levels = np.random.default_rng(0).integers(-32768, 32768, size=(2, 4000))
    encoded = encode_audio(levels / 32768, RATE, response_format)
    _, _, _, _, decoded = _decode(encoded.data, response_format, RATE, 2)
    np.testing.assert_array_equal(decoded * 32768, levels)


def test_pcm_is_raw_16_bit_little_endian_interleaved_without_a_header():
    levels = np.random.default_rng(1).integers(-32768, 32768, size=(2, 4000))
    encoded = encode_audio(levels / 32768, 16000, "pcm")
    assert encoded.data == levels.T.astype("<i2").tobytes()  # frame by frame: left, right
    assert encoded.headers() == {"X-Sample-Rate": "16000", "X-Channels": "2"}


def _mp3_streamed(samples: np.ndarray) -> bytes:
    encoder = AudioEncoder("mp3", RATE, 1)
    return b"".join([encoder.encode(chunk) for chunk in np.array_split(samples, 5)] + [encoder.finish()])


def test_mp3_has_no_id3_tag_and_no_xing_or_info_frame():
    samples = _chirp(RATE, int(RATE * SECONDS), 1)[0]
    for data in (encode_audio(samples, RATE, "mp3").data, _mp3_streamed(samples)):
        assert data[0] == 0xFF and data[1] & 0xE0 == 0xE0, data[:4]  # it starts on an MPEG frame header
        assert b"ID3" not in data[:10] and b"TAG" not in data[-128:]
        assert b"Xing" not in data and b"Info" not in data


# Chunk boundaries in samples: uneven, one of them empty, one of a single sample.
BOUNDARIES = [1, 700, 700, 2500, 4400, 6613]


@pytest.mark.parametrize("response_format", AUDIO_FORMATS)
def test_streamed_chunks_decode_to_the_one_shot_samples(response_format):
    rate = 22050  # opus resamples it
    samples = _chirp(rate, int(rate * 0.3), 2)
    one_shot = encode_audio(samples, rate, response_format)

    encoder = AudioEncoder(response_format, rate, 2)
    assert encoder.headers() == one_shot.headers()  # known before the first byte
    parts = [encoder.encode(chunk) for chunk in np.split(samples, BOUNDARIES, axis=1)]
    parts.append(encoder.finish())
    assert b"".join(parts[:-2]), "the stream's bytes come as its chunks do, not all at the end"

    streamed = b"".join(parts)
    if response_format == "pcm":
        assert streamed == one_shot.data
        return
    _, _, streamed_rate, _, heard = _decode(streamed, response_format)
    _, _, one_shot_rate, _, expected = _decode(one_shot.data, response_format)
    assert streamed_rate == one_shot_rate == one_shot.sample_rate
    np.testing.assert_array_equal(heard, expected)


def test_a_streamed_header_leaves_the_length_unknown_and_a_one_shot_header_gives_it():
    samples = _chirp(RATE, int(RATE * SECONDS), 1)

    def streamed(response_format: str) -> bytes:
        encoder = AudioEncoder(response_format, RATE, 1)
        return encoder.encode(samples) + encoder.finish()

    # WAV: the RIFF and data sizes, 0xFFFFFFFF when streamed (OpenAI's and upstream's streamed WAV).
    wav = encode_audio(samples, RATE, "wav").data
    assert struct.unpack("<I", wav[4:8])[0] == len(wav) - 8 and struct.unpack("<I", wav[40:44])[0] == len(wav) - 44
    assert streamed("wav")[:44] == wav[:4] + b"\xff" * 4 + wav[8:40] + b"\xff" * 4
    # FLAC: STREAMINFO's 36-bit total samples (after rate, channels and bits), 0 when streamed.
    flac = encode_audio(samples, RATE, "flac").data

    def total_samples(data: bytes) -> int:
        return int.from_bytes(data[18:26], "big") & (1 << 36) - 1

    assert (total_samples(flac), total_samples(streamed("flac"))) == (samples.shape[1], 0)


@pytest.mark.parametrize("response_format", ["wav", "flac"])
def test_an_encoder_finished_without_samples_answers_an_empty_file(response_format):
    _, _, rate, channels, decoded = _decode(AudioEncoder(response_format, RATE, 2).finish(), response_format)
    assert (rate, channels, decoded.shape[1]) == (RATE, 2, 0)


def test_an_unknown_format_is_refused_naming_the_field_and_the_six_values():
    for make in (lambda: encode_audio(np.zeros(10), RATE, "ogg"), lambda: AudioEncoder("m4a", RATE, 1)):
        with pytest.raises(SamplingParamsError) as refused:
            make()
        assert isinstance(refused.value, ValueError) and refused.value.param == "response_format"
        assert "response_format must be one of mp3, opus, aac, flac, wav, pcm" in str(refused.value)


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        (np.zeros((3, 10)), r"\(channels=2, samples\)"),
        (np.zeros((2, 2, 10)), r"\(channels=2, samples\)"),
        (np.zeros((2, 10), dtype=np.int16), "floats"),
        (np.full((2, 10), np.nan), "finite"),
    ],
)
def test_samples_that_are_not_the_stream_s_shape_or_float_are_refused(samples, reason):
    with pytest.raises(ValueError, match=reason):
        AudioEncoder("wav", RATE, 2).encode(samples)


def test_only_mono_and_stereo_are_encoded():
    with pytest.raises(ValueError, match="1 \\(mono\\) or 2 \\(stereo\\)"):
        encode_audio(np.zeros((6, 10)), RATE, "wav")
