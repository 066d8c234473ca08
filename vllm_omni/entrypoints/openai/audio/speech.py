"""OpenAI's text to speech: ``POST /v1/audio/speech`` speaks the request's ``input`` with the served speech model (a
talker and its codec) and answers with the audio as it is made (speech_stream.py); ``GET /v1/audio/voices`` lists
the model's voices and the OpenAI names they answer to. What a route reads of the model is the facade's
``speech_card``."""

from __future__ import annotations

import fnmatch
import uuid
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vllm_omni.entrypoints.openai.admission import admit, report_ignored
from vllm_omni.entrypoints.openai.audio.speech_stream import SpeechAudio, speech_body
from vllm_omni.entrypoints.openai.checks import check_request, check_serves
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.outcomes import Outcome, next_output
from vllm_omni.entrypoints.openai.protocol import SpeechRequest, VoiceList
from vllm_omni.entrypoints.openai.request_fields import ignored_fields
from vllm_omni.metrics import prometheus as metrics

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.sampling_params import AdmittedParams

OPENAI_SPEECH_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts*")
"""OpenAI's speech models by name (a glob: ``gpt-4o-mini-tts`` and its dated snapshots). A speech request that names
one asks for the served model: clients hard-code them (Open WebUI's and SillyTavern's default is ``tts-1``)."""


def openai_speech_model(name: str | None) -> bool:
    """Whether ``name`` is one of `OPENAI_SPEECH_MODELS`."""
    return name is not None and any(fnmatch.fnmatchcase(name, pattern) for pattern in OPENAI_SPEECH_MODELS)


def _admit(state: ServerState, body: SpeechRequest, timer: metrics.PhaseTimer) -> AdmittedParams:
    """The request's checks, then its complete parameters (an OpenAI voice name mapped to the family's voice, the
    model's defaults filled in, a seed drawn) within the operator's limits; an unknown voice is admission's 400
    naming ``voice``. Local work: it runs on the event loop."""
    check_request(state, body, kind="speech")
    timer.mark("validation")  # FastAPI's schema validation, the API key, the checks
    card = state.loaded_omni.speech_card
    assert card is not None, "check_request found a speech model"
    voice = body.voice_name
    if voice is not None and voice not in card.voices:
        voice = card.openai_voices.get(voice, voice)
    admitted = admit(state, body, ignored_fields(body), voice=voice)
    timer.mark("completion")
    return admitted


def _served(state: ServerState, body: SpeechRequest) -> SpeechRequest:
    """``body`` asking for the served model when its ``model`` is one of OpenAI's speech models (and not a name this
    server serves under)."""
    if body.model in state.serving.served_model_names or not openai_speech_model(body.model):
        return body
    return body.model_copy(update={"model": None})


async def create_speech(body: SpeechRequest, raw_request: Request) -> Response:
    """Check and admit the request, start it, and once its first audio is made answer with the stream of its audio
    (`speech_body`): a request that fails before it gets its error status. Counted in
    ``vllm_omni:speech_generation_requests`` by outcome, its phases in ``vllm_omni:request_phase_seconds``."""
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    body = _served(state, body)
    with Outcome(metrics.speech_requests) as outcome:
        admitted = _admit(state, body, timer)
        card = state.loaded_omni.speech_card
        assert card is not None, "admitted by a speech model"
        audio = SpeechAudio(body.response_format, card.sample_rate, card.channels, body.speed)
        outcome.running()
        request_id = f"speech-{uuid.uuid4().hex}"
        report_ignored(raw_request, body, admitted, "speech", request_id)
        generation = state.loaded_omni.generate(body.input, admitted, request_id=request_id)
        try:
            first = await next_output(raw_request, generation, outcome)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the request was aborted and its slot freed
        outcome.handed_over()  # the stream counts it when it ends
        sse = body.stream_format == "sse"
        return StreamingResponse(
            speech_body(raw_request, sse, audio, first, generation, timer, admitted.params),
            media_type="text/event-stream" if sse else audio.encoder.media_type,
            headers={**audio.encoder.headers(), "Cache-Control": "no-cache"},
        )


async def list_voices(raw_request: Request) -> VoiceList:
    """The served speech model's voices (upstream vllm-omni's answer) and the OpenAI names it takes."""
    state: ServerState = raw_request.app.state.server
    check_serves(state, "speech")
    card = state.loaded_omni.speech_card
    assert card is not None, "check_serves found a speech model"
    return VoiceList(voices=list(card.voices), default_voice=card.default_voice, openai_voices=dict(card.openai_voices))
