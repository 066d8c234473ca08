"""Outputs that are not numbers: a request whose decoded pixels (or latents) hold NaN or inf fails, naming the likely
cause, and is never answered as an image.

Converting to PIL hides them (NaN becomes black, inf white), so `watch_outputs` looks at the decoded pixels where
every path converts them, the pipeline's image or video processor (request mode's pipeline call, the steppers'
decode in step mode and in a split ``decode`` stage), and marks the outputs of each row that is not finite;
`EngineCore.output` fails a request whose output `is_finite` denies (`non_finite_error`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_omni.diffusion.pipeline.components import OUTPUT_PROCESSORS
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.errors import NonFiniteOutputError

if TYPE_CHECKING:
    from vllm_omni.diffusion.families.model_card import ModelCard
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

NOT_FINITE = "vllm_omni_not_finite"
"""The key a PIL output of a row that was not finite carries in its ``info``."""
_WATCHED = "_vllm_omni_watched"


_AN = {"image": "an image", "video": "a video", "audio": "audio"}


def non_finite_error(request_id: str, card: ModelCard, params: OmniDiffusionSamplingParams) -> NonFiniteOutputError:
    """The error that fails a request whose output is not finite, naming the likely causes (too few steps for the
    scheduler is refused at admission: `ModelCard.min_steps`)."""
    shift = params.extra_args.get("flow_shift")
    asked = f"its flow_shift={shift!r}, " if shift is not None else ""
    return NonFiniteOutputError(
        request_id,
        f"{card.pipeline_name}'s output is not finite (NaN or inf), so it is not answered as {_AN[card.output]}: "
        f"likely {asked}a numerical overflow at the stage's dtype (float16: serve it in bfloat16 or float32), or "
        "weights that are not finite",
    )


def watch_outputs(pipeline) -> None:
    """Mark the outputs of each decoded row that is not finite, in the pipeline's image and video processors
    (``postprocess``, ``postprocess_video``): a PIL output in its ``info``; a NumPy or torch output is made NaN
    throughout (its inf would else be clipped to white). Idempotent: an image variant built with ``from_pipe`` has
    processors of its own."""
    for attribute, method in OUTPUT_PROCESSORS:
        processor = getattr(pipeline, attribute, None)
        if processor is not None and not getattr(processor, _WATCHED, False) and hasattr(processor, method):
            setattr(processor, _WATCHED, True)
            setattr(processor, method, _marking(getattr(processor, method)))


def _marking(postprocess: Callable) -> Callable:
    @functools.wraps(postprocess)
    def marked(pixels, *args, **kwargs) -> Any:
        if not isinstance(pixels, torch.Tensor) or bool(torch.isfinite(pixels).all()):
            return postprocess(pixels, *args, **kwargs)
        bad = ~torch.isfinite(pixels.flatten(1)).all(dim=1)
        pixels = torch.where(bad.view(-1, *(1,) * (pixels.ndim - 1)), torch.nan, pixels)
        with np.errstate(invalid="ignore"):  # NaN cast to uint8 for PIL
            outputs = postprocess(pixels, *args, **kwargs)
        for row in bad.nonzero().flatten().tolist():
            _mark(outputs[row])
        return outputs

    return marked


def _mark(output: Any) -> None:
    if isinstance(output, list | tuple):  # a video's frames
        for frame in output:
            _mark(frame)
    elif hasattr(output, "info"):  # a PIL image
        output.info[NOT_FINITE] = True


def is_finite(output: Any) -> bool:
    """Whether an output (an image, a video's frames, a list of them; a PIL image, a NumPy array, a tensor) holds
    numbers only, as `watch_outputs` marked it."""
    if isinstance(output, list | tuple):
        return all(is_finite(item) for item in output)
    if isinstance(output, torch.Tensor):
        return not output.is_floating_point() or bool(torch.isfinite(output).all())
    if isinstance(output, np.ndarray):
        return output.dtype.kind != "f" or bool(np.isfinite(output).all())
    info = getattr(output, "info", None)
    return not (isinstance(info, dict) and info.get(NOT_FINITE))


class FiniteExtension(Extension):
    """The finite check as an extension (`vllm_omni.diffusion.pipeline.extensions`): `watch_outputs` on each
    pipeline when it loads (the loaded one and each image variant); `EngineCore.output` fails what it marked."""

    name = "finite"

    def on_load(self, pipeline: Any, variant: bool) -> None:
        watch_outputs(pipeline)
