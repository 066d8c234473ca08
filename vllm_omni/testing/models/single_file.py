"""A tiny pipeline folder as a single-file checkpoint in the original (non-diffusers) key layout.

Community checkpoints are traded as one ``.safetensors`` in the layout of the code that trained them, not as a
diffusers folder. :func:`write_single_file` turns a folder from :func:`vllm_omni.testing.models.tiny.make_tiny_model`
into such a file by inverting diffusers' own single-file converters (``diffusers/loaders/single_file_utils.py``), so
that ``from_single_file`` gives back the folder's weights bit for bit:

- ``sd``: a whole SD 1.x checkpoint: the UNet under ``model.diffusion_model.`` (LDM ``input_blocks`` /
  ``middle_block`` / ``output_blocks``), the VAE under ``first_stage_model.`` (LDM ``encoder.down.N.block.M``, the
  mid attention as 1x1-conv ``q`` / ``k`` / ``v`` / ``proj_out``), the CLIP text encoder under
  ``cond_stage_model.transformer.text_model.``. Load it with::

      StableDiffusionPipeline.from_single_file(out, config=folder, local_files_only=True)

- ``flux`` / ``flux-schnell``: the transformer alone, in Black Forest Labs' layout (``double_blocks.N.img_attn.qkv``,
  ``single_blocks.N.linear1``, ``final_layer.adaLN_modulation.1`` ...), as ``flux1-dev.safetensors`` is. Load it with::

      with flux_converter_for_any_width():
          FluxTransformer2DModel.from_single_file(out, config=folder, subfolder="transformer", local_files_only=True)

- ``sd3`` / ``wan``: the transformer alone, in Stability's MMDiT and Wan-AI's layouts
  (:mod:`vllm_omni.testing.models.single_file_dit`); ``SD3Transformer2DModel`` / ``WanTransformer3DModel`` load it as
  above.

``config=folder`` is required: without it diffusers infers the model type from the keys ("v1", "flux-dev") and
fetches the *real* model's config from the Hub, which fails offline and, online, builds a full-size model that the
tiny weights do not fit. No ``original_config`` is needed (it is the alternative to ``config``; not both). The tiny SD
folder has no safety checker (``requires_safety_checker: false``), so nothing is fetched for one; do not pass the
deprecated ``load_safety_checker``. Scheduler and tokenizer come from ``config``, not from the file.

diffusers 0.42.1's Flux converter splits ``single_blocks.N.linear1`` at FLUX.1's fixed width (``inner_dim = 3072``,
``mlp_ratio = 4``), so a narrower model does not load with it; :func:`flux_converter_for_any_width` swaps in one that
splits at the width in the model's config and otherwise defers to diffusers' converter.

SDXL is not supported: its two tiny text encoders are both 32 wide, and diffusers tells CLIP-L from OpenCLIP-bigG in
a file by width only, so it would load the first encoder's weights into the second.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vllm_omni.testing.models.single_file_dit import sd3_layout, wan_layout

# diffusers -> LDM names inside one ResNet block (``update_unet_resnet_ldm_to_diffusers`` and the VAE's, reversed).
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _component(folder: str, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, name, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no {name}/*.safetensors in {folder}")
    state = {}
    for file in files:  # a sharded component is the union of its shards
        state.update(load_file(file))
    with open(os.path.join(folder, name, "config.json")) as f:
        return state, json.load(f)


def _rename(state: dict, exact: dict[str, str], prefixes: dict[str, tuple[str, dict]]) -> dict[str, torch.Tensor]:
    """Each key by its exact name, else by its longest module prefix (with renames of the module inside it).

    A key that no rule names is an error, not a silent drop: the config has a part the forward converter would
    not read either (class embeddings, a different mid block), and the file would not round-trip.
    """
    out = {}
    ordered = sorted(prefixes.items(), key=lambda item: -len(item[0]))
    for key, tensor in state.items():
        if key in exact:
            out[exact[key]] = tensor
            continue
        for src, (dst, renames) in ordered:
            if key.startswith(src):
                module, _, param = key[len(src) :].rpartition(".")
                out[f"{dst}{renames.get(module, module)}.{param}" if module else f"{dst}{param}"] = tensor
                break
        else:
            raise ValueError(f"{key!r} has no name in the original layout")
    return out


def _ldm_unet(state: dict, config: dict) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_ldm_unet_checkpoint``: LDM numbers every ResNet, attention and resampler in one sequence."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    mappings: dict[str, Any] = DIFFUSERS_TO_LDM_MAPPING  # a nested literal that mypy reads as dict[str, object]

    per_block = config["layers_per_block"]
    if not isinstance(per_block, int):  # the forward converter reads it as one int
        raise ValueError(f"layers_per_block must be an int, not {per_block!r}")
    if config.get("mid_block_type") not in (None, "UNetMidBlock2DCrossAttn"):
        raise ValueError(
            f"mid_block_type {config['mid_block_type']!r}: LDM's middle_block is ResNet, attention, ResNet"
        )
    rules = {}
    index = 1  # input_blocks.0 is conv_in
    for block in range(len(config["down_block_types"])):
        for layer in range(per_block):
            rules[f"down_blocks.{block}.resnets.{layer}."] = (f"input_blocks.{index}.0.", _UNET_RESNET)
            rules[f"down_blocks.{block}.attentions.{layer}."] = (f"input_blocks.{index}.1.", {})
            index += 1
        if f"down_blocks.{block}.downsamplers.0.conv.weight" in state:
            rules[f"down_blocks.{block}.downsamplers.0.conv."] = (f"input_blocks.{index}.0.op.", {})
            index += 1
    rules["mid_block.resnets.0."] = ("middle_block.0.", _UNET_RESNET)
    rules["mid_block.attentions.0."] = ("middle_block.1.", {})
    rules["mid_block.resnets.1."] = ("middle_block.2.", _UNET_RESNET)
    index = 0
    for block in range(len(config["up_block_types"])):
        for layer in range(per_block + 1):
            rules[f"up_blocks.{block}.resnets.{layer}."] = (f"output_blocks.{index}.0.", _UNET_RESNET)
            rules[f"up_blocks.{block}.attentions.{layer}."] = (f"output_blocks.{index}.1.", {})
            index += 1
        # The upsampler shares the block's last output block, after its attention if it has one.
        attended = any(key.startswith(f"up_blocks.{block}.attentions.{per_block}.") for key in state)
        rules[f"up_blocks.{block}.upsamplers.0.conv."] = (f"output_blocks.{index - 1}.{2 if attended else 1}.conv.", {})
    return _rename(state, mappings["unet"]["layers"], rules)


def _ldm_vae(state: dict, config: dict) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_ldm_vae_checkpoint``: LDM numbers the decoder's up blocks from the bottom."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    mappings: dict[str, Any] = DIFFUSERS_TO_LDM_MAPPING  # a nested literal that mypy reads as dict[str, object]

    rules = {}
    for part in ("encoder", "decoder"):
        for layer in (0, 1):
            rules[f"{part}.mid_block.resnets.{layer}."] = (f"{part}.mid.block_{layer + 1}.", _VAE_RESNET)
        rules[f"{part}.mid_block.attentions.0."] = (f"{part}.mid.attn_1.", _VAE_ATTENTION)
    for block in range(len(config["down_block_types"])):
        for layer in range(config["layers_per_block"]):
            rules[f"encoder.down_blocks.{block}.resnets.{layer}."] = (
                f"encoder.down.{block}.block.{layer}.",
                _VAE_RESNET,
            )
        rules[f"encoder.down_blocks.{block}.downsamplers.0.conv."] = (f"encoder.down.{block}.downsample.conv.", {})
    ups = len(config["up_block_types"])
    for block in range(ups):
        for layer in range(config["layers_per_block"] + 1):
            rules[f"decoder.up_blocks.{block}.resnets.{layer}."] = (
                f"decoder.up.{ups - 1 - block}.block.{layer}.",
                _VAE_RESNET,
            )
        rules[f"decoder.up_blocks.{block}.upsamplers.0.conv."] = (f"decoder.up.{ups - 1 - block}.upsample.conv.", {})
    out = _rename(state, mappings["vae"], rules)
    # LDM's mid attention projects with 1x1 convolutions; the converter squeezes them back to linear weights.
    attention = re.compile(r"mid\.attn_1\.(q|k|v|proj_out)\.weight$")
    return {k: v[:, :, None, None] if attention.search(k) and v.ndim == 2 else v for k, v in out.items()}


def _sd(folder: str) -> dict[str, torch.Tensor]:
    unet, vae, (clip, _) = _component(folder, "unet"), _component(folder, "vae"), _component(folder, "text_encoder")
    out = {f"model.diffusion_model.{k}": v for k, v in _ldm_unet(*unet).items()}
    out.update({f"first_stage_model.{k}": v for k, v in _ldm_vae(*vae).items()})
    # transformers >= 5.6 saves CLIPTextModel without its ``text_model.`` level; SD checkpoints and diffusers'
    # CLIP detection (CHECKPOINT_KEY_NAMES["clip"]) have it.
    out.update({f"cond_stage_model.transformer.text_model.{k.removeprefix('text_model.')}": v for k, v in clip.items()})
    return out


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """BFL's final adaLN emits (shift, scale), diffusers' (scale, shift); swapping halves is its own inverse."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def _flux(folder: str) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_flux_transformer_checkpoint_to_diffusers``: BFL fuses q, k, v (and, in single blocks, the
    MLP input) into one projection."""
    state, config = _component(folder, "transformer")
    s = dict(state)
    out = {}

    def move(dst: str, src: str) -> None:
        for param in ("weight", "bias"):
            out[f"{dst}.{param}"] = s.pop(f"{src}.{param}")

    def fuse(dst: str, *srcs: str) -> None:
        for param in ("weight", "bias"):
            out[f"{dst}.{param}"] = torch.cat([s.pop(f"{src}.{param}") for src in srcs])

    embedders = {"time_in": "timestep_embedder", "vector_in": "text_embedder", "guidance_in": "guidance_embedder"}
    for bfl, ours in embedders.items():
        if f"time_text_embed.{ours}.linear_1.weight" in s:  # no guidance embedder in schnell-style models
            move(f"{bfl}.in_layer", f"time_text_embed.{ours}.linear_1")
            move(f"{bfl}.out_layer", f"time_text_embed.{ours}.linear_2")
    move("txt_in", "context_embedder")
    move("img_in", "x_embedder")
    for i in range(config["num_layers"]):
        d, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        move(f"{d}.img_mod.lin", f"{t}.norm1.linear")
        move(f"{d}.txt_mod.lin", f"{t}.norm1_context.linear")
        fuse(f"{d}.img_attn.qkv", f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v")
        fuse(f"{d}.txt_attn.qkv", f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj")
        for stream, q, k in (("img", "norm_q", "norm_k"), ("txt", "norm_added_q", "norm_added_k")):
            out[f"{d}.{stream}_attn.norm.query_norm.scale"] = s.pop(f"{t}.attn.{q}.weight")
            out[f"{d}.{stream}_attn.norm.key_norm.scale"] = s.pop(f"{t}.attn.{k}.weight")
        move(f"{d}.img_mlp.0", f"{t}.ff.net.0.proj")
        move(f"{d}.img_mlp.2", f"{t}.ff.net.2")
        move(f"{d}.txt_mlp.0", f"{t}.ff_context.net.0.proj")
        move(f"{d}.txt_mlp.2", f"{t}.ff_context.net.2")
        move(f"{d}.img_attn.proj", f"{t}.attn.to_out.0")
        move(f"{d}.txt_attn.proj", f"{t}.attn.to_add_out")
    for i in range(config["num_single_layers"]):
        d, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        move(f"{d}.modulation.lin", f"{t}.norm.linear")
        fuse(f"{d}.linear1", f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v", f"{t}.proj_mlp")
        out[f"{d}.norm.query_norm.scale"] = s.pop(f"{t}.attn.norm_q.weight")
        out[f"{d}.norm.key_norm.scale"] = s.pop(f"{t}.attn.norm_k.weight")
        move(f"{d}.linear2", f"{t}.proj_out")
    move("final_layer.linear", "proj_out")
    for param in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{param}"] = _swap_halves(s.pop(f"norm_out.linear.{param}"))
    if s:
        raise ValueError(f"no name in Black Forest Labs' layout for: {sorted(s)}")
    return out


def _transformer_in(layout: Callable[[dict, dict], dict[str, torch.Tensor]]) -> Callable[[str], dict]:
    """The folder's transformer alone, in ``layout`` (one of `vllm_omni.testing.models.single_file_dit`'s)."""
    return lambda folder: layout(*_component(folder, "transformer"))


SINGLE_FILE_FAMILIES: dict[str, Callable[[str], dict[str, torch.Tensor]]] = {
    "sd": _sd,
    "flux": _flux,
    "flux-schnell": _flux,
    "sd3": _transformer_in(sd3_layout),
    "wan": _transformer_in(wan_layout),
}
"""Each family's single file: the whole pipeline (sd) or its denoiser alone (the others)."""

