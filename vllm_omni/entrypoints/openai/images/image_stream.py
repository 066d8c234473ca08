"""The Images API's answer that is not a plain body: a streamed request's server-sent events (`image_events`)."""

from __future__ import annotations

import json
import time
import types
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import Request

from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.errors import APIError, error_info
from vllm_omni.entrypoints.openai.images.image_files import encode_images
from vllm_omni.entrypoints.openai.images.image_usage import response_fields
from vllm_omni.entrypoints.openai.outcomes import Outcome, next_output
from vllm_omni.entrypoints.openai.protocol import ImageEditRequest, ImageGenerationRequest
from vllm_omni.entrypoints.openai.rollout_fields import output_log_probs
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


async def image_events(
    raw_request: Request,
    body: ImageGenerationRequest,
    params: OmniDiffusionSamplingParams,
    generation: AsyncGenerator[OmniRequestOutput, None],
    timer: metrics.PhaseTimer,
) -> AsyncIterator[str]:
    """A streamed request's server-sent events, as OpenAI's: ``<kind>.partial_image`` per preview of each image,
    then ``<kind>.completed`` per image, where kind is ``image_generation`` or, for an edit, ``image_edit``. A
    failure once the stream has begun is an ``error`` event with the error envelope; a client that goes away
    aborts the request. ``timer``: its phases so far."""
    state: ServerState = raw_request.app.state.server
    kind = "image_edit" if isinstance(body, ImageEditRequest) else "image_generation"
    with Outcome(metrics.image_requests, value="failed") as outcome:
        try:
            while True:
                try:
                    output = await next_output(raw_request, generation, outcome)
                except ClientDisconnected:
                    return
                except APIError as error:
                    yield _error_event(error.status, error.message, error.param, error.code)
                    return
                if output.finished:
                    timer.mark_engine(output, params)
                for event in await _output_events(kind, state, body, params, output):
                    yield event
                if output.finished:
                    outcome.completed()
                    timer.mark("encoding")
                    timer.mark("response")
                    timer.observe("images")
                    return
        finally:
            # Aborts the request if it is still running; a cancelled read of the generator (the server cancelled
            # this stream) leaves it running, and that read's cancellation aborts the request instead.
            # a native async generator (AsyncOmni.generate), which has ag_running; typing's AsyncGenerator has not
            if not cast(types.AsyncGeneratorType, generation).ag_running:
                await generation.aclose()


async def _output_events(
    kind: str,
    state: ServerState,
    body: ImageGenerationRequest,
    params: OmniDiffusionSamplingParams,
    output: OmniRequestOutput,
) -> list[str]:
    """One output's events, one per image (base64, encoded off the event loop): ``<kind>.partial_image`` for a
    preview, ``<kind>.completed`` for the finished output, with its run's metrics and log-probabilities."""
    fields = response_fields(state, body, params, output)
    encoded = await encode_images(output.images, body, True)
    log_probs = output_log_probs(output) if output.finished else [None] * len(encoded)
    events = []
    for i, b64 in enumerate(encoded):
        event = {"b64_json": b64, "created_at": int(time.time()), **fields}
        if len(encoded) > 1:
            event["image_index"] = i
        if not output.finished:
            events.append(_sse(f"{kind}.partial_image", event | {"partial_image_index": output.partial_image_index}))
            continue
        event["metrics"] = _run_metrics(output)
        if log_probs[i] is not None:
            event["log_probs"] = log_probs[i]
        events.append(_sse(f"{kind}.completed", event))
    return events


def _run_metrics(output: OmniRequestOutput) -> dict[str, Any]:
    """What a completed event tells of the run: its batch, seed, and time queued and executing."""
    ran = output.metrics
    assert ran is not None, "a finished output has its metrics"
    return {
        "batch_size": ran.batch_size,
        "seed": ran.seed,
        "queue_ms": round(ran.queue_ms, 3),
        "exec_ms": round(ran.exec_ms, 3),
    }


def _error_event(status: int, message: str, param: str | None = None, code: str | None = None) -> str:
    """A failure once the stream has begun (its status is sent already): an ``error`` event with the envelope."""
    return _sse("error", {"error": error_info(status, message, param, code).model_dump()})


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, separators=(',', ':'))}\n\n"
