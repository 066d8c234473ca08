"""`ModelCard`: what admitting a request needs to know of a pipeline (its call arguments and their defaults, sizes,
kind), read once when the pipeline loads, and the completion of sampling parameters from it.

A card is plain data, without torch or weights: it crosses to the driver with a Ray replica's `ReplicaInfo`, so
every stage admits a request where the request arrives, with no call to a replica (`roles.StageAdmission`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.request import OmniDiffusionSamplingParams, SamplingParamsError

DEFAULT_VIDEO_FPS = 16
"""Frame rate a video is reported at when the request gives none (Wan models are trained at 16 fps)."""

RESERVED_ARGS = frozenset(
    {
        "prompt",
        "negative_prompt",
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "generator",
        "output_type",
        "num_images_per_prompt",
        "num_videos_per_prompt",
        "num_frames",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "return_dict",
        "latents",
        "prompt_embeds",
    }
)
"""Arguments the runner sets itself; ``extra_args`` may not carry them."""

_PLAIN = (int, float, str, bool)


@dataclass(frozen=True)
class ModelCard:
    """A loaded pipeline's facts that admission reads (`ModelCard.of`)."""

    pipeline_name: str
    """Its class name, e.g. ``FluxPipeline``."""
    call_args: frozenset[str]
    """The names of its ``__call__`` arguments."""
    call_defaults: Mapping[str, Any]
    """The plain (number or string) defaults of its ``__call__`` arguments."""
    default_size: tuple[int, int] | None
    """``(height, width)`` it uses when none is given: its call defaults, else its sample size; ``None``: none."""
    size_multiple: int
    """Height and width must be multiples of this."""
    frame_multiple: int
    """A video's num_frames must be 1 more than a multiple of this: the VAE's temporal compression."""
    outputs_arg: str | None
    """Its argument for outputs per prompt (``num_images_per_prompt`` or ``num_videos_per_prompt``), if any."""

    @property
    def is_video(self) -> bool:
        """Whether it generates videos (it takes ``num_frames``)."""
        return "num_frames" in self.call_args

    @classmethod
    def of(cls, pipeline) -> ModelCard:
        """The card of a loaded pipeline."""
        parameters = inspect.signature(pipeline.__call__).parameters
        defaults = {
            name: p.default
            for name, p in parameters.items()
            if p.default is not inspect.Parameter.empty and isinstance(p.default, _PLAIN)
        }
        # Latents are the VAE's spatial factor times smaller and packed or patched 2×2 by DiT pipelines; UNet
        # pipelines check multiples of 8 themselves.
        scale = getattr(pipeline, "vae_scale_factor", None) or getattr(pipeline, "vae_scale_factor_spatial", 1)
        return cls(
            pipeline_name=type(pipeline).__name__,
            call_args=frozenset(parameters),
            call_defaults=defaults,
            default_size=_default_size(pipeline, defaults),
            size_multiple=max(8, 2 * int(scale)),
            frame_multiple=int(getattr(pipeline, "vae_scale_factor_temporal", 1) or 1),
            outputs_arg=next((n for n in ("num_images_per_prompt", "num_videos_per_prompt") if n in parameters), None),
        )

    def complete_params(self, params: OmniDiffusionSamplingParams) -> OmniDiffusionSamplingParams:
        """Fill unset fields with the pipeline's defaults; raise `SamplingParamsError` for what it cannot take."""
        name = self.pipeline_name
        if params.negative_prompt is not None and "negative_prompt" not in self.call_args:
            raise SamplingParamsError("negative_prompt", f"negative_prompt is not accepted by {name}")
        if params.guidance_scale is not None and "guidance_scale" not in self.call_args:
            raise SamplingParamsError("guidance_scale", f"guidance_scale is not accepted by {name}")
        if params.num_outputs_per_prompt > 1 and self.outputs_arg is None:
            raise SamplingParamsError(
                "num_outputs_per_prompt", f"num_outputs_per_prompt > 1 is not supported by {name}"
            )
        for arg in params.extra_args:
            if arg in RESERVED_ARGS:
                raise SamplingParamsError(
                    "extra_args", f"extra_args may not set {arg!r}: it is a sampling parameter or set by vllm-omni"
                )
            if arg not in self.call_args:
                raise SamplingParamsError("extra_args", f"extra_args key {arg!r} is not an argument of {name}.__call__")
        size = self.default_size
        if (params.height is None or params.width is None) and size is None:
            raise SamplingParamsError("height", f"{name} has no default size: give height and width")
        height, width = params.height or size[0], params.width or size[1]
        video = self._complete_video(params)
        for field, value in (("height", height), ("width", width)):
            if value % self.size_multiple:
                raise SamplingParamsError(
                    field, f"{field}={value} is not a multiple of {self.size_multiple}, which {name} requires"
                )
        return params.model_copy(
            update={
                **video,
                "height": height,
                "width": width,
                "num_inference_steps": params.num_inference_steps
                or self.call_defaults.get("num_inference_steps")
                or 50,
                "guidance_scale": params.guidance_scale
                if params.guidance_scale is not None
                else self.call_defaults.get("guidance_scale"),
            }
        )

    def _complete_video(self, params: OmniDiffusionSamplingParams) -> dict[str, int]:
        """num_frames and fps for a video pipeline (checked against its temporal VAE factor); none for images."""
        if not self.is_video:
            for field in ("num_frames", "fps"):
                if getattr(params, field) is not None:
                    raise SamplingParamsError(
                        field, f"{field} applies to video pipelines; {self.pipeline_name} makes images"
                    )
            return {}
        num_frames = params.num_frames or self.call_defaults.get("num_frames")
        if (num_frames - 1) % self.frame_multiple:
            raise SamplingParamsError(
                "num_frames",
                f"num_frames={num_frames} must be 1 more than a multiple of {self.frame_multiple} for "
                f"{self.pipeline_name}",
            )
        return {"num_frames": num_frames, "fps": params.fps or DEFAULT_VIDEO_FPS}


def _default_size(pipeline, defaults: Mapping[str, Any]) -> tuple[int, int] | None:
    height, width = defaults.get("height"), defaults.get("width")
    if isinstance(height, int) and isinstance(width, int):
        return height, width
    sample = getattr(pipeline, "default_sample_size", None)
    if sample is None:
        denoiser = getattr(pipeline, "unet", None) or getattr(pipeline, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
    scale = getattr(pipeline, "vae_scale_factor", None)
    return (sample * scale,) * 2 if isinstance(sample, int) and isinstance(scale, int) else None
