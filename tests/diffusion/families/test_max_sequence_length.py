"""``max_sequence_length`` (``extra_args``; the HTTP field of the same name): what a pipeline's text encoder takes
(`ModelCard.max_sequence_length`, from the pipeline's own check or its call's default), refused naming the field
beyond it or where the call takes none, and part of the batch key (prompt embeddings of different lengths cannot
share a batch). That it reaches the pipeline call: tests/entrypoints/openai/test_clients.py."""

import pytest
from diffusers import DiffusionPipeline

from vllm_omni.diffusion.engine.request import BatchKey
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

PARAM = "extra_args.max_sequence_length"


@pytest.fixture(scope="module")
def cards(tiny_flux, tiny_sd3, tiny_wan, tiny_sd) -> dict[str, ModelCard]:
    folders = {"flux": tiny_flux, "sd3": tiny_sd3, "wan": tiny_wan, "sd": tiny_sd}
    return {
        name: ModelCard.of(DiffusionPipeline.from_pretrained(path, local_files_only=True))
        for name, path in folders.items()
    }


def completed(card: ModelCard, length) -> OmniDiffusionSamplingParams:
    params, _ = card.complete_params(OmniDiffusionSamplingParams(extra_args={"max_sequence_length": length}))
    return params


def test_the_limit_is_what_the_text_encoder_takes(cards):
    """Flux's and SD3's own check_inputs say 512 (SD3's call defaults to 256); Wan's call default, 512; SD's call
    takes none."""
    limits = {name: card.max_sequence_length for name, card in cards.items()}
    assert limits == {"flux": 512, "sd3": 512, "wan": 512, "sd": None}
    assert cards["flux"].for_task("image").max_sequence_length == 512  # FluxImg2ImgPipeline's own check


@pytest.mark.parametrize("name", ["flux", "sd3", "wan"])
def test_a_length_within_the_limit_is_kept_for_the_call(cards, name):
    for length in (1, 512):
        assert completed(cards[name], length).extra_args == {"max_sequence_length": length}


@pytest.mark.parametrize(
    ("name", "length", "words"),
    [
        ("flux", 513, "from 1 to 512 for FluxPipeline"),
        ("sd3", 1024, "from 1 to 512 for StableDiffusion3Pipeline"),
        ("wan", 0, "from 1 to 512 for WanPipeline"),
        ("flux", True, "an integer"),
        ("flux", "64", "an integer"),
    ],
)
def test_other_lengths_are_refused_naming_the_field(cards, name, length, words):
    with pytest.raises(SamplingParamsError) as refused:
        completed(cards[name], length)
    assert refused.value.param == PARAM and words in str(refused.value)


def test_a_pipeline_whose_call_takes_none_ignores_it_naming_it(cards):
    """SD's text encoder has a fixed length: the field is one the model would not use, dropped and reported (and
    refused in strict mode, as every ignored field is)."""
    params, ignored = cards["sd"].complete_params(
        OmniDiffusionSamplingParams(num_inference_steps=2, extra_args={"max_sequence_length": 77})
    )
    assert params.extra_args == {}
    assert [(i.param, "not accepted by StableDiffusionPipeline" in i.reason) for i in ignored] == [(PARAM, True)]


def test_requests_with_different_lengths_batch_apart(cards):
    short, long = (completed(cards["flux"], length) for length in (16, 32))
    assert BatchKey.of(short) != BatchKey.of(long)
    assert BatchKey.of(short) == BatchKey.of(completed(cards["flux"], 16))
