"""``speed`` (vllm_omni/entrypoints/openai/audio/tempo.py): the clip played faster or slower keeps its pitch and
takes about ``1 / speed`` of the time, mono or stereo, down to 0.25 (two ``atempo`` filters chained)."""

import numpy as np
import pytest

from vllm_omni.entrypoints.openai.audio.tempo import Tempo, change_speed

RATE = 24000
TONES = (440.0, 660.0)  # one per channel


def _tones(channels: int, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * tone * t) for tone in TONES[:channels]]).astype(np.float32)


def _pitch(channel: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(channel * np.hanning(channel.size)))
    return float(np.fft.rfftfreq(channel.size, 1 / RATE)[spectrum.argmax()])


@pytest.mark.parametrize("speed", [0.25, 0.8, 2.0, 4.0])
@pytest.mark.parametrize("channels", [1, 2])
def test_a_faster_or_slower_clip_keeps_its_pitch_and_takes_one_over_speed_of_the_time(speed, channels):
    samples = _tones(channels)
    changed = change_speed(samples, RATE, speed)
    assert changed.dtype == np.float32 and changed.shape[0] == channels
    # atempo's windows lose a few milliseconds at the ends: within 5% of the length.
    assert changed.shape[1] == pytest.approx(samples.shape[1] / speed, rel=0.05)
    bin_hz = RATE / changed.shape[1]
    for channel, tone in zip(changed, TONES, strict=False):
        assert abs(_pitch(channel) - tone) <= bin_hz  # the same tone, not tone × speed


def test_speed_one_is_the_clip_itself_and_speeds_outside_the_range_are_refused():
    samples = _tones(2)
    assert change_speed(samples, RATE, 1.0) is samples
    for speed in (0.2, 4.5):
        with pytest.raises(ValueError, match="speed must be 0.25 to 4.0"):
            change_speed(samples, RATE, speed)


@pytest.mark.parametrize("speed", [0.25, 0.8, 2.5, 4.0])
def test_a_stream_fed_a_chunk_at_a_time_makes_the_samples_of_the_whole_clip(speed):
    """What a streamed answer at ``speed`` plays (`Tempo`): the very samples of `change_speed` over the whole clip,
    whatever the chunks, a first chunk of one sample included (alone, FFmpeg's atempo fails on it above speed 2)."""
    samples = np.random.default_rng(0).uniform(-0.5, 0.5, (2, RATE)).astype(np.float32)
    whole = change_speed(samples, RATE, speed)
    tempo, pieces, start = Tempo(RATE, 2, speed), [], 0
    for size in (1, 2, 0, 2048, 7, 4096, 3000):
        pieces.append(tempo.push(samples[:, start : start + size]))
        start += size
    pieces += [tempo.push(samples[:, start:]), tempo.finish()]
    assert all(piece.shape[0] == 2 for piece in pieces)
    assert sum(piece.shape[1] for piece in pieces[:-1]) > 0, "samples come out before the end"
    assert np.array_equal(np.concatenate(pieces, axis=1), whole)


def test_a_one_sample_clip_is_played_as_it_is():
    sample = np.full((1, 1), 0.25, dtype=np.float32)
    assert np.array_equal(change_speed(sample, RATE, 4.0), sample)
