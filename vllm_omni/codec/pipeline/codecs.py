"""The codecs of the speech families: load one by family (`load_codec`) and decode windows of code frames in one
batched forward (`Codec.decode`).

Both decoders are deterministic: a window decoded in a batch equals it decoded alone, bit for bit, with the same
seed. On CPU they run without oneDNN (`_batch_invariant`), whose convolutions round a row differently by the batch
size (about 1e-6); PyTorch's own kernels compute each row alone, at about 1.45 times the time of oneDNN's for the
real SNAC's decoder (4 windows of 8 frames, 2 threads: 826 ms against 568 ms). On CUDA, cuDNN picks its kernels by
shape, and equality across batch sizes there is not checked yet (no GPU).

SNAC's decoder adds noise (`NoiseBlock`: ``torch.randn``); here the noise of each absolute sample of each noise layer
comes from a generator keyed on (the request's seed, the layer, the frame that holds the sample), so it depends on
neither the batch nor where a window starts. SNAC's decoder is otherwise convolutional: a window with
`SnacCodec.receptive_field_samples` of context on each side decodes its middle as the whole stream does, up to float
rounding. XCodec2's decoder normalizes over time (GroupNorm) and attends over the whole window, so a window only
approaches the whole stream's decode as its context grows (docs/models.md, "Speech models", gives the measured
tolerance).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from vllm_omni.codec.families import SpeechFamily


@dataclass(frozen=True)
class CodeWindow:
    """A run of one request's frames to decode: its left context, new frames and lookahead."""

    codes: np.ndarray
    """Shape (frames, codes_per_frame), int64 codes in [0, codebook_size)."""
    start_frame: int
    """The absolute index of its first frame in the request's stream (keys the decoder's noise)."""
    seed: int
    """The request's seed (keys the decoder's noise)."""


class Codec(Protocol):
    """A loaded codec: decodes windows of the same frame count in one forward."""

    sample_rate: int
    samples_per_frame: int
    codebook_size: int
    codes_per_frame: int

    def decode(self, windows: Sequence[CodeWindow]) -> list[np.ndarray]:
        """Each window's audio, float32 of shape (frames * samples_per_frame,), from one batched forward; a
        ValueError when the windows' frame counts differ."""
        ...


def load_codec(family: SpeechFamily, folder: str | os.PathLike[str], device: str = "cpu") -> Codec:
    """The codec of ``family`` from ``folder`` (a local folder in the codec's own layout), on ``device``."""
    if family.codec == "snac":
        return SnacCodec.from_pretrained(folder, device)
    if family.codec == "xcodec2":
        return Xcodec2Codec.from_pretrained(folder, device)
    raise ValueError(f"family {family.name!r} names codec {family.codec!r}; known codecs: snac, xcodec2")


def _frame_counts(windows: Sequence[CodeWindow], codes_per_frame: int, codebook_size: int) -> int:
    """The windows' common frame count; a ValueError names what differs or is out of range."""
    if not windows:
        raise ValueError("decode needs at least one window")
    shapes = {window.codes.shape for window in windows}
    if len(shapes) != 1:
        raise ValueError(f"one decode call takes windows of one shape; got {sorted(shapes)}")
    (shape,) = shapes
    if len(shape) != 2 or shape[1] != codes_per_frame or shape[0] == 0:
        raise ValueError(f"a window's codes have shape (frames > 0, {codes_per_frame}); got {shape}")
    for window in windows:
        if window.codes.min() < 0 or window.codes.max() >= codebook_size:
            raise ValueError(f"codes lie in [0, {codebook_size}); got {window.codes.min()} .. {window.codes.max()}")
    return int(shape[0])


@contextlib.contextmanager
def _batch_invariant(device: str) -> Iterator[None]:
    """A decode's context: oneDNN off on CPU (see the module's docstring), restored after; nothing on other devices.
    Not ``torch.backends.mkldnn.flags``, which also resets oneDNN's TF32 setting and warns on each call."""
    import torch

    if torch.device(device).type != "cpu":
        yield
        return
    # torch types the switch as its descriptor (ContextProp); assigning a bool is its documented use
    enabled = bool(torch.backends.mkldnn.enabled)
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled  # type: ignore[assignment]


