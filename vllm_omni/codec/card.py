"""`SpeechCard`: what a speech model takes and makes, read once from its family and codec (the HTTP layer reads its
attributes), and `SpeechAdmission`, how the codec stage admits a request from it alone."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from vllm_omni.codec.families import SpeechFamily
from vllm_omni.diffusion.engine.roles import Admission
from vllm_omni.errors import SamplingParamsError
from vllm_omni.outputs import IgnoredField
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

_PICTURE_FIELDS = (
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "num_frames",
    "fps",
    "audio_length",
    "audio_start",
    "negative_prompt",
    "image",
    "video",
    "mask_image",
    "strength",
    "partial_images",
)
"""Fields of a diffusion model's request that a speech model has no use for."""


@dataclass(frozen=True)
class SpeechCard:
    """A speech model: its family's voices and prompt facts, and its codec's rate."""

    family: str
    voices: tuple[str, ...]
    """The voices it speaks in; empty: one voice, which any name selects."""
    default_voice: str | None
    openai_voices: Mapping[str, str]
    """OpenAI's voice names (``alloy``, ...) and the family's voice each one selects."""
    sample_rate: int
    samples_per_frame: int
    takes_instructions: bool
    """Whether its talker reads ``instructions`` (a style prompt)."""
    max_new_tokens: int
    """The code tokens a request generates at most, unless it asks for fewer or more (``max_new_tokens``)."""
    codes_per_frame: int
    channels: int = 1
    output: Literal["speech"] = "speech"
    """What it makes: speech, which ``/v1/audio/speech`` serves (a diffusion model's card says image, video or
    audio)."""

    @classmethod
    def of(cls, family: SpeechFamily, sample_rate: int, samples_per_frame: int) -> SpeechCard:
        return cls(
            family=family.name,
            voices=family.voices,
            default_voice=family.default_voice,
            openai_voices=dict(family.openai_voices),
            sample_rate=sample_rate,
            samples_per_frame=samples_per_frame,
            takes_instructions=family.takes_instructions,
            max_new_tokens=int(family.sampling.get("max_tokens", 1200)),
            codes_per_frame=family.codes_per_frame,
        )


class SpeechAdmission:
    """A speech request completed from the card: its voice checked (or the default), its token budget, and the
    fields the model would not use listed as ignored. Every request shares one batch key: the talker's batches are
    vLLM's, the codec's are formed by window shape."""

    def __init__(self, card: SpeechCard):
        self.card = card

    def admit(self, params: OmniDiffusionSamplingParams) -> Admission:
        card, ignored = self.card, []
        update: dict[str, Any] = {}
        if params.num_outputs_per_prompt != 1:
            raise SamplingParamsError(
                "num_outputs_per_prompt", "a speech model makes one waveform per request; leave it at 1"
            )
        if card.voices and params.voice is None:
            update["voice"] = card.default_voice
        elif card.voices and params.voice not in card.voices:
            raise SamplingParamsError(
                "voice",
                f"unknown voice {params.voice!r}; this {card.family} model speaks in: {', '.join(card.voices)} "
                f"(OpenAI's names map onto them: {', '.join(sorted(card.openai_voices))})",
            )
        if params.instructions is not None and not card.takes_instructions:
            update["instructions"] = None
            ignored.append(
                IgnoredField("instructions", f"{card.family} models have no style prompt; the text is spoken as is")
            )
        for name in _PICTURE_FIELDS:
            if name in params.model_fields_set and getattr(params, name) not in (None, 0):
                update[name] = OmniDiffusionSamplingParams.model_fields[name].default
                ignored.append(IgnoredField(name, "a speech model does not take it"))
        if params.max_new_tokens is None:
            update["max_new_tokens"] = card.max_new_tokens
        return Admission(params.model_copy(update=update), self.key(params), tuple(ignored))

    def key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        return "speech"
