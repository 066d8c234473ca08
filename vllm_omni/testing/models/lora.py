"""Random LoRA adapters for the tiny models (``vllm-omni make-tiny-model --lora``) and the stock reference run
that per-row adapters must match (diffusers' ``load_lora_weights`` + ``set_adapters``, one request alone)."""

from __future__ import annotations

import os

import torch

STRENGTH = 0.5
"""Norm of each random weight delta relative to the weight it adds to: on the tiny models at 2 steps, an adapter
at scale 0.8 moves pixels by some 30/255 at most, without saturating them."""
ALPHA_PER_RANK = 2
"""``lora_alpha / r`` of the random adapters: not 1, so that a server that forgets PEFT's scaling is caught."""
DENOISER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "proj_out")
"""Denoiser modules the random adapters target: attention in every family, and the output projections (without
them, an adapter barely moves the transformer families' images)."""
CONV_TARGETS = ("conv1",)
"""UNet convolutions they also target (a convolution LoRA layer)."""
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
"""CLIP text-encoder modules they target when asked to carry text-encoder weights."""
CLIP_TEXT_ENCODER_FAMILIES = ("sd", "sdxl", "sd3", "flux", "flux-bench", "kontext")
"""Tiny-model families whose ``text_encoder`` is CLIP: those whose random adapters can carry text-encoder weights."""


def _random_lora(
    module: torch.nn.Module, targets: list[str], rank: int, seed: int, strength: float
) -> dict[str, torch.Tensor]:
    """A PEFT state dict of a rank-``rank`` adapter on ``targets`` of ``module``: random A and B, scaled so that each
    layer's weight delta (``B @ A · scaling``) has ``strength`` times the norm of the weight it adds to."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=ALPHA_PER_RANK * rank, target_modules=targets, init_lora_weights=False)
    inject_adapter_in_model(config, module, adapter_name="random")
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, LoraLayer) and "random" in layer.lora_A:
                a = layer.lora_A["random"].get_parameter("weight")
                b = layer.lora_B["random"].get_parameter("weight")
                delta = (b.flatten(1) @ a.flatten(1)).norm() * layer.scaling["random"]
                factor = (strength * layer.get_base_layer().get_parameter("weight").norm() / delta).sqrt()
                a.mul_(factor)
                b.mul_(factor)
    return {k: v.contiguous() for k, v in get_peft_model_state_dict(module, adapter_name="random").items()}


def write_random_lora(
    model: str,
    path: str,
    *,
    seed: int = 0,
    rank: int = 4,
    text_encoder: bool = False,
    kohya: bool = False,
    strength: float = STRENGTH,
) -> str:
    """Write a random adapter for the pipeline folder ``model`` to the folder ``path`` (as ``save_lora_weights``
    does), or with ``kohya`` to the file ``path`` in kohya's key format (SD and SDXL: diffusers converts it on
    load). ``text_encoder``: the adapter carries weights for the (CLIP) ``text_encoder`` too. ``seed`` picks the
    random weights; ``strength``: see `STRENGTH`. Returns ``path``."""
    import diffusers

    from vllm_omni.diffusion.pipeline.runner import load_pipeline

    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    denoiser_name = "unet" if getattr(pipeline, "unet", None) is not None else "transformer"
    denoiser = getattr(pipeline, denoiser_name)
    targets = list(DENOISER_TARGETS) + (list(CONV_TARGETS) if denoiser_name == "unet" else [])
    layers = {f"{denoiser_name}_lora_layers": _random_lora(denoiser, targets, rank, seed, strength)}
    if text_encoder:
        if not type(pipeline.text_encoder).__name__.startswith("CLIPText"):
            raise ValueError(
                f"random text-encoder LoRA weights are written for CLIP text encoders; {model} has "
                f"{type(pipeline.text_encoder).__name__}"
            )
        layers["text_encoder_lora_layers"] = _random_lora(
            pipeline.text_encoder, list(TEXT_TARGETS), rank, seed + 1, strength
        )
    if kohya:
        if denoiser_name != "unet":
            raise ValueError("kohya-style random adapters are written for UNet models (sd, sdxl) only")
        from safetensors.torch import save_file

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_file(_kohya(layers, rank), path)
        return path
    getattr(diffusers, type(pipeline).__name__).save_lora_weights(path, **layers)
    return path


def write_lora_with_config(model: str, path: str, *, seed: int = 0, rank: int = 4):
    """A random denoiser adapter for the pipeline folder ``model`` at ``lora_alpha = ALPHA_PER_RANK · rank``,
    written to the folder ``path`` with its config as diffusers' adapter metadata (so that the file's scaling is
    that alpha's; without it diffusers infers alpha = rank). Returns ``(path, tensors, config)``: the tensors keyed
    as the file holds them (``transformer.…``) and the ``peft.LoraConfig``, what ``add_lora(name, tensors,
    config)`` takes."""
    import json

    import diffusers
    from peft import LoraConfig
    from safetensors.torch import load_file

    from vllm_omni.diffusion.pipeline.runner import read_model_index

    plain = write_random_lora(model, os.path.join(path, "plain"), seed=seed, rank=rank)
    tensors = load_file(os.path.join(plain, "pytorch_lora_weights.safetensors"))
    denoiser = "unet" if "unet" in read_model_index(model) else "transformer"
    targets = list(DENOISER_TARGETS) + (list(CONV_TARGETS) if denoiser == "unet" else [])
    config = LoraConfig(r=rank, lora_alpha=ALPHA_PER_RANK * rank, target_modules=targets)
    pipeline_cls = getattr(diffusers, read_model_index(model)["_class_name"])
    pipeline_cls.save_lora_weights(
        path,
        **{f"{denoiser}_lora_layers": {k.removeprefix(f"{denoiser}."): v for k, v in tensors.items()}},
        **{f"{denoiser}_lora_adapter_metadata": json.loads(json.dumps(config.to_dict(), default=sorted))},
    )
    return path, tensors, config


def _kohya(layers: dict[str, dict[str, torch.Tensor]], rank: int) -> dict[str, torch.Tensor]:
    """PEFT-format layers as kohya's keys: ``lora_unet_<module_path>.lora_down.weight`` / ``.lora_up.weight`` /
    ``.alpha``, ``lora_te_`` for the text encoder."""
    prefixes = {"unet_lora_layers": "lora_unet_", "text_encoder_lora_layers": "lora_te_"}
    out: dict[str, torch.Tensor] = {}
    for group, state in layers.items():
        for key, value in state.items():
            module, kind = key.rsplit(".lora_", 1)
            name = prefixes[group] + module.replace(".", "_")
            out[f"{name}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(float(ALPHA_PER_RANK * rank))
    return out


def stock_lora_images(
    model: str, adapters: dict[str, str], weights: dict[str, float], prompt: str, *, seed: int, **call
):
    """The stock pipeline's output for one request: a fresh pipeline, ``adapters`` (name → path) loaded with
    ``load_lora_weights`` and activated with ``set_adapters(names, weights)`` (no weights: LoRA disabled), called
    alone on ``prompt`` with ``call`` and a CPU generator seeded with ``seed``."""
    from vllm_omni.diffusion.pipeline.runner import load_pipeline

    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    for name, path in adapters.items():
        folder, weight_name = (path, None) if os.path.isdir(path) else os.path.split(path)
        pipeline.load_lora_weights(folder, weight_name=weight_name, adapter_name=name)
    if weights:
        pipeline.set_adapters(list(weights), list(weights.values()))
    else:
        pipeline.disable_lora()
    return pipeline(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), **call)