def _splitmix64(value: int) -> int:
    """SplitMix64's finalizer: a well-mixed 64-bit key from a counter, cheap in Python (one per noise block)."""
    mask = (1 << 64) - 1
    value = (value + 0x9E3779B97F4A7C15) & mask
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & mask
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & mask
    return value ^ (value >> 31)


def noise_key(seed: int, layer: int, block: int) -> int:
    """The generator seed of noise block ``block`` (a frame) of noise layer ``layer`` for a request's ``seed``."""
    return _splitmix64(_splitmix64(_splitmix64(seed & ((1 << 64) - 1)) ^ layer) ^ block)


class _Frames:
    """The windows of the decode call in progress, which the keyed noise layers read (one call at a time)."""

    start_frames: list[int]
    seeds: list[int]


def _keyed_noise(layer: int, steps_per_frame: int, frames: _Frames, linear: Any) -> Any:
    """SNAC's ``NoiseBlock`` with its noise keyed on (seed, layer, frame) instead of drawn from torch's global
    generator: the same module maths, ``x + noise * linear(x)``."""
    import torch

    class KeyedNoiseBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = linear

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n_frames = x.shape[-1] // steps_per_frame
            rows = []
            for start, seed in zip(frames.start_frames, frames.seeds, strict=True):
                blocks = [
                    torch.randn(steps_per_frame, generator=torch.Generator().manual_seed(noise_key(seed, layer, f)))
                    for f in range(start, start + n_frames)
                ]
                rows.append(torch.cat(blocks))
            noise = torch.stack(rows)[:, None, :].to(device=x.device, dtype=x.dtype)
            return x + noise * self.linear(x)

    return KeyedNoiseBlock()


