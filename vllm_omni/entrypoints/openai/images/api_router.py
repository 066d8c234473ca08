"""OpenAI's Images API: ``POST /v1/images/generations``, ``POST /v1/images/edits`` and the ``url`` images they hand
out."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from PIL import Image
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.entrypoints.openai.admission import admit, report_ignored, selected_adapters
from vllm_omni.entrypoints.openai.checks import (
    check_api_key,
    check_query,
    check_request,
)
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.images.edit_form import FILE_FIELDS, edit_request_body, read_edit_form
from vllm_omni.entrypoints.openai.images.image_files import MEDIA_TYPES, encode_images, files_response
from vllm_omni.entrypoints.openai.images.image_stream import image_events
from vllm_omni.entrypoints.openai.images.image_usage import quality_steps, response_fields
from vllm_omni.entrypoints.openai.images.openai_models import openai_size, with_openai_defaults
from vllm_omni.entrypoints.openai.media import edit_references, is_json, read_json_object, read_references
from vllm_omni.entrypoints.openai.outcomes import Outcome, next_output
from vllm_omni.entrypoints.openai.protocol import (
    ErrorResponse,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageGenerationResponse,
)
from vllm_omni.entrypoints.openai.request_fields import ignored_fields
from vllm_omni.entrypoints.openai.rollout_fields import output_log_probs
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.entrypoints.openai.uploads import form_files, openai_mask, read_images
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.outputs import IgnoredField, OmniRequestOutput
from vllm_omni.sampling_params import MAX_INPUT_IMAGES, ImageTask, OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.sampling_params import AdmittedParams


class _ImagesRoute(APIRoute):
    """Times each request's phases (`PhaseTimer`, observed in ``vllm_omni:request_phase_seconds`` once it is answered
    200), and counts a body that does not fit `ImageGenerationRequest` as an invalid image request; the app's handler
    answers it. (Other APIs' invalid requests are theirs to count.)"""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def timed(request: Request) -> Response:
            timer = request.scope[_TIMER] = metrics.PhaseTimer(request.app.state.server.trace(request.headers))
            await _receive_json(request)
            timer.mark("parse")
            try:
                response = await handler(request)
            except RequestValidationError as exc:
                metrics.image_requests.labels("invalid").inc()
                raise _named(exc, await request.body()) from None
            if response.status_code == 200 and not isinstance(response, StreamingResponse):  # a stream: at its end
                timer.mark("response")
                timer.observe("images")
            return response

        return timed


def _named(exc: RequestValidationError, body: bytes) -> RequestValidationError:
    """A request without a body (FastAPI: the body is missing) is refused as ``{}`` is: naming the first required
    field it lacks (``prompt``). (A JSON ``null`` is a body that is not an object.)"""
    errors = exc.errors()
    missing = errors and errors[0].get("type") == "missing" and tuple(errors[0].get("loc", ())) == ("body",)
    if missing and not body.strip():
        try:
            ImageGenerationRequest.model_validate({})
        except ValidationError as empty:
            return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in empty.errors()])
    return exc


_TIMER = "vllm_omni.phase_timer"
"""The request's `PhaseTimer`, in its ASGI scope."""


async def _receive_json(request: Request) -> None:
    """Receive the body and decode its JSON, which FastAPI then takes from the request as they are (Starlette keeps
    both), so that the time they take is the ``parse`` phase. Failures are answered as FastAPI answers them."""
    try:
        body = await request.body()
    except StarletteHTTPException:  # the body limit
        raise
    except Exception as exc:  # noqa: BLE001 - what FastAPI answers when it cannot read a body
        raise HTTPException(400, "There was an error parsing the body") from exc
    if body and request.headers.get("content-type", "").startswith("application/json"):
        with contextlib.suppress(Exception):  # FastAPI decodes it again and answers the error
            await request.json()


def _check(body: ImageGenerationRequest, state: ServerState, task: ImageTask = "text") -> None:
    """The request's own checks (`check_request` reads only this process's state: it runs on the event loop)."""
    check_request(state, body, kind="image", task=task)
    if body.background == "transparent":
        raise APIError(
            400,
            f"background 'transparent' is not supported: {state.loaded_omni.model_card.pipeline_name} makes opaque RGB "
            "images; use 'auto' or 'opaque'",
            param="background",
            code="invalid_value",
        )
    if body.partial_images and not body.stream:
        raise APIError(
            400, "partial_images are streamed: set stream to true", param="partial_images", code="invalid_value"
        )
    if body.logprobs and body.response_format == "file":
        raise APIError(
            400,
            "logprobs are answered in JSON beside each image: use response_format b64_json or url",
            param="logprobs",
            code="invalid_value",
        )
    if body.stream and "response_format" in body.model_fields_set and body.response_format != "b64_json":
        raise APIError(
            400,
            "a stream carries its images as b64_json: leave response_format unset or set it to b64_json",
            param="response_format",
            code="invalid_value",
        )


