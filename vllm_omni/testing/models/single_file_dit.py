"""The original key layouts of two more denoisers, for :mod:`vllm_omni.testing.models.single_file`: each function takes
a
diffusers transformer's state dict and config and returns the state dict in the layout of the code that trained it,
the inverse of diffusers' own converter (``diffusers/loaders/single_file_utils.py``), so that ``from_single_file``
gives back the same weights.

- ``sd3_layout``: Stability's MMDiT (``joint_blocks.N.x_block.attn.qkv``, ``context_block``, ``final_layer`` ...), as
  ``sd3_medium.safetensors``' ``model.diffusion_model.`` part (here without the prefix, as city96's GGUFs);
  inverse of ``convert_sd3_transformer_checkpoint_to_diffusers``.
- ``wan_layout``: Wan-AI's layout (``blocks.N.self_attn.q``, ``ffn.0``, ``head.head``, ``head.modulation`` ...), as
  ``Wan2.1_t2v_1.3B`` files are; inverse of ``convert_wan_transformer_to_diffusers``.
"""

from __future__ import annotations

import torch


def _swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """The original adaLN emits (shift, scale), diffusers' (scale, shift); swapping halves is its own inverse."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


_SD3_QK_NORMS = (
    ("norm_q", "x_block.attn.ln_q"),
    ("norm_k", "x_block.attn.ln_k"),
    ("norm_added_q", "context_block.attn.ln_q"),
    ("norm_added_k", "context_block.attn.ln_k"),
)
"""diffusers' qk norms of a joint block (SD3.5) -> MMDiT's."""


def sd3_layout(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_sd3_transformer_checkpoint_to_diffusers``: MMDiT fuses q, k, v into one projection, and
    its last block's context stream ends at the adaLN (diffusers' ``context_pre_only``)."""
    s = dict(state)
    out = {"pos_embed": s.pop("pos_embed.pos_embed")}

    def move(dst: str, src: str, swap: bool = False) -> None:
        for param in ("weight", "bias"):
            tensor = s.pop(f"{src}.{param}")
            out[f"{dst}.{param}"] = _swap_halves(tensor) if swap else tensor

    def fuse(dst: str, *srcs: str) -> None:
        for param in ("weight", "bias"):
            out[f"{dst}.{param}"] = torch.cat([s.pop(f"{src}.{param}") for src in srcs])

    move("x_embedder.proj", "pos_embed.proj")
    move("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1")
    move("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2")
    move("context_embedder", "context_embedder")
    move("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1")
    move("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2")
    layers = config["num_layers"]
    for i in range(layers):
        j, t, last = f"joint_blocks.{i}", f"transformer_blocks.{i}", i == layers - 1
        fuse(f"{j}.x_block.attn.qkv", f"{t}.attn.to_q", f"{t}.attn.to_k", f"{t}.attn.to_v")
        fuse(f"{j}.context_block.attn.qkv", f"{t}.attn.add_q_proj", f"{t}.attn.add_k_proj", f"{t}.attn.add_v_proj")
        for norm, original in _SD3_QK_NORMS:
            if f"{t}.attn.{norm}.weight" in s:
                out[f"{j}.{original}.weight"] = s.pop(f"{t}.attn.{norm}.weight")
        move(f"{j}.x_block.attn.proj", f"{t}.attn.to_out.0")
        if f"{t}.attn2.to_q.weight" in s:  # SD3.5's dual attention layers
            fuse(f"{j}.x_block.attn2.qkv", f"{t}.attn2.to_q", f"{t}.attn2.to_k", f"{t}.attn2.to_v")
            for norm, original in (("norm_q", "ln_q"), ("norm_k", "ln_k")):
                if f"{t}.attn2.{norm}.weight" in s:
                    out[f"{j}.x_block.attn2.{original}.weight"] = s.pop(f"{t}.attn2.{norm}.weight")
            move(f"{j}.x_block.attn2.proj", f"{t}.attn2.to_out.0")
        move(f"{j}.x_block.adaLN_modulation.1", f"{t}.norm1.linear")
        move(f"{j}.context_block.adaLN_modulation.1", f"{t}.norm1_context.linear", swap=last)
        move(f"{j}.x_block.mlp.fc1", f"{t}.ff.net.0.proj")
        move(f"{j}.x_block.mlp.fc2", f"{t}.ff.net.2")
        if not last:
            move(f"{j}.context_block.attn.proj", f"{t}.attn.to_add_out")
            move(f"{j}.context_block.mlp.fc1", f"{t}.ff_context.net.0.proj")
            move(f"{j}.context_block.mlp.fc2", f"{t}.ff_context.net.2")
    move("final_layer.linear", "proj_out")
    move("final_layer.adaLN_modulation.1", "norm_out.linear", swap=True)
    if s:
        raise ValueError(f"no name in the MMDiT layout for: {sorted(s)}")
    return out


# diffusers -> Wan-AI, each applied in turn to a whole key (the reverse of diffusers' TRANSFORMER_KEYS_RENAME_DICT).
_WAN_RENAMES = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    (".norm2.", ".norm__placeholder."),  # Wan's norm3 is diffusers' norm2 (the cross-attention norm), and back
    (".norm3.", ".norm2."),
    (".norm__placeholder.", ".norm3."),
)


def wan_layout(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_wan_transformer_to_diffusers`` for text-to-video Wan 2.1 (no image embedder): only
    names change. Each name is checked against diffusers' own converter, so that a part it would not map back
    fails here rather than loading wrong."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    if config.get("image_dim") is not None or config.get("added_kv_proj_dim") is not None:
        raise ValueError("wan_layout writes text-to-video Wan (no image embedder); this config has one")
    out = {}
    for key, tensor in state.items():
        if key == "scale_shift_table":
            name = "head.modulation"
        elif key.startswith("proj_out."):
            name = "head.head." + key.removeprefix("proj_out.")
        else:
            name = key.replace(".scale_shift_table", ".modulation")
            for ours, theirs in _WAN_RENAMES:
                name = name.replace(ours, theirs)
        out[name] = tensor
    back = convert_wan_transformer_to_diffusers({k: torch.empty(0) for k in out})
    if back.keys() != state.keys():
        raise ValueError(f"no name in Wan-AI's layout for: {sorted(set(state) ^ set(back))}")
    return out
