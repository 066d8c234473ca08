"""What the server serves, as vLLM's ``serving_models`` owns it: ``GET /v1/models`` (the served model names and the
LoRA adapters), and vLLM's runtime LoRA routes ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``,
served only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as in vLLM. All behind the API key (docs/lora.md)."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from vllm_omni.entrypoints.openai.checks import check_api_key
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import (
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelEntry,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.errors import LoraLoadError, UnknownLoraError

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    """vLLM's switch for the routes: ``1`` or ``true`` (any case)."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def _ready(raw_request: Request) -> ServerState:
    state: ServerState = raw_request.app.state.server
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    return state


async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw_request: Request) -> PlainTextResponse:
    """Every replica loads the adapter and checks it before the route answers; then requests may select it."""
    state = _ready(raw_request)
    if body.load_inplace:
        raise APIError(
            400,
            "load_inplace is not supported: unload the adapter, then load it again",
            param="load_inplace",
            code="invalid_value",
        )
    try:
        await state.loaded_omni.add_lora(body.lora_name, body.lora_path)
    except LoraLoadError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_value") from None
    except ValueError as exc:  # the name is taken, or LoRA is off
        raise APIError(400, str(exc), param="lora_name", code="invalid_value") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw_request: Request) -> PlainTextResponse:
    """Requests may no longer select the adapter; those accepted with it still run with it."""
    state = _ready(raw_request)
    try:
        await state.loaded_omni.remove_lora(body.lora_name)
    except UnknownLoraError as exc:
        raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def list_models(raw_request: Request) -> ModelList:
    state: ServerState = raw_request.app.state.server
    base = state.serving.served_model_names[0]
    models = [
        ModelEntry(id=name, created=state.loaded_at, root=state.source.model)
        for name in state.serving.served_model_names
    ]
    adapters = [
        ModelEntry(id=m.name, created=state.loaded_at, root=m.path, parent=m.base_model_name or base)
        for m in state.lora_adapters().values()
    ]
    return ModelList(data=models + adapters)


def build_models_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key)])
    router.add_api_route("/v1/models", list_models, methods=["GET"])
    if not runtime_updating_allowed():
        return router
    responses: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
    for path, endpoint in (
        ("/v1/load_lora_adapter", load_lora_adapter),
        ("/v1/unload_lora_adapter", unload_lora_adapter),
    ):
        router.add_api_route(path, endpoint, methods=["POST"], response_class=PlainTextResponse, responses=responses)
    return router
