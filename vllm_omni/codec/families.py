"""The speech families, in one place: a codec-token TTS model is a causal LM (the talker) whose vocabulary holds an
audio codec's codes, and the codec that turns them into audio. Each family declares its codec, its code layout, its
prompt format, its voices, its chunk sizes and its sampling defaults once, here; the talker's tokenizer says which
family a folder is (`detect_family`), and `TalkerFormat` turns that into the token ids a deploy uses.

Imports no torch: the driver builds a `TalkerFormat` from the talker's tokenizer alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SpeechFamily:
    """One codec-token TTS family: what its talker reads and writes, and how its codec stage chunks the codes."""

    name: str
    """The family's name: ``orpheus`` or ``llasa``."""
    codec: str
    """Which codec loader decodes its codes (`vllm_omni.codec.pipeline.codecs.load_codec`): ``snac`` or ``xcodec2``."""
    codec_repo: str
    """The codec's default Hugging Face repo id, when a deploy names the talker alone."""
    code_token: str
    """The text of a code token, ``{}`` standing for its number (``<custom_token_{}>``, ``<|s_{}|>``)."""
    first_code: int
    """The number of the first code token: the code tokens are ``first_code`` .. ``first_code + codes_per_frame *
    codebook_size - 1``."""
    codes_per_frame: int
    """Code tokens per frame, the unit the codec decodes (Orpheus: 7, SNAC's levels 1 + 2 + 4; Llasa: 1)."""
    prompt_template: str
    """The talker's whole input, with ``{voice}`` and ``{prompt}``; it holds its BOS, so it is tokenized without
    adding one."""
    stop_token: str
    """The token that ends the talker's codes."""
    voices: tuple[str, ...]
    """The voices the prompt can name; empty for a single-voice model."""
    default_voice: str | None
    """The voice of a request that names none (None for a single-voice model)."""
    openai_voices: Mapping[str, str]
    """OpenAI's voice names, each mapped to one of `voices` (empty for a single-voice model, which takes any name)."""
    first_chunk_frames: int
    """Frames of a stream's first chunk: small, for a fast first audio."""
    steady_chunk_frames: int
    """Frames the chunks grow to."""
    left_context_frames: int
    """Frames decoded again before each chunk's new frames, so that its first samples see what they would see in one
    decode of the whole stream."""
    lookahead_frames: int
    """Frames after a chunk's end that must exist before it is decoded (0 for a causal decoder): its last samples see
    the frames after them, as in one decode of the whole stream."""
    sampling: Mapping[str, Any]
    """vLLM ``SamplingParams`` defaults of the talker (a request's fields override them)."""
    takes_instructions: bool = False
    """Whether the talker reads style instructions (OpenAI's ``instructions``); ignored with a warning otherwise."""

    def code_token_text(self, number: int) -> str:
        """The text of code token ``number``."""
        return self.code_token.format(number)


OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
"""OpenAI's voice names (``/v1/audio/speech``'s ``voice``)."""

_ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")

