"""``sd3_layout`` / ``wan_layout``: a tiny SD3 or Wan transformer as one checkpoint in Stability's and Wan-AI's key
layouts, which diffusers' ``from_single_file`` loads back bit for bit."""

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.testing.models.single_file import write_single_file

CLASSES = {"sd3": "SD3Transformer2DModel", "wan": "WanTransformer3DModel"}


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_the_transformer_file_loads_back_bit_for_bit(family, request, tmp_path):
    import diffusers
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    folder = request.getfixturevalue(f"tiny_{family}")
    path = write_single_file(folder, family, str(tmp_path / f"{family}.safetensors"))
    cls = getattr(diffusers, CLASSES[family])
    loaded = cls.from_single_file(path, config=folder, subfolder="transformer", local_files_only=True).state_dict()
    reference = cls.from_pretrained(folder, subfolder="transformer", local_files_only=True).state_dict()
    assert loaded.keys() == reference.keys()
    assert not [k for k, v in loaded.items() if v.is_meta], "weights missing from the file"
    assert not [k for k in reference if not torch.equal(loaded[k], reference[k])]
    checkpoint = load_file(path)
    SINGLE_FILE_LOADABLE_CLASSES[CLASSES[family]]["checkpoint_mapping_fn"](checkpoint=checkpoint, config=None)
    assert not checkpoint, f"keys diffusers' converter does not read: {sorted(checkpoint)}"


def test_the_sd3_file_is_in_the_mmdit_layout(tiny_sd3, tmp_path):
    from diffusers import SD3Transformer2DModel

    checkpoint = load_file(write_single_file(tiny_sd3, "sd3", str(tmp_path / "sd3.safetensors")))
    reference = SD3Transformer2DModel.from_pretrained(tiny_sd3, subfolder="transformer", local_files_only=True)
    inner = reference.config.num_attention_heads * reference.config.attention_head_dim
    assert checkpoint["joint_blocks.0.x_block.attn.qkv.weight"].shape == (3 * inner, inner)
    last = reference.config.num_layers - 1
    assert f"joint_blocks.{last}.context_block.attn.proj.weight" not in checkpoint  # context_pre_only
    shift, scale = checkpoint["final_layer.adaLN_modulation.1.weight"].chunk(2)
    assert torch.equal(torch.cat([scale, shift]), reference.norm_out.linear.weight)


def test_the_wan_file_is_in_wan_ais_layout(tiny_wan, tmp_path):
    checkpoint = load_file(write_single_file(tiny_wan, "wan", str(tmp_path / "wan.safetensors")))
    for key in ("blocks.0.self_attn.q.weight", "blocks.0.cross_attn.o.weight", "blocks.0.ffn.0.weight"):
        assert key in checkpoint
    assert {"head.head.weight", "head.modulation", "blocks.0.modulation", "blocks.0.norm3.weight"} <= checkpoint.keys()
    assert checkpoint["patch_embedding.weight"].ndim == 5


def test_a_wan_with_an_image_embedder_is_refused(tiny_wan):
    from vllm_omni.testing.models.single_file_dit import wan_layout

    with pytest.raises(ValueError, match="text-to-video Wan"):
        wan_layout({}, {"image_dim": 1280})
