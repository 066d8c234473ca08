"""Chunk sizes of a speech stream: a small first chunk, doubling to the steady size, straight to it while the codec
stage is busy, never smaller."""

import pytest

from vllm_omni.codec.chunking import ChunkPlan
from vllm_omni.codec.families import SPEECH_FAMILIES


def _sizes(plan: ChunkPlan, waiting: list[int], max_num_seqs: int = 4) -> list[int]:
    sizes = [plan.first]
    for queued in waiting:
        sizes.append(plan.grow(sizes[-1], queued, max_num_seqs))
    return sizes


def test_chunks_double_from_the_first_to_the_steady_size_when_the_codec_keeps_up():
    assert _sizes(ChunkPlan(first=2, steady=16), [0] * 5) == [2, 4, 8, 16, 16, 16]


def test_chunks_jump_to_the_steady_size_once_windows_wait_for_max_num_seqs():
    assert _sizes(ChunkPlan(first=2, steady=16), [0, 4, 0]) == [2, 4, 16, 16]


def test_a_first_chunk_above_the_steady_size_never_shrinks():
    assert _sizes(ChunkPlan(first=40, steady=16), [0, 9]) == [40, 40, 40]


@pytest.mark.parametrize("family", sorted(SPEECH_FAMILIES))
def test_each_familys_plan_starts_small_unless_the_request_says(family):
    spec = SPEECH_FAMILIES[family]
    assert ChunkPlan.of(spec) == ChunkPlan(spec.first_chunk_frames, spec.steady_chunk_frames)
    assert spec.first_chunk_frames < spec.steady_chunk_frames
    assert ChunkPlan.of(spec, 7).first == 7
