"""The full-size families: the published configurations of FLUX.1-dev, Qwen-Image and Wan2.1-T2V-14B, with random
weights and nothing downloaded (``vllm-omni make-tiny-model DIR --family flux|qwen-image|wan --full-size``).

`FULL_SIZE` holds, for each family, every model component's class and the fields of its published ``config.json``,
its parameter count as published (tests/testing/models/test_full_size.py builds each on the ``meta`` device and checks
its
count against it), and the few fields that make the *reduced* size: the same classes and code path with one or two
layers a few channels wide, so that what serves the full size runs on a CPU too (`benchmarks/real_scale.py
--reduced`). The tokenizers are the tiny offline ones (`tiny_tokenizers`, the Qwen one of `tiny_edit_models`);
the models keep their own vocabulary sizes. A prompt makes other tokens than the real tokenizers would, not other
work: Flux and Wan pad their T5 prompts to 512 tokens, and a Qwen-Image prompt is a few dozen tokens beside 4,096
image tokens at 1024x1024.

A folder is written two ways (`make_full_size_model`): whole, with random bfloat16 weights drawn on the GPU where
there is one (FLUX.1-dev is 34 GB of files), or ``configs_only``: the configs, tokenizers and scheduler, which a
stage with ``load_format: dummy`` builds on its device in seconds (`vllm_omni.diffusion.pipeline.dummy_weights`)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm_omni.diffusion.pipeline.dummy_weights import meta_model, random_model
from vllm_omni.testing.models.tiny_families import QWEN_IMAGE_SYSTEM
from vllm_omni.testing.models.tiny_tokenizers import make_clip_tokenizer, make_t5_tokenizer

Size = Literal["full", "reduced"]


@dataclass(frozen=True)
class Component:
    """One model component of a full-size family."""

    cls: str
    """Its class, as ``library.Class``."""
    config: Mapping[str, Any]
    """The fields of its published ``config.json`` (a transformers model's, its config class's arguments)."""
    reduced: Mapping[str, Any]
    """The fields that the reduced size changes (a nested config's, merged into it)."""
    published: str
    """Its parameter count as published, ``"11.9 B"``: the count agrees with it to every digit it gives."""

    @property
    def published_count(self) -> float:
        """`published` as a number."""
        figure, unit = self.published.split()
        return float(figure) * {"B": 1e9, "M": 1e6}[unit]


@dataclass(frozen=True)
class FullSizeFamily:
    """A full-size family: the pipeline, its components, its scheduler and its (tiny) tokenizers."""

    model: str
    """The published model it reproduces."""
    pipeline: str
    """Its diffusers pipeline class."""
    components: Mapping[str, Component]
    scheduler: tuple[str, Mapping[str, Any]]
    """The scheduler's class and its published config."""
    tokenizers: Mapping[str, Callable[[], Any]] = field(default_factory=dict)


def _qwen_tokenizer():
    from vllm_omni.testing.models.tiny_edit_models import make_qwen2_tokenizer

    return make_qwen2_tokenizer(QWEN_IMAGE_SYSTEM)


_T5_XXL = {  # google/t5-v1_1-xxl's encoder, as FLUX.1-dev's text_encoder_2 and (umT5) Wan's text_encoder
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    # The encoder reads its token embeddings from `shared`, one table, as transformers 4 built it and as the
    # published count has it (transformers 5 would untie them under the published `false`: a second table).
    "tie_word_embeddings": True,
}
_T5_REDUCED = {
    "d_model": 32,
    "d_ff": 37,
    "d_kv": 8,
    "num_heads": 4,
    "num_layers": 2,
    "relative_attention_num_buckets": 8,
}

WAN21_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}
"""Wan2.1's VAE, which Qwen-Image's ``AutoencoderKLQwenImage`` has too (the same published configuration)."""


