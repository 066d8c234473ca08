"""An audio model through `Omni`: the tiny Stable Audio (`vllm_omni.testing.models.tiny_audio`, its real scheduler with
SDE
noise) in request mode. Batched requests equal stock diffusers called for each alone, the waveforms are the asked
length at the model's rate, a clip the model cannot make is refused naming the field, the picture fields are
dropped as fields it would not use, and the audio seconds are counted and the audio components timed."""

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams, SamplingParamsError
from vllm_omni.diffusion.features.step_cache import CallCache
from vllm_omni.testing.checks.stock import stock_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RATE = 44100  # the tiny model's VAE's sampling_rate
LONGEST = 32 * 2048 / RATE  # its transformer's sample_size × the VAE's hop length
TOLERANCE = 1e-4
"""Worst sample difference allowed between a request batched and alone (the CPU measures ~3e-7 in float32: other
GEMM tilings), and a hundred times under what two seeds differ by."""


def _params(seed: int, **fields) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(**{"num_inference_steps": 3, "guidance_scale": 3.0, "seed": seed} | fields)


def _stock(model: str, prompt: str, seed: int, length: float, start: float = 0.0, **call) -> np.ndarray:
    """Stock diffusers for one request alone, with one generator for its waveforms (``num_waveforms_per_prompt``)."""
    out = stock_pipeline(model)(
        prompt=prompt,
        audio_start_in_s=start,
        audio_end_in_s=start + length,
        num_inference_steps=3,
        guidance_scale=3.0,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        **call,
    )
    return out.audios


def _audio_seconds(omni) -> float:
    (replica,) = omni.engine.stages[0].replicas
    for family in replica.collect_metrics():
        for sample in family.samples:
            if sample.name == "vllm_omni:audio_seconds_total":
                return sample.value
    raise AssertionError("vllm_omni:audio_seconds_total is not exported")


@pytest.fixture(scope="module")
def omni(tiny_stable_audio):
    with Omni(model=tiny_stable_audio, max_num_seqs=2, request_batch_max_wait_ms=2000) as omni:
        yield omni


def test_two_requests_batched_equal_stock_diffusers_alone_at_the_asked_length(omni, tiny_stable_audio):
    card = omni.model_card
    assert (card.pipeline_name, card.output, card.audio.sample_rate) == ("StableAudioPipeline", "audio", RATE)
    before = _audio_seconds(omni)
    prompts = ["a dog barking", "rain on a roof"]
    outputs = omni.generate(prompts, [_params(seed, audio_length=1.0) for seed in (1, 2)])
    made = []
    for output, prompt, seed in zip(outputs, prompts, (1, 2), strict=True):
        assert output.error is None and output.metrics["batch_size"] == 2
        assert output.sample_rate == RATE and output.images == output.videos == []
        (waveform,) = output.audios
        assert waveform.dtype == np.float32 and waveform.shape == (2, RATE)  # (channels, samples): 1.0 s
        assert np.isfinite(waveform).all() and waveform.std() > 1e-3, "a constant or broken waveform"
        assert np.abs(waveform - _stock(tiny_stable_audio, prompt, seed, 1.0)[0]).max() <= TOLERANCE
        assert output.metrics["audio_seconds"] == 1.0
        made.append(waveform)
    assert np.abs(made[0] - made[1]).max() > 100 * TOLERANCE  # two prompts and seeds: the bar tells them apart
    assert _audio_seconds(omni) - before == 2.0
    components = outputs[0].metrics["components"]  # the audio's conditioners, its Oobleck decode, each step
    assert {"text_encoder", "projection_model", "denoise", "denoise_step", "vae_decode"} <= set(components)


