"""The OpenAI-compatible HTTP server: Images API, models, health and metrics (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.config import StageDeployConfig
from vllm_omni.config.serving import ServingConfig
from vllm_omni.diffusion.request import (
    OmniDiffusionSamplingParams,
    RequestFailedError,
    StageUnavailableError,
)
from vllm_omni.engine.replica import warm_up_params
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.openai.checks import APIError, check_api_key, check_request, complete_params, error_response
from vllm_omni.entrypoints.openai.image_store import ImageStore
from vllm_omni.entrypoints.openai.protocol import (
    ErrorResponse,
    ImageData,
    ImageGenerationRequest,
    ImageGenerationResponse,
    ModelCard,
    ModelList,
)
from vllm_omni.entrypoints.openai.videos import VideoJobs, build_videos_router
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics

logger = init_logger(__name__)

_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# Sampling-parameter names as the Images API calls them.



class BodyLimitMiddleware:
    """Answer 413 as soon as a request body is larger than the limit, declared or streamed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (
            not declared.isdigit() or int(declared) > self.max_bytes
        ):
            return await self._reject(send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if (
                received > self.max_bytes
            ):  # a chunked body: FastAPI passes this on to the 413 handler
                raise StarletteHTTPException(413, self.message)
            return message

        await self.app(scope, limited_receive, send)

    @property
    def message(self) -> str:
        return f"The request body is larger than {self.max_bytes} bytes"

    async def _reject(self, send) -> None:
        response = error_response(413, self.message, code="request_too_large")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": response.raw_headers,
            }
        )
        await send({"type": "http.response.body", "body": response.body})








@dataclass
class ServerState:
    model: str
    stage_configs: list[StageDeployConfig]
    serving: ServingConfig
    store: ImageStore
    videos: VideoJobs
    on_fatal: Callable[[BaseException], None]
    omni: AsyncOmni | None = None
    ready: bool = False
    draining: bool = False
    loaded_at: int = field(default_factory=lambda: int(time.time()))

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.omni is None or not self.ready:
            return "the model is loading"
        down = [h.stage_id for h in self.omni.engine.health() if h.status == "down"]
        if down:
            return f"no replica of stage {', '.join(map(str, down))} is alive; see the server log"
        return None


async def _drain(generation) -> None:
    async for _ in generation:
        pass


async def _load_and_warm_up(state: ServerState) -> None:
    try:
        state.omni = await asyncio.to_thread(
            AsyncOmni.from_stage_configs, state.model, state.stage_configs
        )
        for stage in state.stage_configs:
            metrics.stage_max_num_seqs.labels(
                str(stage.stage_id), stage.provenance["max_num_seqs"]
            ).set(stage.max_num_seqs)
        started = time.perf_counter()
        warm_up = warm_up_params(state.omni.engine.makes_videos)
        # One request per replica of the widest stage: routing sends each to the replica with the fewest
        # outstanding requests, and each passes every stage of a split pipeline.
        await asyncio.gather(
            *(
                _drain(state.omni.generate("warm-up", warm_up, request_id=f"warmup-{uuid.uuid4().hex}"))
                for _ in range(max(stage.stage_config.num_replicas for stage in state.omni.engine.stages))
            )
        )
        state.ready = True
        logger.info(
            "Warm-up done in %.2f s; ready to serve %s",
            time.perf_counter() - started,
            state.model,
        )
    except Exception as exc:  # noqa: BLE001 - the server cannot serve without its model
        logger.exception("Could not load and warm up %s", state.model)
        state.on_fatal(exc)





def _encode(image, output_format: str, compression: int | None) -> bytes:
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        quality = 100 if compression is None else compression
        image.convert("RGB").save(buffer, format=output_format.upper(), quality=quality)
    return buffer.getvalue()


class ClientDisconnected(Exception):
    pass


