"""How a speech model admits a request from its card alone: its voice checked or defaulted (any name on a
single-voice model), its token budget, and each field it would not use listed as ignored."""

import pytest

from vllm_omni.codec.card import SpeechAdmission, SpeechCard
from vllm_omni.codec.families import SPEECH_FAMILIES
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def _admission(family: str) -> SpeechAdmission:
    return SpeechAdmission(SpeechCard.of(SPEECH_FAMILIES[family], sample_rate=24000, samples_per_frame=2048))


def test_a_request_without_a_voice_gets_the_default_and_the_familys_token_budget():
    admitted = _admission("orpheus").admit(OmniDiffusionSamplingParams())
    assert (admitted.params.voice, admitted.params.max_new_tokens) == ("tara", 1200)
    assert admitted.ignored == () and admitted.key == "speech"
    asked = _admission("orpheus").admit(OmniDiffusionSamplingParams(voice="leo", max_new_tokens=70))
    assert (asked.params.voice, asked.params.max_new_tokens) == ("leo", 70)


def test_an_unknown_voice_is_refused_naming_the_voices():
    with pytest.raises(SamplingParamsError, match=r"unknown voice 'alloy'; this orpheus model speaks in: tara") as e:
        _admission("orpheus").admit(OmniDiffusionSamplingParams(voice="alloy"))
    assert e.value.param == "voice"


def test_a_single_voice_model_takes_any_name():
    assert _admission("llasa").admit(OmniDiffusionSamplingParams(voice="nova")).params.voice == "nova"


def test_fields_a_speech_model_would_not_use_are_dropped_and_listed():
    params = OmniDiffusionSamplingParams(instructions="whisper", height=64, num_inference_steps=4, voice="mia")
    admitted = _admission("orpheus").admit(params)
    assert [field.param for field in admitted.ignored] == ["instructions", "height", "num_inference_steps"]
    assert (admitted.params.instructions, admitted.params.height, admitted.params.num_inference_steps) == (None,) * 3
    with pytest.raises(SamplingParamsError, match="one waveform per request"):
        _admission("orpheus").admit(OmniDiffusionSamplingParams(num_outputs_per_prompt=2))
