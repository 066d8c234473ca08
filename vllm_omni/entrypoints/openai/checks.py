"""Checks shared by the Images and Videos routes: the API key, the request, and the operator's limits."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.protocol import api_names, sampling_fields
from vllm_omni.errors import SamplingParamsError, StageUnavailableError, UnknownLoraError
from vllm_omni.sampling_params import ImageTask, OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.engine.omni_engine import AdmittedParams
    from vllm_omni.entrypoints.openai.server_state import ServerState

API_PARAM = {"height": "size", "width": "size", "mask_image": "mask"}
"""The API field each of these sampling parameters is computed from by the routes, which an error about it names (a
request field copied under another name is named by its `Sampling`: `api_names`)."""


async def check_api_key(request: Request) -> None:
    # async: FastAPI would run a plain function in its thread pool, a thread hop per request
    api_keys = request.app.state.server.serving.api_keys
    if not api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Compare with every key, always, so the time taken does not tell which key came close.
    matches = [secrets.compare_digest(token.encode(), key.encode()) for key in api_keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


async def check_query(request: Request) -> None:
    """A query parameter the route does not declare is refused, as an unknown body field is."""
    route = request.scope.get("route")
    known = {param.alias for param in route.dependant.query_params} if route is not None else set()
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise APIError(
            400,
            f"Unrecognized query parameter: {unknown[0]} ({request.method} {route.path} {takes})",
            param=unknown[0],
            code="unknown_parameter",
        )


def check_limits(params: OmniDiffusionSamplingParams, serving: ServingConfig) -> None:
    """The operator's size and step limits, applied to complete parameters (the model's defaults included)."""
    if params.width * params.height > serving.max_image_pixels:
        raise APIError(
            400,
            f"size {params.width}x{params.height} exceeds the limit of {serving.max_image_pixels} pixels",
            param="size",
            code="invalid_value",
        )
    if params.num_inference_steps > serving.max_inference_steps:
        raise APIError(
            400,
            f"num_inference_steps={params.num_inference_steps} is above the limit of {serving.max_inference_steps}",
            param="num_inference_steps",
            code="invalid_value",
        )


def check_request(state: ServerState, body, *, kind: str, task: ImageTask = "text") -> None:
    """What every generation request must pass before its parameters are built: a served model name,
    prompts within the length limit, a ready engine, and a model of the right ``kind`` (image or video) that serves
    ``task`` (``text``: no input image; ``image``: one or more)."""
    serving = state.serving
    adapters = state.lora_adapters()
    if body.model is not None and body.model not in serving.served_model_names and body.model not in adapters:
        also = f" and the LoRA adapters {', '.join(sorted(adapters))}" if adapters else ""
        raise APIError(
            404,
            f"The model '{body.model}' does not exist; this server serves {serving.served_model_names[0]!r}{also}",
            param="model",
            code="model_not_found",
        )
    for name in ("prompt", "negative_prompt"):
        text = getattr(body, name)
        if text is not None and len(text) > serving.max_prompt_length:
            raise APIError(
                400, f"{name} is longer than {serving.max_prompt_length} characters", param=name, code="invalid_value"
            )
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    model, card = serving.served_model_names[0], state.omni.model_card
    model_kind = "video" if card.is_video else "image"
    if model_kind != kind:
        article = "an" if model_kind == "image" else "a"
        why = f"{model} is {article} {model_kind} model; this API serves {kind} models only"
    elif task not in card.tasks:
        needs = "/v1/images/edits" if kind == "image" else "input_reference"
        why = f"{model} ({card.pipeline_name}) " + (
            "takes no input image" if task == "image" else f"needs an input image: use {needs}"
        )
    else:
        return
    raise APIError(400, why, param="model", code="model_not_supported")


def selected_adapters(state: ServerState, body) -> list[dict[str, float | str]]:
    """The request's LoRA adapters: its ``lora`` field, or the adapter its ``model`` names (vLLM's convention) at
    scale 1. With both, ``model`` is the base model or one of the adapters ``lora`` lists."""
    chosen = body.lora if isinstance(body.lora, list) else [body.lora] if body.lora is not None else []
    selection = [choice.model_dump() for choice in chosen]
    if body.model is None or body.model in state.serving.served_model_names:
        return selection
    if not selection:
        return [{"name": body.model, "scale": 1.0}]
    if body.model not in {choice["name"] for choice in selection}:
        raise APIError(
            400,
            f"model names the LoRA adapter '{body.model}' but lora does not list it: set model to the base model "
            f"{state.serving.served_model_names[0]!r}, or list '{body.model}' in lora",
            param="model",
            code="invalid_value",
        )
    return selection


def check_sides(size: str | None, width: Any, height: Any) -> None:
    """``width`` and ``height`` (upstream vllm-omni's way to give a size) come together, and not with ``size``."""
    sides = [name for name, value in (("width", width), ("height", height)) if value is not None]
    if size is not None and sides:
        raise APIError(
            400,
            f"give size or width and height, not both (got size and {' and '.join(sides)})",
            param=sides[0],
            code="invalid_value",
        )
    if len(sides) == 1:
        missing = "height" if sides == ["width"] else "width"
        raise APIError(400, f"{sides[0]} needs {missing} too (or give size)", param=missing, code="invalid_value")


def _api_param(body: BaseModel, name: str) -> str:
    """The request field that the sampling parameter (or ``extra_args`` key) ``name`` came from."""
    return api_names(type(body)).get(name) or API_PARAM.get(name, name)


def admit(state: ServerState, body: BaseModel, **computed) -> AdmittedParams:
    """The request's parameters completed once (the model's defaults filled in: ``size: auto``, default steps...,
    and a seed drawn), within the operator's limits; every problem is a 400 naming the API field, and a full queue
    a 429. The parameters are the request's `Sampling` fields (`sampling_fields`) and those its route ``computed``
    from other fields. It is local work (each stage admits from its model card; no replica is asked), so it runs on
    the event loop."""
    try:
        admitted = state.omni.admit(OmniDiffusionSamplingParams(**sampling_fields(body), **computed))
    except ValidationError as exc:  # beyond what any model accepts, e.g. a side over 16384 px
        error = exc.errors()[0]
        param = _api_param(body, str(error["loc"][0]))
        raise APIError(400, f"{param}: {error['msg']}", param=param, code="invalid_value") from None
    except UnknownLoraError as exc:
        raise APIError(404, str(exc), param="lora", code="model_not_found") from None
    except SamplingParamsError as exc:
        param = _api_param(body, exc.param.removeprefix("extra_args."))  # the extensions in extra_args
        raise APIError(400, str(exc), param=param, code="invalid_value") from None
    except StageUnavailableError as exc:
        raise APIError(503, f"Service unavailable: {exc}", code="service_unavailable") from None
    check_limits(admitted.params, state.serving)
    if state.omni.num_waiting >= state.serving.max_waiting_requests:
        raise APIError(
            429,
            f"Too many requests waiting ({state.serving.max_waiting_requests}); retry later",
            code="too_many_waiting_requests",
        )
    return admitted


def refusal_outcome(error: APIError) -> str:
    """How a generation request refused before it ran is counted: ``overloaded`` (429), ``unavailable`` (503) or
    ``invalid``."""
    return {429: "overloaded", 503: "unavailable"}.get(error.status, "invalid")
