"""The FastAPI app: its state, middleware, error handlers and routers; the model loads once the app starts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.config import StageDeployConfig
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.profiler import profiling
from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.admin.health import build_health_router
from vllm_omni.entrypoints.openai.admin.models import build_models_router
from vllm_omni.entrypoints.openai.admin.playground import build_playground_router
from vllm_omni.entrypoints.openai.admin.profile import build_profile_router
from vllm_omni.entrypoints.openai.admin.sleep import build_sleep_router, dev_mode
from vllm_omni.entrypoints.openai.admission import WARNING
from vllm_omni.entrypoints.openai.audio.api_router import build_audio_router
from vllm_omni.entrypoints.openai.chat.api_router import build_chat_router
from vllm_omni.entrypoints.openai.errors import add_error_handlers, error_response
from vllm_omni.entrypoints.openai.images.api_router import build_images_router
from vllm_omni.entrypoints.openai.server_state import ServerState, load_and_warm_up
from vllm_omni.entrypoints.openai.uploads import UPLOAD_PATHS, upload_body_limit
from vllm_omni.entrypoints.openai.videos.api_router import build_videos_router


class BodyLimitMiddleware:
    """Answer 413 as soon as a request body is larger than the limit, declared or streamed; routes that take image
    files (`UPLOAD_PATHS`) have a larger one."""

    def __init__(self, app, max_bytes: int, upload_max_bytes: int):
        self.app, self.max_bytes, self.upload_max_bytes = app, max_bytes, upload_max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        limit = self.upload_max_bytes if path in UPLOAD_PATHS else self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._reject(send, limit)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # a chunked body: FastAPI passes this on to the 413 handler
                raise StarletteHTTPException(413, _too_large(limit))
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, send, limit: int) -> None:
        response = error_response(413, _too_large(limit), code="request_too_large")
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


class WarningHeaderMiddleware:
    """Adds the ``Warning`` header that a route left in the request's scope (`admission.WARNING`: the fields the
    model would not use) to its answer as the answer starts, so that a streamed answer carries it too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_warning(message):
            if message["type"] == "http.response.start" and WARNING in scope:
                warning = (b"warning", scope[WARNING].encode("latin-1", "replace"))
                message = {**message, "headers": [*message.get("headers", ()), warning]}
            await send(message)

        await self.app(scope, receive, send_with_warning)


def _too_large(limit: int) -> str:
    return f"The request body is larger than {limit} bytes"


def build_app(
    source: ModelSource | str,
    stage_configs: list[StageDeployConfig],
    serving: ServingConfig,
    on_fatal: Callable[[BaseException], None],
) -> FastAPI:
    """The app; the model loads (and downloads, for a repo id) in the background once it starts, and ``/health``
    turns 200 when it is warm."""
    state = ServerState.create(source, stage_configs, serving, on_fatal)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(load_and_warm_up(state))
        yield
        state.draining = True
        await loading
        state.videos.cancel_all()
        if state.omni is not None:
            await asyncio.to_thread(state.omni.shutdown)
        if state.tracer is not None:  # the spans still queued go out first
            await asyncio.to_thread(state.tracer.shutdown)

    app = FastAPI(title="vllm-omni", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(WarningHeaderMiddleware)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=serving.max_request_body_bytes, upload_max_bytes=upload_body_limit(serving)
    )
    if serving.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=serving.allowed_origins,
            allow_methods=serving.allowed_methods,
            allow_headers=serving.allowed_headers,
            allow_credentials=serving.allow_credentials,
        )
    add_error_handlers(app)
    app.include_router(build_health_router())
    app.include_router(build_models_router())
    if dev_mode():  # vLLM's development routes, as its api_server serves them
        app.include_router(build_sleep_router())
    if profiling(serving.profiler_config):  # vLLM's profiler routes, only when --profiler-config turns them on
        app.include_router(build_profile_router())
    app.include_router(build_images_router())
    app.include_router(build_videos_router())
    app.include_router(build_audio_router())
    app.include_router(build_chat_router())
    if not serving.disable_playground:
        app.include_router(build_playground_router())
    return app