def _ignored(body: ImageGenerationRequest) -> list[IgnoredField]:
    """The request's fields that have no effect here: OpenAI's `Ignored` fields it set, and ``output_compression``
    with ``png`` (a lossless format; upstream vllm-omni accepts it too)."""
    ignored = ignored_fields(body)
    if body.output_compression is not None and body.output_format == "png":
        why = "output_format png is lossless; output_compression sets the quality of jpeg and webp only"
        ignored.append(IgnoredField("output_compression", why))
    return ignored


def _admit(body: ImageGenerationRequest, state: ServerState, task: ImageTask = "text", **inputs) -> AdmittedParams:
    """The request's complete parameters (model defaults filled in, the steps of its ``quality``, seed drawn), within
    the operator's limits; ``inputs``: an edit's images and mask, for ``task``. Its `Sampling` fields are copied
    (an edit's ``strength`` among them); the others are computed here (an OpenAI model's sizes: `openai_size`)."""
    multiple, max_pixels = state.loaded_omni.model_card.size_multiple, state.serving.max_image_pixels
    width, height = openai_size(body, multiple, max_pixels) or body.dimensions() or (None, None)
    return admit(
        state,
        body,
        _ignored(body),
        height=height,
        width=width,
        num_inference_steps=quality_steps(state, body, task),
        lora=selected_adapters(state, body),
        **inputs,
    )


async def create_image(body: ImageGenerationRequest, raw_request: Request) -> ImageGenerationResponse | Response:
    body = with_openai_defaults(body)

    async def prepare(state: ServerState) -> AdmittedParams:
        _check(body, state)
        raw_request.scope[_TIMER].mark("validation")  # FastAPI's schema validation, the API key, these checks
        return _admit(body, state)  # on the loop: admission is local work of ~0.1 ms, with no Ray call

    return await _respond(raw_request, body, prepare)


async def generate_images(
    raw_request: Request,
    body: ImageGenerationRequest,
    read_images: Callable[[], Awaitable[list[Image.Image]]] | None,
    timer: metrics.PhaseTimer,
) -> ImageGenerationResponse | Response:
    """An Images request that another API built (chat completions), checked, admitted, run and answered as
    ``POST /v1/images/generations`` answers it, counted as an image request: an edit when it has input images
    (``read_images`` reads them once the request passed its checks); ``timer``: its phases so far. The caller
    observes them once it has answered."""
    raw_request.scope[_TIMER] = timer

    async def prepare(state: ServerState) -> AdmittedParams:
        if read_images is None:
            _check(body, state)
            timer.mark("validation")
            return _admit(body, state)
        _check(body, state, task="image")
        images = await read_images()
        timer.mark("validation")
        return _admit(body, state, "image", image=images)

    return await _respond(raw_request, body, prepare)


async def edit_image(raw_request: Request) -> ImageGenerationResponse | Response:
    """``POST /v1/images/edits``: multipart/form-data as OpenAI's (``image`` or ``image[]``, ``mask``, fields), or
    OpenAI's JSON body (``images`` and ``mask`` by ``image_url``: media.py)."""
    if is_json(raw_request):
        return await _edit_json(raw_request)
    try:
        form = await read_edit_form(raw_request)
    except APIError:
        metrics.image_requests.labels("invalid").inc()
        raise
    try:
        return await _edit(raw_request, form)
    finally:
        await form.close()  # the uploads' spooled files


async def _edit(raw_request: Request, form: FormData) -> ImageGenerationResponse | Response:
    # OpenAI's ignored file fields (markup) are named by their file, which is not read.
    fields = {
        k: (v.filename or k) if isinstance(v, UploadFile) else v for k, v in form.multi_items() if k not in FILE_FIELDS
    }
    try:
        body = ImageEditRequest.model_validate(fields)
    except ValidationError as exc:  # counted and answered as a JSON body's schema errors are
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    body = with_openai_defaults(body)

    async def prepare(state: ServerState) -> AdmittedParams:
        files = form_files(form, "image", "image[]")
        masks = form_files(form, "mask")
        if not files:
            raise APIError(
                400, "image is required: one file as image, or up to 16 as image[]", param="image", code="invalid_value"
            )
        if len(files) > MAX_INPUT_IMAGES or len(masks) > 1:
            param, most = ("image", MAX_INPUT_IMAGES) if len(files) > MAX_INPUT_IMAGES else ("mask", 1)
            raise APIError(400, f"at most {most} {param} file(s)", param=param, code="invalid_value")
        _check(body, state, task="image")
        images = await read_images(files, "image", state.serving)
        mask = openai_mask((await read_images(masks, "mask", state.serving))[0], images[0]) if masks else None
        raw_request.scope[_TIMER].mark("validation")
        task: ImageTask = "inpaint" if mask is not None else "image"
        return _admit(body, state, task, image=images, mask_image=mask)

    return await _respond(raw_request, body, prepare)


