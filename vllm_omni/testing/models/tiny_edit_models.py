"""Tiny random-weight image-conditioned diffusers pipelines (edit and image-to-video), built offline.

The families ``kontext``, ``qwen-image-edit``, ``qwen-image-edit-plus`` and ``wan-i2v`` of
``vllm-omni make-tiny-model``; like those of :mod:`vllm_omni.testing.models.tiny_models`, every component,
tokenizers and processors included, is built in memory and nothing is downloaded.
"""

from __future__ import annotations

import json

import torch

from vllm_omni.testing.models.tiny_models import _thin_vae, build_tiny_flux, build_tiny_wan
from vllm_omni.testing.models.tiny_tokenizers import WORDS

# The system part of Qwen-Image-Edit's prompt template, learnt whole by the tiny BPE so that, as with the real
# Qwen2 vocabulary, the template's prefix up to the user turn is exactly the 64 tokens the pipeline drops.
QWEN_EDIT_SYSTEM = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate."
)
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def make_qwen2_tokenizer(*corpus: str):
    """A real Qwen2Tokenizer (byte-level BPE, no end-of-word marks) with Qwen2-VL's chat and vision tokens; each word
    of ``corpus`` (a pipeline's prompt template) is one token too."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1000,  # more than the corpus can merge: every corpus word ends up one token
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The role names stand alone, as they do after "<|im_start|>", so that they too are single tokens.
    words = [" ".join(WORDS), QWEN_EDIT_SYSTEM, "system", "user", "assistant", "Picture", *corpus]
    bpe.train_from_iterator(words, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    for token in QWEN_SPECIAL_TOKENS:
        vocab.setdefault(token, len(vocab))
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1024,
    )
    tokenizer.add_tokens([AddedToken(t, special=True) for t in QWEN_SPECIAL_TOKENS])
    return tokenizer


def _qwen2_vl_processor(tokenizer):
    """Qwen2-VL's processor with 14 px patches merged 2x2, its images capped at 56x56 px: 1 to 4 image tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    kw = {"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}, "patch_size": 14, "merge_size": 2}
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(temporal_patch_size=2, **kw),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(temporal_patch_size=2, **kw),  # required, unused by the pipelines
    )


def _qwen2_5_vl_text_encoder(tokenizer):
    """A 2-layer, 32-wide Qwen2.5-VL (text and vision tower) whose last hidden states condition the transformer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,  # grouped-query attention, as the real one's 28 query / 4 key-value heads
            # head_dim 16 -> 8 rotary frequencies split over (time, height, width), as Qwen2.5-VL's [16, 24, 24]
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": ids("<|im_end|>"),
            "pad_token_id": ids("<|endoftext|>"),
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_heads": 2,
            "out_hidden_size": 32,  # == the text hidden size: merged patches are spliced into the text
            "patch_size": 14,  # == the image processor's
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "fullatt_block_indexes": [1],  # block 0 attends within windows, block 1 across the image, as the real
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _build_tiny_qwen_edit(pipeline_class):
    """Qwen-Image-Edit style: Qwen2.5-VL + AutoencoderKLQwenImage + QwenImageTransformer2DModel."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    torch.manual_seed(0)
    tokenizer = make_qwen2_tokenizer()
    processor = _qwen2_vl_processor(tokenizer)
    text_encoder = _qwen2_5_vl_text_encoder(tokenizer)
    z_dim = 4
    vae = AutoencoderKLQwenImage(
        base_dim=4,  # 4 channels throughout: the ~1024x1024 px encode of each input image is most of a call
        z_dim=z_dim,
        # x8 spatially (the pipeline reads 2 ** len(temperal_downsample)), as the real VAE: the input image is
        # always encoded at ~1024x1024 px, so that makes 128x128 latents, 4096 image tokens
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,  # latents packed 2x2
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,  # == Qwen2.5-VL hidden size
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )
    # Qwen-Image's own scheduler settings: the shift grows with the image's token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02
    )
    return pipeline_class(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )


def build_tiny_qwen_image_edit():
    """Qwen-Image-Edit: one input image per prompt, seen by both Qwen2.5-VL and (as latents) the transformer."""
    from diffusers import QwenImageEditPipeline

    return _build_tiny_qwen_edit(QwenImageEditPipeline)


def build_tiny_qwen_image_edit_plus():
    """Qwen-Image-Edit-2509 ("Plus"): the same components, several input images for one prompt."""
    from diffusers import QwenImageEditPlusPipeline

    return _build_tiny_qwen_edit(QwenImageEditPlusPipeline)


def build_tiny_kontext():
    """FLUX.1 Kontext: the tiny Flux components with a VAE that scales by 8, as the real one does. Kontext resizes
    its input image to one of its ~1024x1024 px resolutions, whose latents join the sequence: 4096 tokens at x8,
    where the tiny Flux VAE's x2 would make 65536."""
    from diffusers import FluxKontextPipeline

    components = build_tiny_flux().components
    # no mid-block self-attention: over the 16,384 positions of a ~1024x1024 px input, it was half of the encode
    vae = _thin_vae(
        4,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    return FluxKontextPipeline(**(components | {"vae": vae}))


def build_tiny_wan_i2v():
    """Wan 2.1 style image-to-video: the tiny Wan components, a CLIP vision encoder and an I2V transformer.

    The pipeline cleans prompts with ``ftfy``, unguarded: calls with a prompt need it installed.
    """
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    wan = build_tiny_wan()  # seeds; its text encoder, VAE and scheduler are shared, its transformer replaced
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,  # 4x4 patches + CLS: 17 image tokens (257 in Wan 2.1's ViT-H/14 at 224 px)
            projection_dim=32,
        )
    ).eval()
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16 + 4 + 16,  # noise latents + first-frame mask (x4 temporal) + first-frame latents
        out_channels=16,
        text_dim=32,  # == UMT5 d_model
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
        image_dim=32,  # == CLIP hidden size (the pipeline takes its penultimate hidden states)
        added_kv_proj_dim=24,  # == inner dim (2 heads x 12): the image tokens get their own key/value projections
    )
    return WanImageToVideoPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        vae=wan.vae,
        scheduler=wan.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
    )