ORPHEUS = SpeechFamily(
    name="orpheus",
    codec="snac",
    codec_repo="hubertsiuzdak/snac_24khz",
    code_token="<custom_token_{}>",
    first_code=10,
    codes_per_frame=7,
    # canopylabs' engine_class.py: <custom_token_3> (start of human), the tokenizer's BOS, "voice: text", <|eot_id|>,
    # <custom_token_4> (end of human), <custom_token_5> (start of AI), <custom_token_1> (start of speech).
    prompt_template=(
        "<custom_token_3><|begin_of_text|>{voice}: {prompt}<|eot_id|><custom_token_4><custom_token_5><custom_token_1>"
    ),
    stop_token="<custom_token_2>",
    voices=_ORPHEUS_VOICES,
    default_voice="tara",
    # By register: the female voices for OpenAI's female ones, the male for the male ones.
    openai_voices=MappingProxyType(
        {
            "alloy": "tara",
            "ash": "dan",
            "ballad": "leo",
            "coral": "leah",
            "echo": "zac",
            "fable": "leo",
            "nova": "jess",
            "onyx": "dan",
            "sage": "mia",
            "shimmer": "zoe",
            "verse": "zac",
            "marin": "tara",
            "cedar": "leo",
        }
    ),
    # A frame is 2048 samples (85 ms at 24 kHz). SNAC's decoder is convolutional and symmetric: an output sample sees
    # 5,636 samples either side (`SnacCodec.receptive_field_samples`, 2.75 frames), so 3 frames of context on each
    # side make a chunk equal the one-shot decode up to float rounding. The first chunk (2 + 3 lookahead frames, 35
    # tokens) waits about as long as canopylabs' own streamer (28 tokens) and is exact where theirs is not.
    first_chunk_frames=2,
    steady_chunk_frames=16,
    left_context_frames=3,
    lookahead_frames=3,
    # canopylabs' README: temperature 0.6, top_p 0.8, repetition_penalty >= 1.1 for stable speech, 1,200 tokens.
    sampling=MappingProxyType({"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 1200}),
)

LLASA = SpeechFamily(
    name="llasa",
    codec="xcodec2",
    # transformers' Xcodec2Model reads the converted repo; HKUSTAudio/xcodec2 is the original package's layout.
    codec_repo="HKUSTAudio/xcodec2-hf",
    code_token="<|s_{}|>",
    first_code=0,
    codes_per_frame=1,
    # Llasa's README: its tokenizer's Llama 3 chat template over [user: "Convert the text to speech:" + the text
    # between TEXT_UNDERSTANDING tags, assistant: "<|SPEECH_GENERATION_START|>"], continue_final_message=True.
    prompt_template=(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{prompt}<|TEXT_UNDERSTANDING_END|><|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>"
    ),
    stop_token="<|SPEECH_GENERATION_END|>",
    voices=(),
    default_voice=None,
    openai_voices=MappingProxyType({}),
    # A frame is one code, 320 samples (20 ms at 16 kHz). XCodec2's decoder has global parts (GroupNorm over time,
    # full self-attention), so no finite context makes a chunk exact: 1 s of left context and the convolutions'
    # and ISTFT's reach (13 frames) ahead keep a chunk within the tolerance docs/models.md states (15.6 dB
    # signal-to-error on the tiny random codec, 8.2 dB without context; 2 s would give 16.9 dB for twice the work).
    first_chunk_frames=10,
    steady_chunk_frames=50,
    left_context_frames=50,
    lookahead_frames=13,
    # Llasa's README: do_sample, top_p 1, temperature 0.8, max_length 2048 (the model's context).
    sampling=MappingProxyType({"temperature": 0.8, "top_p": 1.0, "max_tokens": 2000}),
)

SPEECH_FAMILIES: dict[str, SpeechFamily] = {family.name: family for family in (ORPHEUS, LLASA)}
"""The speech families by name."""


def detect_family(tokenizer: Any) -> SpeechFamily:
    """The family whose first code token and stop token the talker's ``tokenizer`` holds as single tokens."""
    vocab = tokenizer.get_vocab()
    for family in SPEECH_FAMILIES.values():
        if family.code_token_text(family.first_code) in vocab and family.stop_token in vocab:
            return family
    raise ValueError(
        "the talker's tokenizer holds the code tokens of no speech family; known families: "
        + ", ".join(f"{f.name} ({f.code_token_text(f.first_code)})" for f in SPEECH_FAMILIES.values())
    )


class TalkerFormat:
    """A family's formats on one talker tokenizer: its prompt ids, its stop and allowed ids, its frame parser. Built
    once per deploy in the driver."""

    def __init__(self, family: SpeechFamily, tokenizer: Any, codebook_size: int):
        self.family = family
        self.tokenizer = tokenizer
        self.codebook_size = codebook_size
        vocab = tokenizer.get_vocab()
        count = family.codes_per_frame * codebook_size
        names = [family.code_token_text(family.first_code + i) for i in range(count)]
        missing = [name for name in (names[0], names[-1], family.stop_token) if name not in vocab]
        if missing:
            raise ValueError(
                f"the talker's tokenizer lacks {', '.join(missing)}: family {family.name!r} with a codebook of "
                f"{codebook_size} needs {count} code tokens {names[0]} .. {names[-1]} and {family.stop_token}"
            )
        self.first_code_id: int = vocab[names[0]]
        # The parser maps ids by arithmetic, so the code tokens must be one run of ids in order (both real models'
        # tokenizers add them so).
        if any(vocab.get(name) != self.first_code_id + i for i, name in enumerate(names)):
            raise ValueError(
                f"the talker's code tokens {names[0]} .. {names[-1]} are not contiguous ids in order; "
                f"family {family.name!r} needs them so"
            )
        self.code_ids = range(self.first_code_id, self.first_code_id + count)
        self.stop_token_ids: list[int] = [vocab[family.stop_token]]
        self.allowed_token_ids: list[int] = [*self.code_ids, *self.stop_token_ids]
        """Every code token and the stop token: vLLM's ``SamplingParams.allowed_token_ids``."""

    def prompt_token_ids(self, text: str, voice: str | None) -> list[int]:
        """The talker's input for ``text`` in ``voice`` (the family's default when None). The template holds its own
        BOS, so the tokenizer adds none: vLLM's own tokenization of the string would put a second one in front."""
        voice = voice if voice is not None else self.family.default_voice
        prompt = self.family.prompt_template.format(voice=voice or "", prompt=text)
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def talker_input(self, text: str, voice: str | None) -> dict[str, Any]:
        """What the talker takes for ``text`` in ``voice``: its prompt ids, and the family's sampling with only the
        code tokens and the stop token allowed (vLLM's ``allowed_token_ids``), under which the stage's own sampling
        and the request's go (`vllm_omni.llm.actor.LlmActor`). The offline ceiling of benchmarks/speech.py takes
        the same."""
        sampling = dict(self.family.sampling) | {
            "stop_token_ids": self.stop_token_ids,
            "allowed_token_ids": self.allowed_token_ids,
        }
        return {"prompt_token_ids": self.prompt_token_ids(text, voice), "sampling": sampling}

    def frames(self, token_ids: Sequence[int]) -> np.ndarray:
        """All complete frames in ``token_ids``: shape (frames, codes_per_frame), int64 codes; tokens that are not
        codes are skipped, and an incomplete last frame waits for its remaining codes.

        A code is ``(id - first_code_id) % codebook_size``. Orpheus gives each position of a frame its own range of
        tokens (position p's codes start at ``first_code + p * 4096``), and its reference decoder subtracts
        ``10 + p * 4096`` from the token's number: the same for a token in its position's range, and a code in range
        (not a crash in the codec) for one the talker put at the wrong position."""
        ids = np.asarray(token_ids, dtype=np.int64)
        codes = ids[(ids >= self.code_ids.start) & (ids < self.code_ids.stop)] - self.first_code_id
        per_frame = self.family.codes_per_frame
        whole = len(codes) - len(codes) % per_frame
        return (codes[:whole] % self.codebook_size).reshape(-1, per_frame)
