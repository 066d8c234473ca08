"""What OpenAI's Images fields ``quality``, ``safety_identifier`` and ``usage`` mean here (docs/serving.md, "Quality,
usage and OpenAI's other image fields"): a quality level's step count and what every answer echoes
(`response_fields`, shared by the JSON answer and the stream's events). The tokenizer that counts a prompt is loaded
with the model (`server_state.load_prompt_tokenizer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni.config.serving import QualityLevel
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.outputs import OmniRequestOutput
    from vllm_omni.sampling_params import ImageTask, OmniDiffusionSamplingParams

logger = init_logger(__name__)

QUALITY_LEVEL: dict[str, QualityLevel] = {
    "low": "low",
    "medium": "medium",
    "standard": "medium",
    "high": "high",
    "hd": "high",
    "auto": "high",
}
"""The level of each ``quality`` value: DALL·E 3's ``standard`` and ``hd`` are ``medium`` and ``high``; ``auto`` is
``high``, the model's own default steps unless ``--quality-steps`` says otherwise."""

STEP_DIVISOR: dict[QualityLevel, int] = {"low": 4, "medium": 2, "high": 1}
"""A level's steps without ``--quality-steps``: the model's default steps divided by this, rounded down, at least 1."""


def quality_steps(state: ServerState, body: ImageGenerationRequest, task: ImageTask) -> int:
    """The request's ``num_inference_steps``: its own, else its quality level's (``--quality-steps``, else the
    default steps of the pipeline that serves ``task`` over `STEP_DIVISOR`)."""
    if body.num_inference_steps is not None:
        return body.num_inference_steps
    level = QUALITY_LEVEL[body.quality]
    if level in state.serving.quality_steps:
        return state.serving.quality_steps[level]
    card = state.loaded_omni.model_card
    served = card.for_task(task) if task in card.tasks else card  # admission refuses a task the model does not serve
    return max(1, served.default_steps // STEP_DIVISOR[level])


def response_fields(
    state: ServerState, body: ImageGenerationRequest, params: OmniDiffusionSamplingParams, output: OmniRequestOutput
) -> dict[str, Any]:
    """What an Images answer (or stream event) says besides its images, as JSON values: ``background``,
    ``output_format``, ``quality`` (left out when the request gave ``num_inference_steps``), ``size`` and, for a
    finished output of a model with a tokenizer, ``usage``. ``params``: the request's admitted parameters;
    ``output``: its output or a preview. A finished output also logs the request's safety identifier (its
    ``safety_identifier``, else its ``user``) with its request id. Local arithmetic and one tokenizer call: it runs
    on the event loop."""
    fields: dict[str, Any] = {"background": "opaque", "output_format": body.output_format}
    if body.num_inference_steps is None:
        fields["quality"] = QUALITY_LEVEL[body.quality]
    fields["size"] = f"{params.width}x{params.height}"
    identifier = body.safety_identifier or body.user
    if output.finished and identifier:
        logger.info("Image request %s completed for safety_identifier %r", output.request_id, identifier)
    tokenizer = state.prompt_tokenizer
    if output.finished and tokenizer is not None:
        pixels = state.loaded_omni.model_card.latent_pixels
        texts = [text for text in (body.prompt, body.negative_prompt) if text]
        text_tokens = sum(len(tokenizer(text, verbose=False).input_ids) for text in texts)
        image_tokens = sum((image.width // pixels) * (image.height // pixels) for image in params.image or ())
        assert params.width is not None and params.height is not None, "complete params"
        output_tokens = len(output.images) * (params.width // pixels) * (params.height // pixels)
        fields["usage"] = {
            "input_tokens": text_tokens + image_tokens,
            "input_tokens_details": {"text_tokens": text_tokens, "image_tokens": image_tokens},
            "output_tokens": output_tokens,
            "total_tokens": text_tokens + image_tokens + output_tokens,
        }
    return fields