async def _edit_json(raw_request: Request) -> ImageGenerationResponse | Response:
    """A JSON edit: its images fetched or decoded (media.py) once the request passed its checks."""
    try:
        fields = await read_json_object(raw_request)
        references = edit_references(fields)
    except APIError:
        metrics.image_requests.labels("invalid").inc()
        raise
    try:
        body = ImageEditRequest.model_validate(fields, strict=None)  # a JSON body's integers are JSON integers
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    body = with_openai_defaults(body)

    async def prepare(state: ServerState) -> AdmittedParams:
        _check(body, state, task="image")
        images = await read_references(references.images, state.serving)
        mask = None
        if references.mask is not None:
            mask = openai_mask((await read_references([references.mask], state.serving))[0], images[0])
        raw_request.scope[_TIMER].mark("validation")
        task: ImageTask = "inpaint" if mask is not None else "image"
        return _admit(body, state, task, image=images, mask_image=mask)

    return await _respond(raw_request, body, prepare)


async def _respond(
    raw_request: Request,
    body: ImageGenerationRequest,
    prepare: Callable[[ServerState], Awaitable[AdmittedParams]],
) -> ImageGenerationResponse | Response:
    """Admit the request (``prepare``: its checks and complete parameters), run it and answer with its images."""
    state: ServerState = raw_request.app.state.server
    timer: metrics.PhaseTimer = raw_request.scope[_TIMER]
    with Outcome(metrics.image_requests) as outcome:
        admitted = await prepare(state)
        outcome.running()
        timer.mark("completion")
        request_id = f"img-{uuid.uuid4().hex}"
        report_ignored(raw_request, body, admitted, "images", request_id)
        generation = state.loaded_omni.generate(body.prompt, admitted, request_id=request_id)
        if body.stream:
            outcome.handed_over()  # counted when the stream ends
            return StreamingResponse(
                image_events(raw_request, body, admitted.params, generation, timer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            output = await next_output(raw_request, generation, outcome)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the request was aborted and its slot freed
        timer.mark_engine(output, admitted.params)
        answer = await _answer(raw_request, body, admitted.params, output, request_id)
        outcome.completed()
        return answer


async def _answer(
    raw_request: Request,
    body: ImageGenerationRequest,
    params: OmniDiffusionSamplingParams,
    output: OmniRequestOutput,
    request_id: str,
) -> ImageGenerationResponse | Response:
    """The finished request's images as ``response_format`` asks: the files themselves, base64 in JSON, or URLs of
    the image store; their encoding timed as its own phase."""
    state: ServerState = raw_request.app.state.server
    b64 = body.response_format == "b64_json"
    texts: list[str] = []
    files: list[bytes] = []
    if b64:
        texts = await encode_images(output.images, body, True)
    else:
        files = await encode_images(output.images, body, False)
    raw_request.scope[_TIMER].mark("encoding")
    if body.response_format == "file":
        return files_response(files, body.output_format, request_id)
    # The prompt the images were made from: the llm stage's, or the request's own (as DALL·E 3 answers).
    revised_prompt = output.revised_prompt or body.prompt
    log_probs = output_log_probs(output)
    if b64:
        data = [
            ImageData(b64_json=text, revised_prompt=revised_prompt, log_probs=lp)
            for text, lp in zip(texts, log_probs, strict=True)
        ]
    else:
        data = [
            _stored(raw_request, body, payload, revised_prompt, lp)
            for payload, lp in zip(files, log_probs, strict=True)
        ]
    return ImageGenerationResponse(data=data, **response_fields(state, body, params, output))


def _stored(
    raw_request: Request,
    body: ImageGenerationRequest,
    payload: bytes,
    revised_prompt: str,
    log_probs: list[float] | None,
) -> ImageData:
    """An image of a ``url`` answer: put in the server's image store, answered by its URL there."""
    state: ServerState = raw_request.app.state.server
    image_id = state.store.put(payload, MEDIA_TYPES[body.output_format])
    if image_id is None:
        raise APIError(500, "The image is larger than the image store; use response_format=b64_json")
    url = str(raw_request.url_for("get_image", image_id=image_id))
    return ImageData(url=url, revised_prompt=revised_prompt, log_probs=log_probs)


async def get_image(image_id: str, raw_request: Request) -> Response:
    # An in-memory map lookup: no path is ever built from image_id, so nothing outside the store is reachable.
    stored = raw_request.app.state.server.store.get(image_id)
    if stored is None:
        raise APIError(404, "No such image, or it has expired", code="image_not_found")
    return Response(stored.data, media_type=stored.media_type)


def build_images_router() -> APIRouter:
    """The /v1/images routes; the server's state holds the image store (``state.store``)."""
    router = APIRouter(prefix="/v1/images", dependencies=[Depends(check_api_key), Depends(check_query)])
    router.add_api_route("/files/{image_id}", get_image, methods=["GET"], name="get_image")
    for path, endpoint, extra in (
        ("/generations", create_image, None),
        ("/edits", edit_image, {"requestBody": edit_request_body()}),
    ):
        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=ImageGenerationResponse,
            response_model_exclude_none=True,
            responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)},
            route_class_override=_ImagesRoute,
            openapi_extra=extra,
        )
    return router