async def _until_disconnect(request: Request, work: asyncio.Task) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its request)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait(
            {work, watcher}, return_when=asyncio.FIRST_COMPLETED
        )
    except (
        asyncio.CancelledError
    ):  # the server cancels us (shutdown timeout): abort the request too
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise ClientDisconnected


def _validate(body: ImageGenerationRequest, state: ServerState) -> OmniDiffusionSamplingParams:
    """The request as complete sampling parameters (model defaults filled in), within the operator's limits."""
    check_request(state, body, kind="image")
    if body.output_compression is not None and body.output_format == "png":
        raise APIError(
            400, "output_compression applies to jpeg and webp only", param="output_compression", code="invalid_value"
        )
    width, height = body.dimensions() or (None, None)
    return complete_params(
        state,
        height=height,
        width=width,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        num_outputs_per_prompt=body.n,
        seed=body.seed,
        negative_prompt=body.negative_prompt,
    )


async def create_image(
    body: ImageGenerationRequest, raw_request: Request
) -> ImageGenerationResponse | Response:
    state: ServerState = raw_request.app.state.server
    outcome = "failed"
    try:
        try:
            # Completing the parameters may ask a replica (a Ray call): off the event loop.
            params = await asyncio.to_thread(_validate, body, state)
        except APIError as exc:
            outcome = "unavailable" if exc.status == 503 else "invalid"
            raise
        omni = state.omni
        if omni.engine.num_waiting >= state.serving.max_waiting_requests:
            outcome = "overloaded"
            raise APIError(
                429, f"Too many requests waiting ({state.serving.max_waiting_requests}); retry later",
                code="too_many_waiting_requests",
            )  # fmt: skip
        generation = omni.generate(
            body.prompt, params, request_id=f"img-{uuid.uuid4().hex}"
        )
        try:
            output = await _until_disconnect(
                raw_request, asyncio.ensure_future(anext(generation, None))
            )
        except ClientDisconnected:
            outcome = "aborted"
            return Response(
                status_code=499
            )  # nobody reads it; the request was aborted and its slot freed
        except asyncio.CancelledError:
            outcome = "aborted"
            raise
        except RequestFailedError as exc:
            unavailable = isinstance(exc, StageUnavailableError) or state.unavailable_reason() is not None
            outcome = "unavailable" if unavailable else "failed"
            raise APIError(
                503 if unavailable else 500, str(exc),
                code="service_unavailable" if isinstance(exc, StageUnavailableError) else "generation_failed",
            ) from None  # fmt: skip
        if output is None:
            outcome = "aborted"
            raise APIError(503, "The request was aborted", code="aborted")

        encoded = await asyncio.to_thread(
            lambda: [
                _encode(image, body.output_format, body.output_compression)
                for image in output.images
            ]
        )
        data = []
        for payload in encoded:
            if body.response_format == "b64_json":
                data.append(
                    ImageData(
                        b64_json=base64.b64encode(payload).decode(),
                        revised_prompt=body.prompt,
                    )
                )
                continue
            image_id = state.store.put(payload, _MEDIA_TYPES[body.output_format])
            if image_id is None:
                raise APIError(
                    500,
                    "The image is larger than the image store; use response_format=b64_json",
                )
            url = str(raw_request.url_for("get_image", image_id=image_id))
            data.append(ImageData(url=url, revised_prompt=body.prompt))
        outcome = "completed"
        first_image = output.images[0]
        return ImageGenerationResponse(
            data=data,
            output_format=body.output_format,
            size=f"{first_image.width}x{first_image.height}",
        )
    finally:
        metrics.image_requests.labels(outcome).inc()