class SnacCodec:
    """SNAC (Orpheus's codec, ``hubertsiuzdak/snac_24khz``): codes in levels of 1, 2 and 4 per frame, interleaved in
    a frame as Orpheus writes them."""

    def __init__(self, model: Any, device: str = "cpu"):
        from snac.attention import LocalMHA
        from snac.layers import DecoderBlock, NoiseBlock

        if any(isinstance(module, LocalMHA) for module in model.decoder.modules()):
            # Its attention windows are aligned to the start of a decode, so a window would not decode as the stream.
            raise ValueError(
                "a SNAC decoder with local attention (attn_window_size) is not supported; the 24 kHz one has none"
            )
        self.model = model.to(device).eval()
        self.device = device
        self.sample_rate = int(model.sampling_rate)
        self.codebook_size = int(model.codebook_size)
        strides = list(model.vq_strides)
        self.latent_per_frame = strides[0]  # the coarsest level has one code per frame
        self.hop_length = int(np.prod(model.decoder_rates))
        self.samples_per_frame = self.latent_per_frame * self.hop_length
        self.order = self._frame_order(strides)
        self.codes_per_frame = len(self.order)
        self._frames = _Frames()
        self._install_keyed_noise(DecoderBlock, NoiseBlock)
        self.receptive_field_samples = self._receptive_field()

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str], device: str = "cpu") -> SnacCodec:
        from snac import SNAC

        return cls(SNAC.from_pretrained(os.fspath(folder)), device)

    @staticmethod
    def _frame_order(strides: list[int]) -> list[tuple[int, int]]:
        """(level, index in the frame) of each code of a frame, in Orpheus's order: each code followed by its two
        children at the next level, depth first (1 | 2a 4a 4b | 2b 4c 4d)."""
        if any(a != 2 * b for a, b in zip(strides, strides[1:], strict=False)) or strides[-1] != 1:
            raise ValueError(f"SNAC's levels must halve their stride down to 1 (as [4, 2, 1]); got {strides}")
        order: list[tuple[int, int]] = []

        def visit(level: int, index: int) -> None:
            order.append((level, index))
            if level + 1 < len(strides):
                visit(level + 1, 2 * index)
                visit(level + 1, 2 * index + 1)

        visit(0, 0)
        return order

    def _install_keyed_noise(self, decoder_block: Any, noise_block: Any) -> None:
        """Swap each decoder block's ``NoiseBlock`` for `_keyed_noise` (its weights kept)."""
        layer, samples_per_step = 0, self.hop_length
        for block in self.model.decoder.model:
            if not isinstance(block, decoder_block):
                continue
            inner = block.block
            samples_per_step //= inner[1].stride[0]  # the block's transposed convolution upsamples
            for i, module in enumerate(inner):
                if isinstance(module, noise_block):
                    steps = self.samples_per_frame // samples_per_step
                    inner[i] = _keyed_noise(layer, steps, self._frames, module.linear)
                    layer += 1

    def _receptive_field(self) -> int:
        """How many output samples on either side of an output sample its value depends on, bounded from the
        decoder's layers: each convolution reaches ``dilation * (kernel - 1) / 2`` steps at its rate, each transposed
        one (kernel 2 * stride) two input steps; the quantizer's levels do not cross frames."""
        import torch

        reach, samples_per_step = 0, self.hop_length
        for module in self.model.decoder.modules():
            if isinstance(module, torch.nn.ConvTranspose1d):
                reach += 2 * samples_per_step
                samples_per_step //= module.stride[0]
            elif isinstance(module, torch.nn.Conv1d):
                reach += module.dilation[0] * (module.kernel_size[0] - 1) // 2 * samples_per_step
        return reach

    def _levels(self, codes: np.ndarray) -> list[torch.Tensor]:
        """A batch's codes (windows, frames, codes_per_frame) as SNAC's levels: level l of shape (windows, frames *
        2**l), each frame's codes in time order."""
        import torch

        windows, frames, _ = codes.shape
        levels = []
        for level in range(len(self.model.vq_strides)):
            positions = [p for p, (lv, _) in enumerate(self.order) if lv == level]
            ordered = sorted(positions, key=lambda p: self.order[p][1])
            levels.append(torch.from_numpy(codes[:, :, ordered].reshape(windows, -1)).to(self.device))
        return levels

    def decode(self, windows: Sequence[CodeWindow]) -> list[np.ndarray]:
        import torch

        frames = _frame_counts(windows, self.codes_per_frame, self.codebook_size)
        self._frames.start_frames = [window.start_frame for window in windows]
        self._frames.seeds = [window.seed for window in windows]
        codes = np.stack([window.codes for window in windows]).astype(np.int64)
        with torch.inference_mode(), _batch_invariant(self.device):
            audio = self.model.decode(self._levels(codes))
        out = audio[:, 0, :].float().cpu().numpy()
        assert out.shape[1] == frames * self.samples_per_frame, (out.shape, frames)
        return list(out)


class Xcodec2Codec:
    """XCodec2 (Llasa's codec, transformers' ``Xcodec2Model``): one FSQ code per frame; nothing random."""

    codes_per_frame = 1

    def __init__(self, model: Any, device: str = "cpu"):
        self.model = model.to(device).eval()
        self.device = device
        config = model.config
        self.sample_rate = int(config.sampling_rate)
        self.samples_per_frame = int(config.hop_length)
        self.codebook_size = int(math.prod(config.quantization_levels))

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str], device: str = "cpu") -> Xcodec2Codec:
        from transformers import Xcodec2Model

        return cls(Xcodec2Model.from_pretrained(os.fspath(folder)), device)

    def decode(self, windows: Sequence[CodeWindow]) -> list[np.ndarray]:
        import torch

        _frame_counts(windows, self.codes_per_frame, self.codebook_size)
        codes = torch.from_numpy(np.stack([window.codes[:, 0] for window in windows]).astype(np.int64))
        with torch.inference_mode(), _batch_invariant(self.device):
            audio = self.model.decode(audio_codes=codes[:, None, :].to(self.device)).audio_values
        return list(audio[:, 0, :].float().cpu().numpy())