DENOISER_ONLY_FAMILIES = ("flux", "flux-schnell", "sd3", "wan")
"""The families whose single file holds the denoiser alone, as city96's GGUFs do."""


def write_single_file(folder: str, family: str, out: str) -> str:
    """Write ``folder``'s weights to ``out`` (a ``.safetensors``) in the original layout; return ``out``."""
    from safetensors.torch import save_file

    if family not in SINGLE_FILE_FAMILIES:
        raise ValueError(
            f"no single-file layout for family {family!r}; choose one of: {', '.join(SINGLE_FILE_FAMILIES)}"
        )
    tensors = {k: v.contiguous() for k, v in SINGLE_FILE_FAMILIES[family](os.fspath(folder)).items()}
    save_file(tensors, os.fspath(out), metadata={"format": "pt"})
    return os.fspath(out)


# The rows diffusers 0.42.1's converter splits every ``linear1`` into: q, k, v at 3072 and the MLP at 4 x 3072.
_FLUX1_LINEAR1_ROWS = 3 * 3072 + 4 * 3072
_LINEAR1 = re.compile(r"^(?:model\.diffusion_model\.)?single_blocks\.(\d+)\.linear1\.(weight|bias)$")


def _flux_converter_at_config_width(checkpoint: dict, config=None, **kwargs) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    inner = config["num_attention_heads"] * config["attention_head_dim"]
    ours = {}
    for key, found in [(k, m) for k in checkpoint if (m := _LINEAR1.match(k)) is not None]:
        block, param = found.groups()
        fused = checkpoint[key]
        parts = torch.split(fused, [inner, inner, inner, fused.shape[0] - 3 * inner])
        for name, part in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), parts, strict=True):
            ours[f"single_transformer_blocks.{block}.{name}.{param}"] = part
        # A zero-stride stand-in of the size diffusers expects, so that its converter still maps everything else.
        checkpoint[key] = fused.new_zeros((1, *fused.shape[1:])).expand(_FLUX1_LINEAR1_ROWS, *fused.shape[1:])
    return {**convert_flux_transformer_checkpoint_to_diffusers(checkpoint, config=config, **kwargs), **ours}


@contextlib.contextmanager
def flux_converter_for_any_width() -> Iterator[None]:
    """Within it, ``from_single_file`` splits Flux's fused ``linear1`` at the config's width, not FLUX.1's."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    classes: dict[str, Any] = SINGLE_FILE_LOADABLE_CLASSES  # a literal of mixed entries: mypy reads it as object
    entry = classes["FluxTransformer2DModel"]
    original = entry["checkpoint_mapping_fn"]
    entry["checkpoint_mapping_fn"] = _flux_converter_at_config_width
    try:
        yield
    finally:
        entry["checkpoint_mapping_fn"] = original
