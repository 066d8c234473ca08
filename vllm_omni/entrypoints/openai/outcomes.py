"""How a generation request is counted by outcome, the same way on every API (images, videos, audio, speech): one
`Outcome` per request, counted once when its handling ends however it ends; `next_output`, the engine's next output
or the outcome and answer of a request that did not give one (`failure` for one that failed in the engine); and
`counting_invalid`, the route class that counts a body that does not fit the request's shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import Counter

from vllm_omni.entrypoints.openai.admission import refusal_outcome
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected, until_disconnect
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.errors import NonFiniteOutputError, RequestFailedError, StageUnavailableError

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.outputs import OmniRequestOutput


def failure(exc: RequestFailedError, state: ServerState) -> tuple[str, APIError]:
    """How a request that failed in the engine is counted, and answered (a 422 for an output that is not finite:
    its parameters made no image)."""
    if isinstance(exc, NonFiniteOutputError):
        return "failed", APIError(422, str(exc), code="non_finite_output")
    unavailable = isinstance(exc, StageUnavailableError) or state.unavailable_reason() is not None
    error = APIError(
        503 if unavailable else 500,
        str(exc),
        code="service_unavailable" if isinstance(exc, StageUnavailableError) else "generation_failed",
    )
    return ("unavailable" if unavailable else "failed"), error


class Outcome:
    """One request's outcome in its API's ``counter`` (``vllm_omni:<api>_generation_requests_total{outcome}``),
    counted once, when the ``with`` block that handles the request ends, however it ends:

    - ``invalid`` until `running`, or ``overloaded`` / ``unavailable`` for a 429 / 503 refusal (`refusal_outcome`),
      ``failed`` for an error that is not a refusal (an `APIError`);
    - ``failed`` once `running` (an error from then on is the server's), or what `next_output` found;
    - ``aborted`` (``aborted``: the API's name for it, ``cancelled`` for the Videos API) when the task is cancelled
      (the server cancelled the handler) or the client went away, a stream's body included;
    - ``completed`` (`completed`);
    - nothing, once `handed_over` to the stream that answers the request (it counts with an `Outcome` of its own)."""

    def __init__(self, counter: Counter, *, value: str = "invalid", aborted: str = "aborted"):
        self.counter = counter
        self.value: str | None = value
        self.aborted = aborted

    def running(self) -> None:
        """The request was admitted: from now on an error fails it."""
        self.value = "failed"

    def completed(self) -> None:
        self.value = "completed"

    def handed_over(self) -> None:
        """Its stream counts it when the stream ends."""
        self.value = None

    def __enter__(self) -> Outcome:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # Cancelled: the server cancelled the handler, or the client went away while a stream's body was being
        # made; GeneratorExit: a stream's body closed before its end (its client went away while it was sent).
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            self.value = self.aborted
        elif isinstance(exc, APIError) and self.value == "invalid":
            self.value = refusal_outcome(exc)
        elif exc is not None and self.value == "invalid":  # not a refusal: the server's own error
            self.value = "failed"
        if self.value is not None:
            self.counter.labels(self.value).inc()


async def next_output(
    raw_request: Request, generation: AsyncGenerator[OmniRequestOutput, None], outcome: Outcome
) -> OmniRequestOutput:
    """The request's next output (a preview, a chunk, or the finished output), with ``outcome`` set where there is
    none: `ClientDisconnected` when the client went away first (the request is aborted, its slot freed), an
    `APIError` when the request failed in the engine (`failure`) or was aborted (503 ``aborted``)."""
    state: ServerState = raw_request.app.state.server
    try:
        output = await until_disconnect(raw_request, anext(generation, None))
    except ClientDisconnected:
        outcome.value = outcome.aborted
        raise
    except RequestFailedError as exc:
        outcome.value, error = failure(exc, state)
        raise error from None
    if output is None:
        outcome.value = outcome.aborted
        raise APIError(503, "The request was aborted", code="aborted")
    return output


def counting_invalid(counter: Counter) -> type[APIRoute]:
    """A route class that counts a body that does not fit its request model (FastAPI's schema validation, before the
    handler runs) as an ``invalid`` request in ``counter``; the app's handler answers it."""

    class _CountingInvalid(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def counted(request: Request) -> Response:
                try:
                    return await handler(request)
                except RequestValidationError:
                    counter.labels("invalid").inc()
                    raise

            return counted

    return _CountingInvalid