FULL_SIZE: dict[str, FullSizeFamily] = {
    "flux": FullSizeFamily(
        model="black-forest-labs/FLUX.1-dev",
        pipeline="FluxPipeline",
        components={
            "transformer": Component(
                "diffusers.FluxTransformer2DModel",
                {
                    "patch_size": 1,
                    "in_channels": 64,
                    "num_layers": 19,
                    "num_single_layers": 38,
                    "attention_head_dim": 128,
                    "num_attention_heads": 24,
                    "joint_attention_dim": 4096,
                    "pooled_projection_dim": 768,
                    "guidance_embeds": True,
                    "axes_dims_rope": [16, 56, 56],
                },
                # 2 heads of 16; 32 == the reduced T5's d_model and CLIP's hidden size
                {
                    "num_layers": 1,
                    "num_single_layers": 1,
                    "attention_head_dim": 16,
                    "num_attention_heads": 2,
                    "joint_attention_dim": 32,
                    "pooled_projection_dim": 32,
                    "axes_dims_rope": [4, 6, 6],
                },
                "11.9 B",
            ),
            "text_encoder_2": Component(
                "transformers.T5EncoderModel", {**_T5_XXL, "vocab_size": 32128}, _T5_REDUCED, "4.76 B"
            ),
            "text_encoder": Component(
                "transformers.CLIPTextModel",
                {
                    "vocab_size": 49408,
                    "hidden_size": 768,
                    "intermediate_size": 3072,
                    "num_hidden_layers": 12,
                    "num_attention_heads": 12,
                    "max_position_embeddings": 77,
                    "hidden_act": "quick_gelu",
                    "projection_dim": 768,
                    "layer_norm_eps": 1e-5,
                    "bos_token_id": 0,
                    "eos_token_id": 2,  # the legacy value: the pooled token is the highest id, the tokenizer's eos
                    "pad_token_id": 1,
                },
                {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4},
                "123 M",
            ),
            "vae": Component(
                "diffusers.AutoencoderKL",
                {
                    "in_channels": 3,
                    "out_channels": 3,
                    "down_block_types": ["DownEncoderBlock2D"] * 4,
                    "up_block_types": ["UpDecoderBlock2D"] * 4,
                    "block_out_channels": [128, 256, 512, 512],
                    "layers_per_block": 2,
                    "act_fn": "silu",
                    "latent_channels": 16,
                    "norm_num_groups": 32,
                    "sample_size": 1024,
                    "scaling_factor": 0.3611,
                    "shift_factor": 0.1159,
                    "use_quant_conv": False,
                    "use_post_quant_conv": False,
                    "force_upcast": True,
                },
                # x2: the pipeline's default size (its warm-up) is 128 latents a side, 256x256 px, cheap on a CPU
                {
                    "block_out_channels": [8, 8],
                    "down_block_types": ["DownEncoderBlock2D"] * 2,
                    "up_block_types": ["UpDecoderBlock2D"] * 2,
                    "layers_per_block": 1,
                    "norm_num_groups": 8,
                },
                "84 M",
            ),
        },
        scheduler=(
            "FlowMatchEulerDiscreteScheduler",
            {
                "num_train_timesteps": 1000,
                "shift": 3.0,
                "use_dynamic_shifting": True,
                "base_shift": 0.5,
                "max_shift": 1.15,
                "base_image_seq_len": 256,
                "max_image_seq_len": 4096,
            },
        ),
        tokenizers={"tokenizer": make_clip_tokenizer, "tokenizer_2": make_t5_tokenizer},
    ),
    "qwen-image": FullSizeFamily(
        model="Qwen/Qwen-Image",
        pipeline="QwenImagePipeline",
        components={
            "transformer": Component(
                "diffusers.QwenImageTransformer2DModel",
                {
                    "patch_size": 2,
                    "in_channels": 64,
                    "out_channels": 16,
                    "num_layers": 60,
                    "attention_head_dim": 128,
                    "num_attention_heads": 24,
                    "joint_attention_dim": 3584,
                    "guidance_embeds": False,
                    "axes_dims_rope": [16, 56, 56],
                },
                # 2 heads of 16; 32 == the reduced Qwen2.5-VL's hidden size
                {
                    "num_layers": 1,
                    "attention_head_dim": 16,
                    "num_attention_heads": 2,
                    "joint_attention_dim": 32,
                    "axes_dims_rope": [4, 6, 6],
                },
                "20 B",
            ),
            "text_encoder": Component(
                "transformers.Qwen2_5_VLForConditionalGeneration",  # Qwen2.5-VL-7B-Instruct
                {
                    "text_config": {
                        "vocab_size": 152064,
                        "hidden_size": 3584,
                        "intermediate_size": 18944,
                        "num_hidden_layers": 28,
                        "num_attention_heads": 28,
                        "num_key_value_heads": 4,
                        "max_position_embeddings": 128000,
                        "rms_norm_eps": 1e-6,
                        "rope_parameters": {
                            "rope_type": "default",
                            "rope_theta": 1000000.0,
                            "mrope_section": [16, 24, 24],
                        },
                        "tie_word_embeddings": False,
                        "bos_token_id": 151643,
                        "eos_token_id": 151645,
                    },
                    "vision_config": {
                        "depth": 32,
                        "hidden_size": 1280,
                        "intermediate_size": 3420,
                        "num_heads": 16,
                        "hidden_act": "silu",
                        "out_hidden_size": 3584,
                        "patch_size": 14,
                        "spatial_merge_size": 2,
                        "temporal_patch_size": 2,
                        "window_size": 112,
                        "fullatt_block_indexes": [7, 15, 23, 31],
                        "tokens_per_second": 2,
                    },
                    "image_token_id": 151655,
                    "video_token_id": 151656,
                    "vision_start_token_id": 151652,
                    "vision_end_token_id": 151653,
                    "tie_word_embeddings": False,
                },
                {
                    "text_config": {
                        "hidden_size": 32,
                        "intermediate_size": 37,
                        "num_hidden_layers": 2,
                        "num_attention_heads": 2,
                        "num_key_value_heads": 1,
                        # head size 16: 8 rotary frequencies over (time, height, width)
                        "rope_parameters": {
                            "rope_type": "default",
                            "rope_theta": 1000000.0,
                            "mrope_section": [2, 3, 3],
                        },
                    },
                    "vision_config": {
                        "depth": 2,
                        "hidden_size": 32,
                        "intermediate_size": 37,
                        "num_heads": 2,
                        "out_hidden_size": 32,
                        "fullatt_block_indexes": [1],
                    },
                },
                "8.3 B",
            ),
            "vae": Component(
                "diffusers.AutoencoderKLQwenImage",  # Wan2.1's VAE; its latents' mean and std are the defaults
                dict(WAN21_VAE),
                # x2, as the reduced Flux VAE
                {"base_dim": 4, "dim_mult": [1, 1], "num_res_blocks": 1, "temperal_downsample": [False]},
                "127 M",
            ),
        },
        scheduler=(
            "FlowMatchEulerDiscreteScheduler",
            {
                "num_train_timesteps": 1000,
                "shift": 1.0,
                "use_dynamic_shifting": True,
                "base_shift": 0.5,
                "max_shift": 0.9,
                "base_image_seq_len": 256,
                "max_image_seq_len": 8192,
                "shift_terminal": 0.02,
                "time_shift_type": "exponential",
            },
        ),
        tokenizers={"tokenizer": _qwen_tokenizer},
    ),
    "wan": FullSizeFamily(
        model="Wan-AI/Wan2.1-T2V-14B-Diffusers",
        pipeline="WanPipeline",
        components={
            "transformer": Component(
                "diffusers.WanTransformer3DModel",
                {
                    "patch_size": [1, 2, 2],
                    "num_attention_heads": 40,
                    "attention_head_dim": 128,
                    "in_channels": 16,
                    "out_channels": 16,
                    "text_dim": 4096,
                    "freq_dim": 256,
                    "ffn_dim": 13824,
                    "num_layers": 40,
                    "cross_attn_norm": True,
                    "qk_norm": "rms_norm_across_heads",
                    "eps": 1e-6,
                    "rope_max_seq_len": 1024,
                },
                {"num_attention_heads": 2, "attention_head_dim": 12, "text_dim": 32, "ffn_dim": 32, "num_layers": 1},
                "14 B",
            ),
            "text_encoder": Component(
                "transformers.UMT5EncoderModel",  # google/umt5-xxl's encoder
                {**_T5_XXL, "vocab_size": 256384},
                _T5_REDUCED,
                "5.7 B",
            ),
            "vae": Component(
                "diffusers.AutoencoderKLWan",  # its latents' mean and std are the defaults
                dict(WAN21_VAE),
                {"base_dim": 4, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1},
                "127 M",
            ),
        },
        scheduler=(
            "UniPCMultistepScheduler",
            {
                "num_train_timesteps": 1000,
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "flow_shift": 3.0,  # its 480p setting
                "solver_order": 2,
                "solver_type": "bh2",
            },
        ),
        tokenizers={"tokenizer": make_t5_tokenizer},
    ),
}
"""The full-size families by name (the tiny families' names, `tiny.FAMILIES`)."""


