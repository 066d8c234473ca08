"""Tiny random-weight pipelines of the families people serve now, built offline: Qwen-Image, Z-Image, FLUX.2
[klein], LTX-Video and HunyuanVideo 1.5 (``vllm-omni make-tiny-model --family qwen-image|z-image|flux2|ltx
|hunyuan-video-1.5``). As in :mod:`vllm_omni.testing.models.tiny_models`, each is its real pipeline class over its real
component classes, 16–32 wide, and nothing is downloaded; the Qwen tokenizers learn their pipeline's prompt
template whole, so that the template's prefix is as many tokens as the pipeline drops."""

from __future__ import annotations

import inspect

import torch

from vllm_omni.testing.models.tiny_edit_models import (
    _qwen2_5_vl_text_encoder,
    build_tiny_qwen_image_edit,
    make_qwen2_tokenizer,
)
from vllm_omni.testing.models.tiny_models import _t5_config, _thin_vae
from vllm_omni.testing.models.tiny_tokenizers import make_t5_tokenizer

QWEN_IMAGE_SYSTEM = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the "
    "objects and background:"
)
"""The system turn of QwenImagePipeline's prompt template (set in its ``__init__``): 34 tokens to drop with it."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
"""Qwen's ChatML, as Qwen3's own template writes a turn (an empty thought when thinking is off)."""


def _chat_tokenizer(*corpus: str):
    """The tiny Qwen2 tokenizer with a chat template and Qwen3's thinking tokens."""
    from tokenizers import AddedToken

    tokenizer = make_qwen2_tokenizer(*corpus)
    tokenizer.add_tokens([AddedToken(t, special=True) for t in ("<think>", "</think>")])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _qwen3(tokenizer, layers: int = 2, causal_lm: bool = False):
    """A 16-wide Qwen3 text encoder over ``tokenizer``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config).eval()


def build_tiny_qwen_image():
    """Qwen-Image text-to-image: the tiny Qwen-Image-Edit's VAE (×8), transformer and scheduler, and a Qwen2.5-VL
    text encoder whose tokenizer makes the template's system turn the 34 tokens the pipeline drops."""
    from diffusers import QwenImagePipeline

    edit = build_tiny_qwen_image_edit()
    tokenizer = make_qwen2_tokenizer(QWEN_IMAGE_SYSTEM)
    return QwenImagePipeline(
        scheduler=edit.scheduler,
        vae=edit.vae,
        text_encoder=_qwen2_5_vl_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=edit.transformer,
    )


def build_tiny_z_image():
    """Z-Image (Turbo's layout): Qwen3 + AutoencoderKL (×8, 16 latent channels) + ZImageTransformer2DModel."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    # from its module: to mypy, diffusers' top-level names are the dummy classes of its torch-less install
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel

    torch.manual_seed(0)
    tokenizer = _chat_tokenizer()
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,  # == the VAE's latent channels
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,  # == the Qwen3 hidden size
        axes_dims=[8, 4, 4],  # sums to the head size, 16
        axes_lens=[256, 64, 64],
    )
    with torch.no_grad():  # made with torch.empty: fixed, so that the saved folder is finite and the same each time
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    vae = _thin_vae(16, scaling_factor=0.3611, shift_factor=0.1159)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's
        vae=vae,
        text_encoder=_qwen3(tokenizer),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_tiny_flux2():
    """FLUX.2 [klein] (step-distilled, as FLUX.2-klein-4B): Qwen3 + AutoencoderKLFlux2 + Flux2Transformer2DModel.

    The pipeline stacks the Qwen3 hidden states of layers 9, 18 and 27 (its ``text_encoder_out_layers``), so the
    16-wide Qwen3 has 27 layers."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )

    torch.manual_seed(0)
    tokenizer = _chat_tokenizer()
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 32),  # ×2; the pipeline packs latents 2×2
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    transformer = Flux2Transformer2DModel(
        in_channels=16,  # 4 latent channels packed 2×2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 stacked Qwen3 layers × 16
        axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
        guidance_embeds=False,  # klein guides with classifier-free guidance, or (distilled) not at all
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.2-klein-4B's: the shift grows with the image's tokens
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, max_image_seq_len=4096, time_shift_type="exponential"
    )
    return Flux2KleinPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=_qwen3(tokenizer, layers=27, causal_lm=True),
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def build_tiny_ltx():
    """LTX-Video: T5 + AutoencoderKLLTXVideo (×32 spatial, ×8 temporal, as the real one) + its transformer."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = make_t5_tokenizer()
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
    )
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,  # == the VAE's latent channels
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,  # == the inner size, 2 × 8
        num_layers=1,
        caption_channels=32,  # == T5 d_model
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-Video's
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=T5EncoderModel(T5Config(**_t5_config(tokenizer))).eval(),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_tiny_hunyuan_video_15():
    """HunyuanVideo 1.5 text-to-video: Qwen2.5-VL's text model + ByT5 (quoted text) + AutoencoderKLHunyuanVideo15
    (×4 spatial, ×2 temporal) + HunyuanVideo15Transformer3DModel, guided by a ClassifierFreeGuidance guider."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer

    torch.manual_seed(0)
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    tokenizer = _chat_tokenizer(system)
    # The components draw their random weights in this order, the ByT5 encoder last: the folder is the same each time.
    text_encoder = _hunyuan_video_15_mllm(tokenizer)
    tokenizer_2 = ByT5Tokenizer()
    transformer = _hunyuan_video_15_transformer()
    vae = _hunyuan_video_15_vae()
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=_byt5_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def _hunyuan_video_15_mllm(tokenizer):
    """HunyuanVideo 1.5's prompt encoder: a 16-wide Qwen2.5-VL text model over the chat ``tokenizer``."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    return Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,  # the pipeline takes the hidden states 2 layers before the last
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()


def _byt5_encoder(tokenizer):
    """The ByT5 encoder of quoted text (glyphs), over the byte-level ``tokenizer``."""
    from transformers import T5Config, T5EncoderModel

    byt5 = {**_t5_config(tokenizer), "vocab_size": len(tokenizer), "pad_token_id": 0, "eos_token_id": 1}
    return T5EncoderModel(T5Config(**byt5)).eval()


def _hunyuan_video_15_transformer():
    """The text-to-video denoiser, its sizes matched to the two text encoders and the VAE's latents."""
    from diffusers import HunyuanVideo15Transformer3DModel

    return HunyuanVideo15Transformer3DModel(
        in_channels=4 * 2 + 1,  # noise latents + condition latents + condition mask
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,  # == the Qwen2.5-VL hidden size
        text_embed_2_dim=32,  # == ByT5 d_model
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),  # sums to attention_head_dim
        target_size=32,  # the default size's base: 16:9 buckets near 32x32 px
        task_type="t2v",
    )


def _hunyuan_video_15_vae():
    """AutoencoderKLHunyuanVideo15 with 4 latent channels, ×4 spatial and ×2 temporal."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(
        latent_channels=4,
        block_out_channels=(16, 16),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=2,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