def test_a_requests_waveforms_each_have_their_own_sde_noise_batched_or_alone(omni, tiny_stable_audio):
    """Two waveforms of one request, with a start and a negative prompt: equal to stock diffusers called alone with
    one generator, whose Brownian noise is one tree over the request's rows (the runner's generator per row would
    give both rows one seed), batched with another request or alone."""
    fields = dict(audio_start=0.25, audio_length=0.5, negative_prompt="a cat", num_outputs_per_prompt=2)
    alone = omni.generate(["a red car"], _params(7, **fields))[0]
    batched = omni.generate(["a red car", "a blue house"], [_params(7, **fields), _params(8, **fields)])[0]
    assert (alone.metrics["batch_size"], batched.metrics["batch_size"]) == (1, 2)
    stock = _stock(
        tiny_stable_audio, "a red car", 7, 0.5, start=0.25, negative_prompt="a cat", num_waveforms_per_prompt=2
    )
    assert [w.shape for w in alone.audios] == [(2, int(0.75 * RATE) - int(0.25 * RATE))] * 2
    for got_alone, got_batched, want in zip(alone.audios, batched.audios, stock, strict=True):
        assert np.abs(got_alone - want).max() <= TOLERANCE
        assert np.abs(got_batched - got_alone).max() <= TOLERANCE
    assert np.abs(alone.audios[0] - alone.audios[1]).max() > 100 * TOLERANCE
    assert alone.metrics["audio_seconds"] == pytest.approx(2 * alone.audios[0].shape[-1] / RATE)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"audio_length": 2.0}, "audio_length", f"at most {LONGEST:g}"),
        ({"audio_length": -1.0}, "audio_length", "must be more than 0"),
        ({"audio_length": 0.0}, "audio_length", "must be more than 0"),
        ({"audio_start": 1.0, "audio_length": 0.6}, "audio_length", "from audio_start=1"),
        ({"audio_start": LONGEST}, "audio_start", f"below {LONGEST:g}"),
        ({"audio_start": -0.5}, "audio_start", "0 or more"),
        ({"partial_images": 1}, "partial_images", "it makes audio"),
        ({"extra_args": {"sde_type": "sde"}}, "extra_args.sde_type", "StableAudioPipeline makes audio"),
        ({"num_inference_steps": 2, "extra_args": {"audio_end_in_s": 1.0}}, "extra_args.audio_end_in_s", "may not"),
    ],
)
def test_a_clip_the_model_cannot_make_is_refused_naming_the_field_and_the_range(omni, fields, param, says):
    with pytest.raises(SamplingParamsError) as refused:
        omni.admit(OmniDiffusionSamplingParams(**fields))
    assert refused.value.param == param and says in str(refused.value)


def test_the_picture_fields_are_dropped_and_a_clip_defaults_to_the_longest(omni):
    admitted = omni.admit(OmniDiffusionSamplingParams(height=64, width=64, num_frames=9, audio_start=0.5))
    assert [f.param for f in admitted.ignored] == ["height", "width", "num_frames"]
    assert "StableAudioPipeline makes audio" in admitted.ignored[0].reason
    params = admitted.params
    assert (params.height, params.width, params.num_frames) == (None, None, None)
    assert params.audio_start == 0.5 and params.audio_length == pytest.approx(LONGEST - 0.5)
    assert (params.num_inference_steps, params.guidance_scale) == (100, 7.0)  # StableAudioPipeline's defaults


@pytest.mark.parametrize(
    ("fixture", "pipeline_class", "channels", "hop"),
    [
        ("tiny_stable_audio_3", "StableAudio3Pipeline", 2, 1),  # trimmed to the asked samples
        ("tiny_longcat_audio", "LongCatAudioDiTPipeline", 1, 256),  # whole latent frames, rounded down
        ("tiny_ace_step", "AceStepPipeline", 2, 1920),  # rounded up
    ],
)
def test_the_other_audio_families_batched_equal_stock_diffusers_alone(request, fixture, pipeline_class, channels, hop):
    """Each family's clip length reaches its own argument (``duration``, ``audio_duration_s``, ``audio_duration``),
    and ACE-Step's lyrics go one per prompt. The prompts tokenize to the same length: diffusers 0.42's ACE-Step
    moves a padded prompt's waveform by ~1e-3 when it batches prompts of different lengths (docs/models.md)."""
    model = request.getfixturevalue(fixture)
    prompts = ["a photo of a cat", "a photo of a dog"]
    with Omni(model=model, max_num_seqs=2, request_batch_max_wait_ms=2000) as omni:
        card = omni.model_card
        assert card.pipeline_name == pipeline_class and card.output == "audio"
        outputs = omni.generate(prompts, [_params(seed, num_inference_steps=2, audio_length=0.5) for seed in (1, 2)])
    rate, length_arg = card.audio.sample_rate, card.audio.call_args(0.5, None)
    for output, prompt, seed in zip(outputs, prompts, (1, 2), strict=True):
        assert output.error is None and output.metrics["batch_size"] == 2 and output.sample_rate == rate
        (waveform,) = output.audios
        assert waveform.shape[0] == channels and abs(waveform.shape[1] - 0.5 * rate) < hop
        assert output.metrics["audio_seconds"] == waveform.shape[1] / rate
        stock = stock_pipeline(model)(
            prompt,
            num_inference_steps=2,
            guidance_scale=3.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            **length_arg,
        ).audios[0]
        assert np.abs(waveform - stock).max() <= TOLERANCE


def test_cache_dit_refuses_at_start_up_a_config_that_leaves_stable_audios_blocks_nothing_to_cache(tiny_stable_audio):
    """Stable Audio's DiT names no repeated blocks: its transformer_blocks are what cache-dit caches, counted before
    it asserts on the first request."""
    transformer = stock_pipeline(tiny_stable_audio).transformer
    with pytest.raises(ValueError, match="Fn_compute_blocks 8 .* leave none of the 2 blocks of StableAudioDiTModel"):
        CallCache([transformer], None)  # cache-dit's default config computes 8 blocks in full
