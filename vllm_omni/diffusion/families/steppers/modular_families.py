"""The families that step mode runs through their diffusers modular blocks (`modular.ModularStepper`), one entry
each: what the blocks do not say of a family, namely how its stock pipeline guides, and what its blocks or VAE
cannot take in diffusers 0.42. docs/models.md "Adding a family"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def _cfg(params: OmniDiffusionSamplingParams) -> float | None:
    """The stock rule: classifier-free guidance when ``guidance_scale > 1``, at that scale."""
    assert params.guidance_scale is not None, "complete params"
    return params.guidance_scale if params.guidance_scale > 1 else None


def _z_image_cfg(params: OmniDiffusionSamplingParams) -> float | None:
    # ZImagePipeline guides when guidance_scale > 0, as cond + s·(cond − uncond): the guider's s + 1.
    assert params.guidance_scale is not None, "complete params"
    return params.guidance_scale + 1 if params.guidance_scale > 0 else None


@dataclass(frozen=True)
class ModularFamily:
    """What step mode needs to know of a family beyond its modular blocks: how its stock pipeline guides, and what
    its blocks cannot take."""

    guidance: Callable[[OmniDiffusionSamplingParams], float | None] | None = _cfg
    """The request's classifier-free guidance scale as diffusers' guider defines it (``uncond + s·(cond −
    uncond)``), or ``None`` when its stock pipeline would not guide it; ``None`` here: the pipeline has a guider
    component of its own, which every request uses as it is (HunyuanVideo 1.5)."""
    extra_args: frozenset[str] = frozenset()
    """``extra_args`` keys that are inputs of its blocks."""
    batched_decode: bool = True
    """Whether the requests that finish together are decoded in one call of its decoder blocks."""
    one_output_per_prompt: bool = False
    """Whether its blocks make one output per prompt only (``num_outputs_per_prompt`` 1)."""


def _true_cfg(params: OmniDiffusionSamplingParams) -> float | None:
    # QwenImagePipeline guides when true_cfg_scale > 1 and a negative prompt is given (its default is 4.0).
    scale = float(params.extra_args.get("true_cfg_scale", 4.0))
    return scale if scale > 1 and params.negative_prompt is not None else None


MODULAR_FAMILIES: dict[str, ModularFamily] = {
    "ZImagePipeline": ModularFamily(_z_image_cfg),
    "QwenImagePipeline": ModularFamily(_true_cfg, frozenset({"true_cfg_scale"})),
    # [klein] guides when guidance_scale > 1 unless it is step-distilled, whose blocks have no guider.
    "Flux2KleinPipeline": ModularFamily(),
    # LTX's decoder draws its decode noise per request (its generator and batch_size).
    "LTXPipeline": ModularFamily(batched_decode=False),
    # In diffusers 0.42 its VAE's causal attention mask takes one video per call, and its blocks multiply the batch
    # by num_videos_per_prompt twice.
    "HunyuanVideo15Pipeline": ModularFamily(None, batched_decode=False, one_output_per_prompt=True),
}
"""The stock pipeline classes that step mode runs through their modular blocks, and how each guides."""
