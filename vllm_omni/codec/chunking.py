"""How big each streamed chunk of a speech request is, in codec frames: the one place that decides it.

The first chunk is small, so the first audio comes fast; chunks then double up to the family's steady size, and
grow straight to it while the codec stage is busy (more windows waiting than its ``max_num_seqs``: bigger windows
are fewer decode calls). A chunk never shrinks: each one re-decodes its left context, so small chunks cost more.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_omni.codec.families import SpeechFamily


@dataclass(frozen=True)
class ChunkPlan:
    """A stream's chunk sizes: `first`, then `grow` from each size to the next."""

    first: int
    steady: int

    @classmethod
    def of(cls, family: SpeechFamily, first: int | None = None) -> ChunkPlan:
        """The family's plan; ``first``: a request's ``initial_codec_chunk_frames`` instead of the family's."""
        return cls(first=first or family.first_chunk_frames, steady=family.steady_chunk_frames)

    def grow(self, size: int, waiting_windows: int, max_num_seqs: int) -> int:
        """The chunk after one of ``size`` frames, while ``waiting_windows`` wait for a codec stage that decodes
        ``max_num_seqs`` at a time: never smaller, at most the steady size unless the first was larger."""
        if size >= self.steady:
            return size
        return self.steady if waiting_windows >= max_num_seqs else min(self.steady, 2 * size)
