"""Checks shared by the Images and Videos routes: the API key, the operator's limits, and the error envelope."""

from __future__ import annotations

import secrets

from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_omni.config.serving import ServingConfig
from vllm_omni.diffusion.request import OmniDiffusionSamplingParams
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