def build_app(
    model: str,
    stage_configs: list[StageDeployConfig],
    serving: ServingConfig,
    on_fatal: Callable[[BaseException], None],
) -> FastAPI:
    """The app; the model loads in the background once it starts, and ``/health`` turns 200 when it is warm."""
    state = ServerState(
        model=model,
        stage_configs=stage_configs,
        serving=serving,
        store=ImageStore(serving.image_url_ttl_s, serving.image_store_max_bytes),
        videos=VideoJobs(serving.video_ttl_s, serving.video_store_max_bytes),
        on_fatal=on_fatal,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load_and_warm_up(state))
        yield
        state.draining = True
        await loading
        state.videos.cancel_all()
        if state.omni is not None:
            await asyncio.to_thread(state.omni.shutdown)

    app = FastAPI(title="vllm-omni", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=serving.max_request_body_bytes)
    if serving.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=serving.allowed_origins,
            allow_methods=serving.allowed_methods,
            allow_headers=serving.allowed_headers,
            allow_credentials=serving.allow_credentials,
        )

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.image_requests.labels("invalid").inc()
        error = exc.errors()[0]
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            return error_response(
                400, "The request body is not valid JSON", code="invalid_json"
            )
        if error.get("type") == "extra_forbidden":
            return error_response(
                400,
                f"Unrecognized request argument supplied: {location[-1]}",
                location[-1],
                code="unknown_parameter",
            )
        param = location[0] if location else None
        reason = (
            error["ctx"]["error"]
            if error.get("type") == "value_error"
            else error["msg"]
        )
        if param is None:
            return error_response(
                400,
                f"The request body must be a JSON object: {reason}",
                code="invalid_request",
            )
        code = (
            "missing_required_parameter"
            if error.get("type") == "missing"
            else "invalid_value"
        )
        return error_response(400, f"{param}: {reason}", param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {
            404: "not_found",
            405: "method_not_allowed",
            413: "request_too_large",
        }.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error")
        return error_response(500, f"Internal server error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> Response:
        """200 while every stage has a live replica (``status`` says ``degraded`` when some are down), else 503."""
        reason = state.unavailable_reason()
        if reason is not None:
            return error_response(
                503, f"Service unavailable: {reason}", code="service_unavailable"
            )
        stages = [
            {"stage_id": h.stage_id, "status": h.status, "num_replicas": h.num_replicas, "alive_replicas": h.alive}
            for h in state.omni.engine.health()
        ]
        status = "ok" if all(s["status"] == "ok" for s in stages) else "degraded"
        return JSONResponse({"status": status, "stages": stages})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/images/files/{image_id}", name="get_image")
    async def get_image(image_id: str) -> Response:
        # An in-memory map lookup: no path is ever built from image_id, so nothing outside the store is reachable.
        stored = state.store.get(image_id)
        if stored is None:
            raise APIError(
                404, "No such image, or it has expired", code="image_not_found"
            )
        return Response(stored.data, media_type=stored.media_type)

    @v1.get("/models")
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, created=state.loaded_at, root=model)
                for name in serving.served_model_names
            ]
        )

    v1.add_api_route(
        "/images/generations",
        create_image,
        methods=["POST"],
        response_model=ImageGenerationResponse,
        response_model_exclude_none=True,
        responses={
            code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 500, 503)
        },
    )
    app.include_router(v1)
    app.include_router(build_videos_router())
    return app


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.state.draining = (
            True  # /health and new requests answer 503 while running requests finish
        )
        if sig == signal.SIGTERM:
            # An orderly stop: drain and exit 0 (uvicorn would re-raise the signal after draining).
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def run_server(
    model: str, stage_configs: list[StageDeployConfig], serving: ServingConfig
) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    failure: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    app = build_app(model, stage_configs, serving, on_fatal)
    config = uvicorn.Config(
        app,
        host=serving.host,
        port=serving.port,
        log_level=serving.uvicorn_log_level,
        access_log=serving.access_log,
        ssl_keyfile=serving.ssl_keyfile,
        ssl_certfile=serving.ssl_certfile,
        root_path=serving.root_path,
        timeout_graceful_shutdown=serving.shutdown_timeout_s,
    )
    server = _Server(config, app.state.server)
    logger.info(
        "Serving %s as %s on %s:%d",
        model,
        serving.served_model_names,
        serving.host or "0.0.0.0",
        serving.port,
    )
    server.run()
    return 1 if failure else 0
