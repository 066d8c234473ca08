"""vLLM's sleep-mode routes (docs/rl.md, "Sleep and wake"): ``POST /sleep``, ``POST /wake_up`` and ``GET
/is_sleeping``, answered as vLLM's own. As vLLM's api_server does, the app serves them only in development mode
(``VLLM_SERVER_DEV_MODE=1``); here also behind the API key."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai.checks import check_api_key, check_query
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import ErrorResponse
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.errors import SleepModeError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def dev_mode() -> bool:
    """vLLM's switch, read as ``vllm.envs`` reads it: an integer, true when not 0."""
    return bool(int(os.environ.get(DEV_MODE_ENV, "0")))


def _ready(raw_request: Request) -> ServerState:
    state: ServerState = raw_request.app.state.server
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    return state


def _bad(error: SleepModeError) -> APIError:
    """The engines' refusal of a level or tags (`AsyncOmni.sleep` and ``wake_up`` check them), as a 400 naming it."""
    return APIError(400, str(error), param=error.param, code="invalid_value")


async def _level(raw_request: Request, query: str | None) -> Any:
    """The ``level`` of the query, else of a JSON body (``{"level": 2}``, a JSON number), else 1; as the client
    wrote it, for `AsyncOmni.sleep` to check."""
    level: Any = 1
    if query is not None:
        level = int(query) if query.strip().lstrip("-").isdigit() else query
    body = await raw_request.body()
    if query is None and body.strip():
        try:
            fields = json.loads(body)
        except ValueError:
            raise APIError(400, "The request body is not valid JSON", code="invalid_json") from None
        if not isinstance(fields, dict):
            raise APIError(400, 'The request body must be a JSON object: {"level": 1}', code="invalid_request")
        extra = sorted(set(fields) - {"level"})
        if extra:
            message = f"Unrecognized request argument supplied: {extra[0]}"
            raise APIError(400, message, param=extra[0], code="unknown_parameter")
        level = fields.get("level", 1)
    return level


async def sleep(raw_request: Request, level: Annotated[str | None, Query()] = None) -> JSONResponse:
    """Every replica finishes its running batch and sleeps; requests that arrive meanwhile wait for ``/wake_up``."""
    state = _ready(raw_request)
    value = await _level(raw_request, level)
    try:
        await state.loaded_omni.sleep(value)
    except SleepModeError as exc:  # not one of vLLM's levels, or level 2 on a stage that cannot drop its weights
        raise _bad(exc) from None
    return JSONResponse({"status": "sleeping", "level": value})


async def wake_up(raw_request: Request, tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
    """Wake the memory of ``tags`` (repeated: ``?tags=weights&tags=kv_cache``; none: all)."""
    state = _ready(raw_request)
    tags = tags or None
    try:
        await state.loaded_omni.wake_up(tags)
    except SleepModeError as exc:  # not among vLLM's tags
        raise _bad(exc) from None
    return JSONResponse({"status": "sleeping" if await state.loaded_omni.is_sleeping() else "awake", "tags": tags})


async def is_sleeping(raw_request: Request) -> JSONResponse:
    state = _ready(raw_request)
    return JSONResponse({"is_sleeping": await state.loaded_omni.is_sleeping()})


def build_sleep_router() -> APIRouter:
    """The routes, for `build_app` to include in development mode only."""
    logger.warning(
        "%s=1: serving the development routes POST /sleep, POST /wake_up and GET /is_sleeping; not for production",
        DEV_MODE_ENV,
    )
    router = APIRouter(dependencies=[Depends(check_api_key), Depends(check_query)])
    responses: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 503)}
    router.add_api_route("/sleep", sleep, methods=["POST"], responses=responses)
    router.add_api_route("/wake_up", wake_up, methods=["POST"], responses=responses)
    router.add_api_route("/is_sleeping", is_sleeping, methods=["GET"], responses=responses)
    return router
