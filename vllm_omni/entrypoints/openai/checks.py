"""Checks of a request before its parameters are built, shared by the generation routes: the API key, unknown query
parameters, the served model and its task, the prompts' length, how a size is given. Admission (`admission.py`)
comes after them."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from fastapi import Request

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.outputs import OutputKind
from vllm_omni.sampling_params import ImageTask

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState


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


def _path(route, request: Request) -> str:
    """The route's path template (``/v1/videos/{video_id}``); FastAPI routes every request that reaches a route."""
    return route.path if route is not None else request.url.path


async def check_query(request: Request) -> None:
    """A query parameter the route does not declare is refused, as an unknown body field is."""
    route = request.scope.get("route")
    known = {param.alias for param in route.dependant.query_params} if route is not None else set()
    unknown = [name for name in request.query_params if name not in known]
    if unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise APIError(
            400,
            f"Unrecognized query parameter: {unknown[0]} ({request.method} {_path(route, request)} {takes})",
            param=unknown[0],
            code="unknown_parameter",
        )


def check_request(state: ServerState, body, *, kind: OutputKind, task: ImageTask = "text") -> None:
    """What every generation request must pass before its parameters are built: a served model name,
    prompts within the length limit, and a ready engine serving a model of the right ``kind`` for ``task``
    (`check_serves`)."""
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
    # Speech's input has OpenAI's own limit (4,096 characters), in its request's schema.
    for name in ("prompt", "negative_prompt") if kind != "speech" else ():
        text = getattr(body, name, None)
        if text is not None and len(text) > serving.max_prompt_length:
            raise APIError(
                400, f"{name} is longer than {serving.max_prompt_length} characters", param=name, code="invalid_value"
            )
    check_serves(state, kind, task)


def check_serves(state: ServerState, kind: OutputKind, task: ImageTask = "text") -> None:
    """A ready engine (else 503) serving a model of the right ``kind`` (image, video, audio or speech: the
    facade's ``output_kind``) that serves ``task`` (``text``: no input image; ``image``: one or more; ``video``: an
    input video, a remix); else a 400 naming ``model``."""
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    model, model_kind = state.serving.served_model_names[0], state.loaded_omni.output_kind
    if model_kind != kind:
        article = "a" if model_kind in ("video", "speech") else "an"
        why = f"{model} is {article} {model_kind} model; this API serves {kind} models only"
        raise APIError(400, why, param="model", code="model_not_supported")
    if kind != "speech":  # a speech model's card has no tasks: it speaks text
        _check_task(model, state.loaded_omni.model_card, kind, task)


def _check_task(model: str, card: Any, kind: str, task: str) -> None:
    """The diffusion model's pipeline (its ``card``) runs the request's ``task``."""
    if task == "video" and task not in card.tasks:
        why = f"{model} ({card.pipeline_name}) has no video-to-video variant: it cannot remix a video"
    elif task not in card.tasks:
        needs = "/v1/images/edits" if kind == "image" else "input_reference"
        why = f"{model} ({card.pipeline_name}) " + (
            "takes no input image" if task == "image" else f"needs an input image: use {needs}"
        )
    else:
        return
    raise APIError(400, why, param="model", code="model_not_supported")


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
