"""The tiny random-weight models by family: what ``vllm-omni make-tiny-model DIR --family F`` writes, and what the
tests, the benchmarks and the demo build (`make_tiny_model`).

    vllm-omni make-tiny-model DIR --family sd|sdxl|sd3|flux|flux-bench|flux-schnell|wan|wan2.2  (tiny_models)
                                           |kontext|qwen-image-edit|qwen-image-edit-plus|wan-i2v  (tiny_edit_models)
                                           |qwen-image|z-image|flux2|ltx|hunyuan-video-1.5  (tiny_families)
                                           |stable-audio|stable-audio-3|longcat-audio|ace-step  (tiny_audio)
                                           |llm  (tiny_llm: the LLM of an ``llm`` stage)
                                           |orpheus|llasa  (tiny_speech: DIR/talker and DIR/codec)

The table lives apart from the builders, so that the builder modules import one another in one direction only.
"""

from __future__ import annotations

import os

from vllm_omni.testing.models import tiny_audio, tiny_edit_models, tiny_families, tiny_llm, tiny_speech
from vllm_omni.testing.models.tiny_models import (
    build_tiny_flux,
    build_tiny_sd,
    build_tiny_sd3,
    build_tiny_sdxl,
    build_tiny_wan,
)

FAMILIES = {
    "sd": build_tiny_sd,
    "sdxl": build_tiny_sdxl,
    "sd3": build_tiny_sd3,
    "flux": build_tiny_flux,
    "flux-bench": lambda: build_tiny_flux(bench=True),
    "flux-schnell": lambda: build_tiny_flux(guidance_embeds=False),
    "wan": build_tiny_wan,
    "wan2.2": lambda: build_tiny_wan(two_experts=True),
    "kontext": tiny_edit_models.build_tiny_kontext,
    "qwen-image-edit": tiny_edit_models.build_tiny_qwen_image_edit,
    "qwen-image-edit-plus": tiny_edit_models.build_tiny_qwen_image_edit_plus,
    "wan-i2v": tiny_edit_models.build_tiny_wan_i2v,
    "qwen-image": tiny_families.build_tiny_qwen_image,
    "z-image": tiny_families.build_tiny_z_image,
    "flux2": tiny_families.build_tiny_flux2,
    "ltx": tiny_families.build_tiny_ltx,
    "hunyuan-video-1.5": tiny_families.build_tiny_hunyuan_video_15,
    "stable-audio": tiny_audio.build_tiny_stable_audio,
    "stable-audio-3": tiny_audio.build_tiny_stable_audio_3,
    "longcat-audio": tiny_audio.build_tiny_longcat_audio,
    "ace-step": tiny_audio.build_tiny_ace_step,
}
"""The tiny diffusers pipelines, by family."""

MODEL_FAMILIES = FAMILIES | {
    "llm": tiny_llm.TinyLlm,
    "orpheus": tiny_speech.build_tiny_orpheus,
    "llasa": tiny_speech.build_tiny_llasa,
}
"""What ``make-tiny-model`` writes: the pipelines, the LLM of an ``llm`` stage (a transformers folder), and the
speech families (a talker folder and a codec folder)."""


def make_tiny_model(path: str | os.PathLike[str], family: str = "flux") -> str:
    """Write a tiny ``family`` model to ``path`` (a diffusers folder, a transformers one for ``llm``, ``talker/`` and
    ``codec/`` for a speech family) and return the path."""
    if family not in MODEL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of: {', '.join(MODEL_FAMILIES)}")
    path = os.fspath(path)
    MODEL_FAMILIES[family]().save_pretrained(path)
    return path