def _merged(config: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``changes``, a nested config's merged into it."""
    out = dict(config)
    for key, value in changes.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and key in out else value
    return out


def _family(family: str) -> FullSizeFamily:
    if family not in FULL_SIZE:
        raise ValueError(f"no full-size {family!r}; the full-size families: {', '.join(FULL_SIZE)}")
    return FULL_SIZE[family]


def component_builder(family: str, name: str, size: Size = "full") -> Callable[[], torch.nn.Module]:
    """What builds the component ``name`` of ``family`` at ``size`` from its config (on whatever device and
    initialisation is in force when it is called)."""
    component = _family(family).components[name]
    library, class_name = component.cls.split(".")
    cls = getattr(importlib.import_module(library), class_name)
    config = component.config if size == "full" else _merged(component.config, component.reduced)
    if library == "diffusers":
        return lambda: cls.from_config(config)
    return lambda: cls(cls.config_class(**config))


def meta_components(family: str, size: Size = "full") -> dict[str, torch.nn.Module]:
    """Every model component of ``family`` with its parameters on the ``meta`` device: its shapes, no memory."""
    return {name: meta_model(component_builder(family, name, size)) for name in _family(family).components}


def parameter_count(module: torch.nn.Module) -> int:
    """The parameters of ``module``, a tied one once."""
    return sum(p.numel() for p in module.parameters())


def build_pipeline(
    family: str, size: Size = "full", device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
):
    """The pipeline of ``family`` at ``size`` with random weights drawn on ``device`` in ``dtype``
    (`random_model`), its tokenizers and scheduler."""
    import diffusers

    spec = _family(family)
    models = {
        name: random_model(component_builder(family, name, size), torch.device(device), dtype)
        for name in spec.components
    }
    tokenizers = {name: make() for name, make in spec.tokenizers.items()}
    scheduler_class, scheduler_config = spec.scheduler
    scheduler = getattr(diffusers, scheduler_class).from_config(scheduler_config)
    return getattr(diffusers, spec.pipeline)(scheduler=scheduler, **models, **tokenizers)


def write_configs(pipeline, path: str) -> str:
    """``pipeline``'s folder without weights: ``model_index.json``, each model component's ``config.json``, the
    tokenizers and the scheduler; what ``load_format: dummy`` serves."""
    from diffusers.models.modeling_utils import ModelMixin

    pipeline.save_config(path)
    for name, component in pipeline.components.items():
        folder = os.path.join(path, name)
        if component is None:
            continue
        if isinstance(component, ModelMixin):
            component.save_config(folder)
        elif isinstance(component, torch.nn.Module):  # a transformers model
            config: Any = component.config
            config.save_pretrained(folder)
        else:  # a tokenizer, the scheduler
            component.save_pretrained(folder)
    return path


def make_full_size_model(
    path: str | os.PathLike[str],
    family: str,
    configs_only: bool = False,
    device: torch.device | str | None = None,
    size: Size = "full",
) -> str:
    """Write the full-size ``family`` (or its reduced size) to ``path`` and return it: the whole pipeline with random
    bfloat16 weights drawn on ``device`` (default: CUDA where there is one, else the CPU), or, ``configs_only``,
    its configs, tokenizers and scheduler, built on the ``meta`` device (no memory, a second or two)."""
    path = os.fspath(path)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if configs_only:
        return write_configs(_meta_pipeline(family, size), path)
    build_pipeline(family, size, device).save_pretrained(path)
    return path


def _meta_pipeline(family: str, size: Size):
    """The pipeline of ``family`` over its ``meta`` components (for its configs)."""
    import diffusers

    spec = _family(family)
    scheduler_class, scheduler_config = spec.scheduler
    return getattr(diffusers, spec.pipeline)(
        scheduler=getattr(diffusers, scheduler_class).from_config(scheduler_config),
        **meta_components(family, size),
        **{name: make() for name, make in spec.tokenizers.items()},
    )
