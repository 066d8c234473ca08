"""A waveform played faster or slower at the same pitch: upstream vllm-omni's ``speed`` of its audio APIs, made with
FFmpeg's ``atempo`` filter through PyAV (upstream uses librosa's phase vocoder; ``atempo`` is WSOLA, already in the
FFmpeg that PyAV ships). CPU work that blocks: a caller on the event loop runs it in a thread."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 4.0
"""The speeds a request may ask (upstream vllm-omni's and OpenAI's bounds)."""

_ATEMPO_MIN = 0.5
"""The slowest one ``atempo`` filter plays; slower speeds chain several (0.25 is 0.5 twice)."""

_LAYOUTS = {1: "mono", 2: "stereo"}


def _factors(speed: float) -> list[float]:
    """``atempo`` factors whose product is ``speed``, each within what one filter takes."""
    factors = []
    while speed < _ATEMPO_MIN:
        factors.append(_ATEMPO_MIN)
        speed /= _ATEMPO_MIN
    return [*factors, speed]


def change_speed(samples: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """``samples`` (float, ``(channels, samples)``, 1 or 2 channels) played ``speed`` times as fast at the same
    pitch and rate: about ``samples / speed`` samples long. ``speed`` 1 returns them as they are."""
    if speed == 1.0:
        return samples
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed must be {MIN_SPEED} to {MAX_SPEED}; got {speed}")
    channels = samples.shape[0]
    layout = _LAYOUTS[channels]
    graph = av.filter.Graph()
    time_base = Fraction(1, sample_rate)
    chain = [graph.add_abuffer(format="fltp", sample_rate=sample_rate, layout=layout, time_base=time_base)]
    chain += [graph.add("atempo", f"{factor!r}") for factor in _factors(speed)]
    # Planar float out, as in: the frames come back as (channels, samples) arrays.
    chain += [graph.add("aformat", f"sample_fmts=fltp:channel_layouts={layout}"), graph.add("abuffersink")]
    graph.link_nodes(*chain).configure()
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32), format="fltp", layout=layout)
    frame.sample_rate, frame.time_base, frame.pts = sample_rate, time_base, 0
    graph.push(frame)
    graph.push(None)  # the end: atempo flushes what it holds
    pieces = []
    while True:
        try:
            pieces.append(graph.pull().to_ndarray())
        except (av.BlockingIOError, av.EOFError):
            break
    return np.concatenate(pieces, axis=1) if pieces else np.zeros((channels, 0), dtype=np.float32)
