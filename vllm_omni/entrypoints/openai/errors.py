"""OpenAI's error envelope: `APIError`, `error_response`, and the app's exception handlers."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

STATUS_TYPE = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
"""The envelope's ``type`` by HTTP status; any other status is a ``server_error``."""

HTTP_ERROR_CODE = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    """An answer in OpenAI's error envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_info(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorInfo:
    """The envelope's ``error`` of an answer with ``status``."""
    return ErrorInfo(message=message, type=STATUS_TYPE.get(status, "server_error"), param=param, code=code)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    error = error_info(status, message, param, code)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(ErrorResponse(error=error).model_dump(), status_code=status, headers=headers)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    """A request that does not fit its route's shape, as a 400 naming the first offending field."""
    error = exc.errors()[0]
    location = [str(p) for p in error.get("loc", ()) if p != "body"]
    if error.get("type") == "json_invalid":
        return error_response(400, "The request body is not valid JSON", code="invalid_json")
    if error.get("type") == "extra_forbidden":  # param: the request field, also for a key inside one (lora)
        inside = f" (in {location[0]})" if len(location) > 1 else ""
        message = f"Unrecognized request argument supplied: {location[-1]}{inside}"
        return error_response(400, message, location[0], code="unknown_parameter")
    param = location[0] if location else None
    reason = error["ctx"]["error"] if error.get("type") == "value_error" else error["msg"]
    if param is None:
        return error_response(400, f"The request body must be a JSON object: {reason}", code="invalid_request")
    code = "missing_required_parameter" if error.get("type") == "missing" else "invalid_value"
    return error_response(400, f"{param}: {reason}", param, code=code)


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers, in the envelope. Each API counts its own invalid requests (not here)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405 and not _is_route(request):
            # Starlette answers 405 when only a templated route matched (POST /v1/videos/x matches GET
            # /v1/videos/{video_id}); there is no such route, so 404 says so.
            return error_response(404, f"No route {request.method} {request.url.path}", code="not_found")
        return error_response(exc.status_code, str(exc.detail), code=HTTP_ERROR_CODE.get(exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return error_response(500, f"Internal server error: {type(exc).__name__}")


def _is_route(request: Request) -> bool:
    """Whether the request's path is one of the app's own paths as written (not only a template's match)."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    path = path[len(root) :] if root and path.startswith(root) else path
    return any(getattr(route, "path", None) == path for route in request.app.routes)
