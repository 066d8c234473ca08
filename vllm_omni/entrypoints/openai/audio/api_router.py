"""The /v1/audio routes. Upstream vllm-omni's audio generation API: ``POST /v1/audio/generate`` runs an audio
diffusion model (Stable Audio) on the served model's engine and answers with the audio file itself, in OpenAI's six
audio formats. OpenAI's speech API, ``POST /v1/audio/speech``, and upstream's ``GET /v1/audio/voices`` are
speech.py's."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from vllm_omni.entrypoints.openai.admission import admit, report_ignored, selected_adapters
from vllm_omni.entrypoints.openai.audio.audio_files import audio_response, encode_waveforms, usage_headers
from vllm_omni.entrypoints.openai.audio.encoding import FORMATS
from vllm_omni.entrypoints.openai.audio.speech import create_speech, list_voices
from vllm_omni.entrypoints.openai.checks import check_api_key, check_query, check_request
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.outcomes import Outcome, counting_invalid, next_output
from vllm_omni.entrypoints.openai.protocol import AudioGenerationRequest, ErrorResponse, VoiceList
from vllm_omni.entrypoints.openai.request_fields import ignored_fields
from vllm_omni.metrics import prometheus as metrics

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.outputs import OmniRequestOutput
    from vllm_omni.sampling_params import AdmittedParams


def _admit(state: ServerState, body: AudioGenerationRequest, timer: metrics.PhaseTimer) -> AdmittedParams:
    """The request's checks, then its complete parameters (the clip's length and start checked against what the
    model makes, the model's defaults filled in, a seed drawn) within the operator's limits: its `Sampling` fields
    and its adapters. Local work (no replica is asked): it runs on the event loop."""
    check_request(state, body, kind="audio")
    timer.mark("validation")  # FastAPI's schema validation, the API key, the checks
    admitted = admit(state, body, ignored_fields(body), lora=selected_adapters(state, body))
    timer.mark("completion")
    return admitted


async def generate_audio(body: AudioGenerationRequest, raw_request: Request) -> Response:
    """Check and admit the request, run it, and answer with its audio (`_answer`); counted in
    ``vllm_omni:audio_generation_requests`` by outcome, its phases in ``vllm_omni:request_phase_seconds``."""
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    with Outcome(metrics.audio_requests) as outcome:
        admitted = _admit(state, body, timer)
        outcome.running()
        request_id = f"audio-{uuid.uuid4().hex}"
        report_ignored(raw_request, body, admitted, "audio", request_id)
        generation = state.loaded_omni.generate(body.prompt, admitted, request_id=request_id)
        try:
            output = await next_output(raw_request, generation, outcome)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the request was aborted and its slot freed
        timer.mark_engine(output, admitted.params)
        response = await _answer(state, body, output, request_id)
        timer.mark("encoding")
        timer.observe("audio")
        outcome.completed()
        return response


async def _answer(
    state: ServerState, body: AudioGenerationRequest, output: OmniRequestOutput, request_id: str
) -> Response:
    """The request's waveforms at its ``speed`` in its ``response_format``, made off the event loop."""
    assert output.sample_rate is not None, "an audio model's output has its rate"
    speed = 1.0 if body.speed is None else body.speed
    encoded = await encode_waveforms(output.audios, output.sample_rate, body.response_format, speed)
    return audio_response(encoded, request_id, usage_headers(state, body))


def build_audio_router() -> APIRouter:
    """The /v1/audio routes: upstream vllm-omni's audio generation, OpenAI's speech and upstream's voices."""
    router = APIRouter(prefix="/v1/audio", dependencies=[Depends(check_api_key), Depends(check_query)])
    media_types = sorted({spec.media_type for spec in FORMATS.values()})
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 422, 429, 500, 503)
    }
    router.add_api_route(
        "/generate",
        generate_audio,
        methods=["POST"],
        response_class=Response,
        responses={200: {"content": {media_type: {} for media_type in [*media_types, "application/zip"]}}, **errors},
        route_class_override=counting_invalid(metrics.audio_requests),
    )
    router.add_api_route(
        "/speech",
        create_speech,
        methods=["POST"],
        response_class=StreamingResponse,
        responses={200: {"content": {media_type: {} for media_type in [*media_types, "text/event-stream"]}}, **errors},
        route_class_override=counting_invalid(metrics.speech_requests),
    )
    router.add_api_route("/voices", list_voices, methods=["GET"], response_model=VoiceList, responses=errors)
    return router
