"""Tiny random-weight audio pipelines, built offline in their real folder layouts (``vllm-omni make-tiny-model
--family stable-audio``): as in :mod:`vllm_omni.testing.models.tiny_models`, each is its real pipeline class over its
real
component classes, a few channels wide, and nothing is downloaded. Random weights make noise: they test structure
and equalities (batched = alone = stock diffusers), not sound."""

from __future__ import annotations

import torch

from vllm_omni.testing.models.tiny_tokenizers import make_t5_tokenizer

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


def build_tiny_longcat_audio():
    """LongCat-AudioDiT's layout: UMT5 + LongCatAudioDiTTransformer + LongCatAudioDiTVae (mono, 24 kHz, as the real
    one; a hop of 256 samples, where the real one's is 2048) + flow matching's Euler scheduler, as the pipeline makes
    it. Its clips are a whole number of latent frames: ``int(length × 24000 / 256)`` of them, 256 samples each."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatAudioDiTPipeline
    from diffusers.models.autoencoders.autoencoder_longcat_audio_dit import LongCatAudioDiTVae
    from diffusers.models.transformers.transformer_longcat_audio_dit import LongCatAudioDiTTransformer
    from transformers import UMT5Config, UMT5EncoderModel

    from vllm_omni.testing.models.tiny_models import _t5_config

    torch.manual_seed(0)
    tokenizer = make_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer))).eval()
    transformer = LongCatAudioDiTTransformer(
        dit_dim=32,
        dit_depth=2,
        dit_heads=2,
        dit_text_dim=32,
        latent_dim=8,
        ff_mult=2.0,  # text dim == UMT5 d_model
    )
    vae = LongCatAudioDiTVae(
        in_channels=1,
        channels=4,
        c_mults=[1, 2, 2],
        strides=[4, 8, 8],  # a hop of 256 samples
        latent_dim=8,  # == the transformer's
        encoder_latent_dim=16,
        downsampling_ratio=256,
        sample_rate=24000,
    )
    return LongCatAudioDiTPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, invert_sigmas=True),  # the pipeline's own default
    )


def build_tiny_stable_audio_3():
    """Stable Audio 3's layout: T5Gemma's encoder over a Gemma tokenizer + StableAudio3DurationEmbedder +
    StableAudio3DiTModel + AutoencoderSAME (stereo, 44.1 kHz, a hop of 64 × 4 samples) + flow matching's Euler
    scheduler. Its clips are as long as asked, trimmed from a whole number of latent samples."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableAudio3Pipeline
    from diffusers.models.autoencoders.autoencoder_same import AutoencoderSAME
    from diffusers.models.transformers.transformer_stable_audio3 import StableAudio3DiTModel
    from diffusers.pipelines.stable_audio_3.modeling_stable_audio_3 import StableAudio3DurationEmbedder

    torch.manual_seed(0)
    tokenizer = make_gemma_tokenizer()
    vae = AutoencoderSAME(
        audio_channels=2,
        patch_size=64,
        encoder_channels=16,
        encoder_c_mults=[2],
        encoder_strides=[4],  # a hop of 64 × 4 samples
        encoder_transformer_depths=[1],
        latent_dim=8,
        dim_heads=8,
        ff_mult=2,
        sampling_rate=STABLE_AUDIO_RATE,
    )
    transformer = StableAudio3DiTModel(
        io_channels=8,  # == the VAE's latent_dim
        embed_dim=32,
        depth=2,
        num_heads=2,
        cond_token_dim=32,  # == T5Gemma's hidden size
        global_cond_dim=32,  # == the duration embedder's output
        local_add_cond_dim=9,  # latent_dim + 1: the inpainting mask's channel
        timestep_features_dim=16,
        ff_mult=2.0,
        num_memory_tokens=4,
    )
    return StableAudio3Pipeline(
        vae=vae,
        text_encoder=_t5gemma_encoder(tokenizer),
        tokenizer=tokenizer,
        duration_embedder=StableAudio3DurationEmbedder(output_dim=32, fourier_dim=16),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def make_gemma_tokenizer():
    """A real GemmaTokenizer (byte-level BPE) over the tiny vocabulary's words and letters, no merges: a prompt is
    its letters."""
    from transformers import GemmaTokenizer

    from vllm_omni.testing.models.tiny_tokenizers import WORDS

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    letters = sorted(set("".join(WORDS)) | set("abcdefghijklmnopqrstuvwxyz\u2581"))
    return GemmaTokenizer(vocab={token: i for i, token in enumerate(specials + letters)}, merges=[])


def _t5gemma_encoder(tokenizer):
    """T5Gemma's encoder alone (Stable Audio 3's ``google/t5gemma-b-b-ul2`` text encoder), 32 wide, one layer."""
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    module = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = T5GemmaConfig(encoder=module, decoder=module, vocab_size=len(tokenizer), is_encoder_decoder=False)
    return T5GemmaEncoderModel(config).eval()


def build_tiny_ace_step():
    """ACE-Step 1.5's layout: a Qwen3 text encoder over the tiny Qwen2 tokenizer + AceStepConditionEncoder (text,
    lyrics and timbre; its silence latent as the placeholder diffusers makes) + AceStepTransformer1DModel +
    AutoencoderOobleck (stereo, 48 kHz and a hop of 1920 samples, as the real one) + flow matching's Euler scheduler
    (shift 3, the call's). Its clips are a whole number of latent frames, 25 a second: ``ceil(length × 25)``."""
    from diffusers import AceStepPipeline, AutoencoderOobleck, FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.ace_step_transformer import AceStepTransformer1DModel
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from vllm_omni.testing.models.tiny_edit_models import make_qwen2_tokenizer

    torch.manual_seed(0)
    tokenizer = make_qwen2_tokenizer()
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()
    acoustic = 8  # the VAE's latent channels: the transformer's acoustic size and the timbre encoder's input
    vae = AutoencoderOobleck(
        encoder_hidden_size=4,
        downsampling_ratios=[2, 4, 4, 6, 10],  # a hop of 1920 samples, as ACE-Step's: its timbre encoder reads 30 s
        channel_multiples=[1, 2, 2, 2, 2],
        decoder_channels=4,
        decoder_input_channels=acoustic,
        audio_channels=2,
        sampling_rate=48000,
    )
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    condition_encoder = AceStepConditionEncoder(
        **small,
        text_hidden_dim=16,  # == the Qwen3 hidden size
        timbre_hidden_dim=acoustic,
        num_lyric_encoder_hidden_layers=1,
        num_timbre_encoder_hidden_layers=1,
        sliding_window=16,
    )
    transformer = AceStepTransformer1DModel(
        **small, num_hidden_layers=2, in_channels=3 * acoustic, audio_acoustic_hidden_dim=acoustic, sliding_window=16
    )
    return AceStepPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        condition_encoder=condition_encoder,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
