"""vLLM's profiler routes (docs/observability.md, "Profiling"): ``POST /start_profile`` and ``POST /stop_profile``,
served only when ``--profiler-config`` turns profiling on (as vLLM's api_server does; otherwise 404), behind the API
key. Between them the torch profiler records every engine process; ``/stop_profile`` answers once each process's
trace file is written, and lists them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from vllm_omni.entrypoints.openai.checks import check_api_key, check_query
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import ErrorResponse
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.errors import ProfilerStateError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class StartProfileRequest(BaseModel):
    """The optional body of ``POST /start_profile``: of vLLM's fields, ``profile_prefix`` (its iteration bounds and
    ``profiler_kwargs`` are refused, by name)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    profile_prefix: str | None = None
    """Begins each trace file's name (1-128 characters: letters, digits, ``.``, ``_``, ``-``)."""


def _ready(raw_request: Request) -> ServerState:
    state: ServerState = raw_request.app.state.server
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    return state


async def start_profile(raw_request: Request, body: StartProfileRequest | None = None) -> JSONResponse:
    """Start recording; answers once every engine process records (409 while a profile records already)."""
    state = _ready(raw_request)
    prefix = body.profile_prefix if body is not None else None
    try:
        await state.loaded_omni.start_profile(prefix)
    except ProfilerStateError as exc:
        raise APIError(409, str(exc), code="profiler_active") from None
    except ValueError as exc:  # vLLM's check of the prefix
        raise APIError(400, str(exc), param="profile_prefix", code="invalid_value") from None
    logger.info("Profiler started")
    return JSONResponse({"status": "profiling"})


async def stop_profile(raw_request: Request) -> JSONResponse:
    """Stop recording; answers once every trace file is written, with their paths (409 when none records)."""
    state = _ready(raw_request)
    try:
        traces = await state.loaded_omni.stop_profile()
    except ProfilerStateError as exc:
        raise APIError(409, str(exc), code="profiler_not_active") from None
    logger.info("Profiler stopped; traces: %s", ", ".join(traces))
    return JSONResponse({"status": "stopped", "traces": traces})


def build_profile_router() -> APIRouter:
    """The routes, for `build_app` to include when profiling is on."""
    logger.warning("Profiling is on: serving POST /start_profile and POST /stop_profile; not for production")
    router = APIRouter(dependencies=[Depends(check_api_key), Depends(check_query)])
    responses: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 409, 503)}
    router.add_api_route("/start_profile", start_profile, methods=["POST"], responses=responses)
    router.add_api_route("/stop_profile", stop_profile, methods=["POST"], responses=responses)
    return router
