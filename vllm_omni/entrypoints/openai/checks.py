"""Checks shared by the Images and Videos routes: the API key, the operator's limits, and the error envelope."""

from __future__ import annotations

import secrets

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from vllm_omni.config.serving import ServingConfig
from vllm_omni.diffusion.request import OmniDiffusionSamplingParams, SamplingParamsError, StageUnavailableError
from vllm_omni.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

# Sampling-parameter names as the OpenAI APIs call them.
API_PARAM = {"height": "size", "width": "size", "num_outputs_per_prompt": "n"}
STATUS_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip


class APIError(Exception):
    """An answer in OpenAI's error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    error = ErrorInfo(
        message=message,
        type=STATUS_TYPE.get(status, "server_error"),
        param=param,
        code=code,
    )
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(
        ErrorResponse(error=error).model_dump(), status_code=status, headers=headers
    )


async def check_api_key(request: Request) -> None:
    # async: FastAPI would run a plain function in its thread pool, a thread hop per request
    api_keys = request.app.state.server.serving.api_keys
    if not api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Compare with every key, always, so the time taken does not tell which key came close.
    matches = [secrets.compare_digest(token.encode(), key.encode()) for key in api_keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


def check_limits(params: OmniDiffusionSamplingParams, serving: ServingConfig) -> None:
    """The operator's size and step limits, applied to complete parameters (the model's defaults included)."""
    if params.width * params.height > serving.max_image_pixels:
        raise APIError(
            400, f"size {params.width}x{params.height} exceeds the limit of {serving.max_image_pixels} pixels",
            param="size", code="invalid_value",
        )  # fmt: skip
    if params.num_inference_steps > serving.max_inference_steps:
        raise APIError(
            400, f"num_inference_steps={params.num_inference_steps} is above the limit of {serving.max_inference_steps}",
            param="num_inference_steps", code="invalid_value",
        )  # fmt: skip


def check_request(state, body, *, kind: str) -> None:
    """What every generation request must pass before its parameters are built: a served model name,
    prompts within the length limit, a ready engine, and a model of the right ``kind`` (image or video)."""
    serving = state.serving
    if body.model is not None and body.model not in serving.served_model_names:
        raise APIError(
            404, f"The model '{body.model}' does not exist; this server serves {serving.served_model_names[0]!r}",
            param="model", code="model_not_found",
        )  # fmt: skip
    for name in ("prompt", "negative_prompt"):
        text = getattr(body, name)
        if text is not None and len(text) > serving.max_prompt_length:
            raise APIError(
                400, f"{name} is longer than {serving.max_prompt_length} characters", param=name, code="invalid_value"
            )
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    model_kind = "video" if state.omni.engine.makes_videos else "image"
    if model_kind != kind:
        raise APIError(
            400, f"{serving.served_model_names[0]} is a{'n' if model_kind == 'image' else ''} {model_kind} model; "
            f"this API serves {kind} models only", param="model", code="model_not_supported",
        )  # fmt: skip


def complete_params(state, **fields) -> OmniDiffusionSamplingParams:
    """Sampling parameters with the model's defaults filled in (``size: auto``, default steps...), then the
    operator's limits; every problem is a 400 naming the API field."""
    try:
        params = state.omni.engine.complete_params(OmniDiffusionSamplingParams(**fields))
    except ValidationError as exc:  # beyond what any model accepts, e.g. a side over 16384 px
        error = exc.errors()[0]
        param = API_PARAM.get(str(error["loc"][0]), str(error["loc"][0]))
        raise APIError(400, f"{param}: {error['msg']}", param=param, code="invalid_value") from None
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=API_PARAM.get(exc.param, exc.param), code="invalid_value") from None
    except StageUnavailableError as exc:
        raise APIError(503, f"Service unavailable: {exc}", code="service_unavailable") from None
    check_limits(params, state.serving)
    return params
