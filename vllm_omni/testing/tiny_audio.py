"""Tiny random-weight audio pipelines, built offline in their real folder layouts (``vllm-omni make-tiny-model
--family stable-audio``): as in :mod:`vllm_omni.testing.tiny_models`, each is its real pipeline class over its real
component classes, a few channels wide, and nothing is downloaded. Random weights make noise: they test structure
and equalities (batched = alone = stock diffusers), not sound."""

from __future__ import annotations

import torch

from vllm_omni.testing.tiny_tokenizers import make_t5_tokenizer

STABLE_AUDIO_RATE = 44100
"""The tiny Stable Audio's sample rate: Stable Audio Open's, so that every audio format takes it as it is."""


def build_tiny_stable_audio():
    """Stable Audio Open's layout: T5 + StableAudioProjectionModel (the text and the clip's start and end seconds) +
    StableAudioDiTModel + AutoencoderOobleck (stereo, 44.1 kHz, a hop of 2048 samples, as the real one), stepped by
    the real checkpoint's CosineDPMSolverMultistepScheduler (SDE noise from torchsde's Brownian trees). Its
    transformer's 32 latent samples make clips of up to 32 × 2048 / 44100 ≈ 1.49 s."""
    from diffusers import CosineDPMSolverMultistepScheduler, StableAudioPipeline
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = make_t5_tokenizer(max_length=128)  # Stable Audio Open's T5 takes 128 tokens
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=1, num_heads=2)
    ).eval()
    projection_model = StableAudioProjectionModel(
        text_encoder_dim=32,  # == T5 d_model
        conditioning_dim=16,
        min_value=0,  # seconds, as Stable Audio Open's number conditioners
        max_value=512,
    )
    transformer, vae = _stable_audio_transformer(), _oobleck_vae()
    scheduler = CosineDPMSolverMultistepScheduler(  # Stable Audio Open 1.0's scheduler_config.json
        sigma_min=0.3,
        sigma_max=500.0,
        sigma_data=1.0,
        sigma_schedule="exponential",
        solver_order=2,
        prediction_type="v_prediction",
        rho=7.0,
        solver_type="midpoint",
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    return StableAudioPipeline(
        vae=vae,
        text_encoder=text_encoder,
        projection_model=projection_model,
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=scheduler,
    )


def _stable_audio_transformer():
    """The DiT over 4 latent channels, conditioned by the projection's 16-wide text and seconds."""
    from diffusers import StableAudioDiTModel

    return StableAudioDiTModel(
        sample_size=32,  # latent samples: the longest clip
        in_channels=4,  # == the VAE's latent channels
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_attention_heads=1,
        cross_attention_dim=16,
        cross_attention_input_dim=16,  # == the projection's conditioning_dim
        global_states_input_dim=32,  # the start and end conditionings, concatenated
        time_proj_dim=16,
    )


def _oobleck_vae():
    """A stereo Oobleck VAE at 44.1 kHz with Stable Audio Open's hop (2048 samples per latent sample), 4 wide."""
    from diffusers import AutoencoderOobleck

    return AutoencoderOobleck(
        encoder_hidden_size=4,
        downsampling_ratios=[2, 4, 4, 8, 8],  # a hop of 2048 samples, as Stable Audio Open's
        channel_multiples=[1, 2, 2, 2, 2],
        decoder_channels=4,
        decoder_input_channels=4,
        audio_channels=2,
        sampling_rate=STABLE_AUDIO_RATE,
    )
