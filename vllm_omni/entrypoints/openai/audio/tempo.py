"""A waveform played faster or slower at the same pitch: upstream vllm-omni's ``speed`` of its audio APIs, made with
FFmpeg's ``atempo`` filter through PyAV (upstream uses librosa's phase vocoder; ``atempo`` is WSOLA, already in the
FFmpeg that PyAV ships). `Tempo` takes the waveform a chunk at a time, as a stream is made (``atempo`` holds only its
window), and hands back the samples each chunk completes; `change_speed` is one call of it over a whole waveform. CPU
work that blocks: a caller on the event loop runs it in a thread."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0
"""The speeds a request may ask (upstream vllm-omni's and OpenAI's bounds)."""

_ATEMPO_MIN = 0.5
"""The slowest one ``atempo`` filter plays; slower speeds chain several (0.25 is 0.5 twice)."""

_LAYOUTS = {1: "mono", 2: "stereo"}

_FRAME = 1024
"""Samples per frame pushed into ``atempo`` (`Tempo.push`)."""

_FIRST_FRAME_MIN = 2
"""Samples the first frame into ``atempo`` holds at least: a one-sample first frame at a speed above 2 fails in
FFmpeg (ENOMEM), so a first chunk of one sample waits for the next."""


def _factors(speed: float) -> list[float]:
    """``atempo`` factors whose product is ``speed``, each within what one filter takes."""
    factors = []
    while speed < _ATEMPO_MIN:
        factors.append(_ATEMPO_MIN)
        speed /= _ATEMPO_MIN
    return [*factors, speed]


class Tempo:
    """Samples (float, ``(channels, samples)``, 1 or 2 channels, at ``sample_rate`` Hz) played ``speed`` times as
    fast at the same pitch and rate, fed a chunk at a time (`push`), then `finish`: the pieces, concatenated, are
    the samples `change_speed` makes of the whole waveform, whatever the chunking."""

    def __init__(self, sample_rate: int, channels: int, speed: float):
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be {MIN_SPEED} to {MAX_SPEED}; got {speed}")
        self.channels = channels
        self._layout = _LAYOUTS[channels]
        self._rate = sample_rate
        self._time_base = Fraction(1, sample_rate)
        self._graph = av.filter.Graph()
        chain = [
            self._graph.add_abuffer(
                format="fltp", sample_rate=sample_rate, layout=self._layout, time_base=self._time_base
            )
        ]
        chain += [self._graph.add("atempo", f"{factor!r}") for factor in _factors(speed)]
        # Planar float out, as in: the frames come back as (channels, samples) arrays.
        chain += [
            self._graph.add("aformat", f"sample_fmts=fltp:channel_layouts={self._layout}"),
            self._graph.add("abuffersink"),
        ]
        self._graph.link_nodes(*chain).configure()
        self._samples_in = 0
        self._held = np.zeros((channels, 0), dtype=np.float32)
        """The start of the waveform, until it makes a first frame of `_FIRST_FRAME_MIN` samples."""
        self._finished = False

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The next chunk in; the samples out that it completed (none while ``atempo`` fills its window)."""
        if self._finished:
            raise RuntimeError("the tempo stream is finished")
        chunk = np.ascontiguousarray(samples, dtype=np.float32)
        if self._samples_in == 0 and self._held.shape[1] + chunk.shape[1] < _FIRST_FRAME_MIN:
            self._held = np.concatenate([self._held, chunk], axis=1)
            return self._held[:, :0]
        if self._held.shape[1]:
            chunk, self._held = np.concatenate([self._held, chunk], axis=1), self._held[:, :0]
        pieces = []
        # atempo hands on at most one output buffer (sized from one input frame) per frame pushed, and keeps the
        # rest: a long chunk pushed whole would come out a frame late. Short frames keep it a short frame behind.
        for start in range(0, chunk.shape[1], _FRAME):
            piece = np.ascontiguousarray(chunk[:, start : start + _FRAME])
            frame = av.AudioFrame.from_ndarray(piece, format="fltp", layout=self._layout)
            frame.sample_rate, frame.time_base, frame.pts = self._rate, self._time_base, self._samples_in
            self._samples_in += piece.shape[1]
            self._graph.push(frame)
            pieces.append(self._pull())
        return np.concatenate(pieces, axis=1) if pieces else chunk[:, :0]

    def finish(self) -> np.ndarray:
        """The end of the waveform: the samples ``atempo`` still held."""
        if self._finished:
            raise RuntimeError("the tempo stream is finished")
        self._finished = True
        if self._held.shape[1]:  # a waveform of one sample: there is no tempo to change, it is played as it is
            return self._held
        self._graph.push(None)  # the end: atempo flushes what it holds
        return self._pull()

    def _pull(self) -> np.ndarray:
        pieces = []
        while True:
            try:
                pieces.append(self._graph.pull().to_ndarray())
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(pieces, axis=1) if pieces else np.zeros((self.channels, 0), dtype=np.float32)


def change_speed(samples: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """``samples`` (float, ``(channels, samples)``, 1 or 2 channels) played ``speed`` times as fast at the same
    pitch and rate: about ``samples / speed`` samples long. ``speed`` 1 returns them as they are."""
    if speed == 1.0:
        return samples
    tempo = Tempo(sample_rate, samples.shape[0], speed)
    return np.concatenate([tempo.push(samples), tempo.finish()], axis=1)
