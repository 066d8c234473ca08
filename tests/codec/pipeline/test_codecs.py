"""The codecs (vllm_omni/codec/pipeline/codecs.py) on the tiny families' codec folders: a window decodes to
frames * samples_per_frame samples, equals itself decoded alone when batched with others, and windows of one stream
with the family's context decode as the whole stream does (SNAC: up to float rounding, its receptive field covered;
XCodec2: within the signal-to-error ratio docs/models.md states)."""

import numpy as np
import pytest

from vllm_omni.codec.families import LLASA, ORPHEUS, SpeechFamily
from vllm_omni.codec.pipeline.codecs import Codec, CodeWindow, SnacCodec, load_codec
from vllm_omni.testing.models.tiny_speech import CODEBOOK_SIZE

FLOAT_ROUNDING = 1e-5
"""SNAC's streamed = one-shot tolerance: with its receptive field covered, a window's samples are the same sums as
the whole stream's, in another order (measured: 1e-6 on samples in [-1, 1])."""

XCODEC2_SNR_DB = 14.0
"""XCodec2's streamed = one-shot bound on the tiny random-weight codec (measured: 15.6 dB with Llasa's context, 8.2 dB
without context)."""


@pytest.fixture(scope="module")
def snac(tiny_orpheus) -> Codec:
    return load_codec(ORPHEUS, f"{tiny_orpheus}/codec")


@pytest.fixture(scope="module")
def xcodec2(tiny_llasa) -> Codec:
    return load_codec(LLASA, f"{tiny_llasa}/codec")


@pytest.fixture(params=["snac", "xcodec2"])
def codec(request) -> Codec:
    return request.getfixturevalue(request.param)


def _codes(codec: Codec, frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, codec.codebook_size, (frames, codec.codes_per_frame))


def stream(codec: Codec, family: SpeechFamily, codes: np.ndarray, seed: int, left: int, ahead: int) -> np.ndarray:
    """The stream's audio decoded chunk by chunk as the codec stage does: the first chunk, then steady ones, each
    window with ``left`` frames before and ``ahead`` frames after its new frames, keeping the new frames' samples."""
    spf, total, chunks, start = codec.samples_per_frame, len(codes), [], 0
    while start < total:
        size = min(family.first_chunk_frames if not chunks else family.steady_chunk_frames, total - start)
        first, end = max(0, start - left), min(total, start + size + ahead)
        (audio,) = codec.decode([CodeWindow(codes[first:end], first, seed)])
        chunks.append(audio[(start - first) * spf : (start - first + size) * spf])
        start += size
    return np.concatenate(chunks)


def test_each_window_decodes_to_frames_times_samples_per_frame(codec):
    assert codec.codebook_size == CODEBOOK_SIZE
    audio = codec.decode([CodeWindow(_codes(codec, 5), 0, 0), CodeWindow(_codes(codec, 5, 1), 7, 0)])
    assert [a.shape for a in audio] == [(5 * codec.samples_per_frame,)] * 2
    assert all(a.dtype == np.float32 and np.isfinite(a).all() and a.any() for a in audio)


def test_a_window_batched_with_others_equals_it_decoded_alone(codec):
    windows = [CodeWindow(_codes(codec, 6, i), start, seed) for i, (start, seed) in enumerate([(0, 1), (9, 2), (3, 1)])]
    batched = codec.decode(windows)
    for window, audio in zip(windows, batched, strict=True):
        np.testing.assert_array_equal(audio, codec.decode([window])[0])


def test_windows_of_other_frame_counts_or_codes_out_of_range_are_refused(codec):
    with pytest.raises(ValueError, match="one decode call takes windows of one shape"):
        codec.decode([CodeWindow(_codes(codec, 4), 0, 0), CodeWindow(_codes(codec, 5), 0, 0)])
    with pytest.raises(ValueError, match=r"codes lie in \[0, 64\)"):
        codec.decode([CodeWindow(_codes(codec, 4) + CODEBOOK_SIZE, 0, 0)])


def test_snac_reads_a_frame_in_orpheus_order(snac):
    # canopylabs' decoder: level 1 <- code 0; level 2 <- codes 1, 4; level 3 <- codes 2, 3, 5, 6
    levels = snac._levels(np.arange(14).reshape(1, 2, 7))
    assert [level.tolist() for level in levels] == [[[0, 7]], [[1, 4, 8, 11]], [[2, 3, 5, 6, 9, 10, 12, 13]]]


def test_snac_noise_is_keyed_on_the_seed(snac):
    codes = _codes(snac, 4)
    same = [snac.decode([CodeWindow(codes, 0, seed)])[0] for seed in (1, 1, 2)]
    np.testing.assert_array_equal(same[0], same[1])
    assert not np.array_equal(same[0], same[2])


def test_snacs_receptive_field_bounds_a_frames_reach_and_orpheus_context_covers_it(snac):
    assert isinstance(snac, SnacCodec)
    codes, spf = _codes(snac, 12), snac.samples_per_frame
    changed = codes.copy()
    changed[6] = (changed[6] + 1) % snac.codebook_size
    base, moved = (snac.decode([CodeWindow(c, 0, 3)])[0] for c in (codes, changed))
    reach = np.flatnonzero(base != moved)
    assert 6 * spf - reach.min() <= snac.receptive_field_samples
    assert reach.max() - (7 * spf - 1) <= snac.receptive_field_samples
    assert min(ORPHEUS.left_context_frames, ORPHEUS.lookahead_frames) * spf >= snac.receptive_field_samples


def test_snac_streamed_with_orpheus_context_equals_one_shot_up_to_rounding(snac):
    codes = _codes(snac, 40)
    whole = snac.decode([CodeWindow(codes, 0, 7)])[0]
    streamed = stream(snac, ORPHEUS, codes, 7, ORPHEUS.left_context_frames, ORPHEUS.lookahead_frames)
    assert np.abs(streamed - whole).max() < FLOAT_ROUNDING
    # without the context the chunks' edges differ: the tolerance is what the context buys
    assert np.abs(stream(snac, ORPHEUS, codes, 7, 0, 0) - whole).max() > 100 * FLOAT_ROUNDING


def _snr_db(reference: np.ndarray, audio: np.ndarray) -> float:
    return float(10 * np.log10(np.mean(reference**2) / np.mean((audio - reference) ** 2)))


def test_xcodec2_streamed_with_llasa_context_approaches_one_shot(xcodec2):
    codes = _codes(xcodec2, 300)
    whole = xcodec2.decode([CodeWindow(codes, 0, 0)])[0]
    snr = _snr_db(whole, stream(xcodec2, LLASA, codes, 0, LLASA.left_context_frames, LLASA.lookahead_frames))
    assert snr >= XCODEC2_SNR_DB
    # its time norms and attention are global: less context, further from the one-shot decode
    assert _snr_db(whole, stream(xcodec2, LLASA, codes, 0, 0, 0)) < snr - 3
