"""``write_single_file``: a tiny folder as one checkpoint in the original key layout, which diffusers'
``from_single_file`` loads back bit for bit."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.testing.models.single_file import flux_converter_for_any_width, write_single_file


@pytest.fixture(scope="module")
def single_files(tmp_path_factory, tiny_sd, tiny_flux, tiny_flux_schnell) -> dict[str, tuple[str, str]]:
    """family -> (its tiny folder, the single file written from it)."""
    out = tmp_path_factory.mktemp("single-file")
    folders = {"sd": tiny_sd, "flux": tiny_flux, "flux-schnell": tiny_flux_schnell}
    return {f: (folder, write_single_file(folder, f, str(out / f"{f}.safetensors"))) for f, folder in folders.items()}


def _assert_same_weights(loaded: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = loaded.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    # from_single_file builds the model on the meta device: a weight the file lacks stays there, unreported.
    assert not [k for k, v in got.items() if v.is_meta], "weights missing from the file"
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def _file_dtypes(path: str) -> set[torch.dtype]:
    return {v.dtype for v in load_file(path).values()}


def test_sd_file_loads_back_bit_for_bit(single_files):
    from diffusers import StableDiffusionPipeline

    folder, path = single_files["sd"]
    loaded = StableDiffusionPipeline.from_single_file(path, config=folder, local_files_only=True)
    reference = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(loaded, name), getattr(reference, name))
    assert _file_dtypes(path) == {reference.unet.dtype}


def test_sd_file_is_in_the_ldm_layout_with_nothing_extra(single_files):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
    )
    from transformers import CLIPTextModel

    folder, path = single_files["sd"]
    checkpoint = load_file(path)
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    clip = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")

    # What each of diffusers' converters reads out of the file is exactly its component, and the three together
    # are the whole file.
    assert convert_ldm_unet_checkpoint(checkpoint, unet.config).keys() == unet.state_dict().keys()
    assert convert_ldm_vae_checkpoint(checkpoint, vae.config).keys() == vae.state_dict().keys()
    clip_keys = {k.removeprefix("text_model.") for k in convert_ldm_clip_checkpoint(checkpoint)}
    assert clip_keys == clip.state_dict().keys()
    assert len(checkpoint) == sum(len(m.state_dict()) for m in (unet, vae, clip))

    assert "model.diffusion_model.middle_block.1.transformer_blocks.0.attn2.to_k.weight" in checkpoint
    assert "model.diffusion_model.output_blocks.1.2.conv.weight" in checkpoint  # upsampler after the attention
    assert checkpoint["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4  # LDM's 1x1 conv
    assert "cond_stage_model.transformer.text_model.final_layer_norm.weight" in checkpoint


def test_the_sd_layout_is_read_from_the_configs(tiny_sd, tmp_path):
    """Three levels of two layers each, an attention-less level between attended ones: not the tiny 2x1 layout."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel

    folder = str(shutil.copytree(tiny_sd, tmp_path / "sd"))
    torch.manual_seed(1)
    UNet2DConditionModel(
        sample_size=32,
        block_out_channels=(32, 32, 64),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    ).save_pretrained(os.path.join(folder, "unet"))
    AutoencoderKL(
        block_out_channels=(32, 32, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=2,
        norm_num_groups=32,
    ).save_pretrained(os.path.join(folder, "vae"))

    path = write_single_file(folder, "sd", str(tmp_path / "sd.safetensors"))
    loaded = StableDiffusionPipeline.from_single_file(path, config=folder, local_files_only=True)
    reference = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        _assert_same_weights(getattr(loaded, name), getattr(reference, name))


def test_the_flux_layout_is_read_from_the_config(tiny_flux, tmp_path):
    from diffusers import FluxTransformer2DModel

    folder = str(shutil.copytree(tiny_flux, tmp_path / "flux"))
    torch.manual_seed(1)
    FluxTransformer2DModel(
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=8,
        num_attention_heads=3,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[2, 2, 4],
    ).save_pretrained(os.path.join(folder, "transformer"))

    path = write_single_file(folder, "flux", str(tmp_path / "flux.safetensors"))
    with flux_converter_for_any_width():
        loaded = FluxTransformer2DModel.from_single_file(
            path, config=folder, subfolder="transformer", local_files_only=True
        )
    _assert_same_weights(loaded, FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer"))


@pytest.mark.parametrize("family", ["flux", "flux-schnell"])
def test_flux_file_loads_back_bit_for_bit(single_files, family):
    from diffusers import FluxTransformer2DModel

    folder, path = single_files[family]
    with flux_converter_for_any_width():
        loaded = FluxTransformer2DModel.from_single_file(
            path, config=folder, subfolder="transformer", local_files_only=True
        )
    reference = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    _assert_same_weights(loaded, reference)
    assert _file_dtypes(path) == {reference.dtype}


def test_flux_file_is_in_the_bfl_layout_with_nothing_extra(single_files):
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    folder, path = single_files["flux"]
    reference = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True)
    inner = reference.config.num_attention_heads * reference.config.attention_head_dim
    checkpoint = load_file(path)

    assert checkpoint["double_blocks.0.img_attn.qkv.weight"].shape == (3 * inner, inner)
    linear1 = checkpoint["single_blocks.0.linear1.weight"]
    assert linear1.shape == (3 * inner + reference.single_transformer_blocks[0].proj_mlp.out_features, inner)
    shift, scale = checkpoint["final_layer.adaLN_modulation.1.weight"].chunk(2)
    assert torch.equal(torch.cat([scale, shift]), reference.norm_out.linear.weight)  # BFL's (shift, scale) order

    with flux_converter_for_any_width():
        convert = SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]["checkpoint_mapping_fn"]
        converted = convert(checkpoint=checkpoint, config=reference.config)
    assert converted.keys() == reference.state_dict().keys()
    assert not checkpoint, f"keys diffusers' converter does not read: {sorted(checkpoint)}"


@pytest.mark.xfail(
    raises=RuntimeError,
    strict=True,
    reason="diffusers splits Flux's linear1 at FLUX.1's width (3072); when this passes, drop the patched converter",
)
def test_the_stock_flux_converter_loads_a_narrow_transformer(single_files):
    from diffusers import FluxTransformer2DModel

    folder, path = single_files["flux"]
    FluxTransformer2DModel.from_single_file(path, config=folder, subfolder="transformer", local_files_only=True)


@pytest.mark.parametrize(
    ("family", "model_type"), [("sd", "v1"), ("flux", "flux-dev"), ("flux-schnell", "flux-schnell")]
)
def test_diffusers_infers_the_model_type_from_the_keys(single_files, family, model_type):
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type, is_clip_model

    checkpoint = load_file(single_files[family][1])
    assert infer_diffusers_model_type(checkpoint) == model_type
    assert is_clip_model(checkpoint) == (family == "sd")


def test_an_unknown_family_is_refused_naming_the_known_ones(tiny_sd, tmp_path):
    with pytest.raises(ValueError, match="choose one of: sd, flux, flux-schnell"):
        write_single_file(tiny_sd, "sdxl", str(tmp_path / "x.safetensors"))
    assert not os.path.exists(tmp_path / "x.safetensors")
