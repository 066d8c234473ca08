"""Tiny random-weight diffusers pipelines of the first families (SD, SDXL, SD3, Flux, Wan), built offline; `tiny` has
the table of every family that ``make-tiny-model`` writes.

Every component, tokenizers included, is built from an in-memory config and
vocabulary, then saved with ``save_pretrained`` so that it loads through the
real ``DiffusionPipeline.from_pretrained`` path. Nothing is downloaded.
"""

from __future__ import annotations

import torch

from vllm_omni.testing.models.tiny_tokenizers import make_clip_tokenizer, make_t5_tokenizer


def _clip_text_config(tokenizer, hidden: int = 32, projection_dim: int | None = None):
    from transformers import CLIPTextConfig

    kw = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": hidden,
        "intermediate_size": 37,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "max_position_embeddings": tokenizer.model_max_length,
        "layer_norm_eps": 1e-5,
        "hidden_act": "gelu",
    }
    if projection_dim is not None:
        kw["projection_dim"] = projection_dim
    return CLIPTextConfig(**kw)


def _t5_config(tokenizer) -> dict:
    """A 2-layer, 32-wide T5-family text encoder (T5 for Flux, UMT5 for Wan) over ``tokenizer``."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": 0,
    }


def _tiny_vae(latent_channels: int = 4, blocks: int = 2, **kwargs):
    """A 32–64-channel AutoencoderKL; ``blocks`` 2 scales by 2 (64x64 px → 32x32 latents), 4 by 8."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64, 64, 64)[:blocks],
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=32,
        sample_size=64,
        **kwargs,
    )


def _thin_vae(latent_channels: int, **kwargs):
    """An AutoencoderKL that scales by 8, as the real ones of Z-Image and Kontext do, with 8-16 channels: those
    pipelines' default size (and Kontext's input images, always) is about 1024x1024 px, which a 32-64-channel VAE
    encodes and decodes in seconds on a CPU."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=8,
        **kwargs,
    )


def _tiny_unet(cross_attention_dim: int, **kwargs):
    """The UNet of the SD-style families: 32x32 latents (64x64 px), one cross-attention block."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=32,  # latent size -> default 64x64 px with vae factor 2
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=8,
        norm_num_groups=32,
        **kwargs,
    )


def _sd_scheduler():
    """SD 1.x's Euler scheduler settings."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        timestep_spacing="leading",
    )


def build_tiny_sd():
    """Stable-Diffusion-1.x style: UNet2DConditionModel + AutoencoderKL + CLIP."""
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTextModel

    torch.manual_seed(0)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer)).eval()
    unet = _tiny_unet(cross_attention_dim=32)
    vae = _tiny_vae()
    scheduler = _sd_scheduler()
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_sdxl():
    """Stable-Diffusion-XL style: two CLIP encoders (hidden states concatenated to 64) + "text_time" UNet."""
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer)).eval()
    tokenizer_2 = make_clip_tokenizer()
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer_2, projection_dim=32)).eval()
    unet = _tiny_unet(
        cross_attention_dim=64,  # == 32 (text_encoder) + 32 (text_encoder_2) hidden sizes, concatenated
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,  # text_encoder_2 projection_dim + 6 time ids * 8
    )
    vae = _tiny_vae()
    scheduler = _sd_scheduler()
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )


def build_tiny_sd3():
    """Stable-Diffusion-3 style (MMDiT, flow matching): CLIP-L + CLIP-G (with projection) + T5 + 16-channel VAE."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer, projection_dim=32)).eval()
    tokenizer_2 = make_clip_tokenizer()
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer_2, projection_dim=32)).eval()
    tokenizer_3 = make_t5_tokenizer()
    # 64 wide (not 32), so that, as in real SD3 (768 + 1280 -> 4096), the concatenated CLIP hidden states
    # (32 + 32) are zero-padded up to the T5 width rather than cropped to it.
    text_encoder_3 = T5EncoderModel(T5Config(**{**_t5_config(tokenizer_3), "d_model": 64})).eval()
    vae = _tiny_vae(
        latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5305
    )
    transformer = SD3Transformer2DModel(
        sample_size=32,  # latent size -> default 64x64 px with vae factor 2
        patch_size=2,
        in_channels=16,  # == vae latent_channels
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,  # == T5 d_model: CLIP (77, padded to 64) + T5 (256) tokens, stacked
        caption_projection_dim=32,
        pooled_projection_dim=64,  # == 32 + 32, both CLIP projections concatenated
        pos_embed_max_size=64,  # up to 64 patches (of 2x2 latents) a side -> 256x256 px
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def build_tiny_flux(bench: bool = False, guidance_embeds: bool = True):
    """FLUX.1 style (MMDiT transformer, flow matching): CLIP + T5 + AutoencoderKL.

    ``bench=True`` builds a bigger one for GPU benchmarks: a VAE that scales by 8 (so
    256–512 px images make 256–1024 image tokens) and a 6-block, 256-wide transformer.
    ``guidance_embeds``: guidance-distilled as FLUX.1-dev (its ``guidance_scale`` is a transformer input), or,
    ``False``, timestep-distilled as FLUX.1-schnell (no guidance embedding: it takes no ``guidance_scale``).
    """
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = make_clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, projection_dim=32)).eval()
    tokenizer_2 = make_t5_tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_config(tokenizer_2))).eval()
    vae = _tiny_vae(
        blocks=4 if bench else 2,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2x2
        num_layers=2 if bench else 1,
        num_single_layers=4 if bench else 1,
        attention_head_dim=64 if bench else 16,
        num_attention_heads=4 if bench else 2,
        joint_attention_dim=32,  # == T5 d_model
        pooled_projection_dim=32,  # == CLIP hidden size
        axes_dims_rope=[16, 24, 24] if bench else [4, 4, 8],  # sums to attention_head_dim
        guidance_embeds=guidance_embeds,
    )
    scheduler = FlowMatchEulerDiscreteScheduler()
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_tiny_wan(two_experts: bool = False):
    """Wan 2.1 style text-to-video: UMT5 + AutoencoderKLWan (×8 spatial, ×4 temporal) + WanTransformer3DModel.

    ``two_experts=True`` builds Wan 2.2's layout (A14B): a high-noise ``transformer`` and a low-noise
    ``transformer_2``, switched at ``boundary_ratio`` × the scheduler's training timesteps.
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = make_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer))).eval()
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    config = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,  # == z_dim
        out_channels=16,
        text_dim=32,  # == UMT5 d_model
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    )
    transformer = WanTransformer3DModel(**config)
    experts = {"transformer_2": WanTransformer3DModel(**config), "boundary_ratio": 0.875} if two_experts else {}
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=transformer,
        **experts,
    )
