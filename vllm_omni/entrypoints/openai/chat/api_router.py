"""``POST /v1/chat/completions`` for diffusion models, in upstream vllm-omni's shape: a thin adapter. It turns the
chat request into an Images request (an edit when it carries images), or for a video model a synchronous Videos
request, which that API checks, admits, batches, runs and counts as its own; the answer carries the images (or the
MP4) as data URLs in the assistant message, as upstream's does."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from PIL import Image
from pydantic import BaseModel, ValidationError

from vllm_omni.entrypoints.openai.chat.protocol import (
    ChatAnswer,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMediaPart,
    ChatMediaURL,
    ChatUsage,
)
from vllm_omni.entrypoints.openai.checks import check_api_key, check_query, check_sides
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.images import api_router as images_api
from vllm_omni.entrypoints.openai.protocol import (
    ErrorResponse,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoGenerationRequest,
)
from vllm_omni.entrypoints.openai.request_fields import api_names
from vllm_omni.entrypoints.openai.uploads import decode_image
from vllm_omni.entrypoints.openai.videos import api_router as videos_api
from vllm_omni.metrics import prometheus as metrics

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState

LLM_FIELDS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "function_call",
        "functions",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "reasoning_effort",
        "response_format",
        "stop",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
    }
)
"""Chat fields that steer text generation: a diffusion model generates none, so a request with them is an LLM
request, answered with a 400 that says so."""

_DATA_URL = re.compile(r"^data:image/[a-z0-9.+-]+;base64,", re.IGNORECASE)

_MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


async def create_chat_completion(
    body: ChatCompletionRequest, raw_request: Request
) -> ChatCompletionResponse | Response:
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    timer.mark("parse")
    reason = state.unavailable_reason()
    if reason is not None:
        _requests(state).labels("unavailable").inc()
        raise APIError(503, f"Service unavailable: {reason}", code="service_unavailable")
    video = state.loaded_omni.output_kind == "video"
    try:
        request, read_images = _translate(body, state, video)
    except APIError:  # the API it becomes counts everything after this (and `_ChatRoute` a schema error)
        _requests(state).labels("invalid").inc()
        raise
    model = body.model or state.serving.served_model_names[0]
    answer_id = f"chatcmpl-{uuid.uuid4().hex}"
    if video:
        assert isinstance(request, VideoGenerationRequest), "a video model's chat is a Videos request"
        content = await videos_api.run_sync(raw_request, state, request, read_images, timer, videos_api.new_video_id())
        if content is None:
            return Response(status_code=499)  # nobody reads it; the request was aborted and its slot freed
        part = ChatMediaPart(type="video_url", video_url=ChatMediaURL(url=_data_url("video/mp4", content)))
        return ChatCompletionResponse(
            id=answer_id, model=model, choices=[ChatChoice(message=ChatAnswer(content=[part]))]
        )
    assert isinstance(request, ImageGenerationRequest), "an image model's chat is an Images request"
    answer = await images_api.generate_images(raw_request, request, read_images, timer)
    if isinstance(answer, Response):
        return answer
    media_type = _MEDIA_TYPES[answer.output_format]
    parts = [
        ChatMediaPart(type="image_url", image_url=ChatMediaURL(url=f"data:{media_type};base64,{image.b64_json}"))
        for image in answer.data
    ]
    usage = answer.usage
    response = ChatCompletionResponse(
        id=answer_id,
        model=model,
        choices=[ChatChoice(message=ChatAnswer(content=parts))],
        usage=None
        if usage is None
        else ChatUsage(
            prompt_tokens=usage.input_tokens, completion_tokens=usage.output_tokens, total_tokens=usage.total_tokens
        ),
    )
    timer.mark("response")
    timer.observe("images")
    return response


def _translate(
    body: ChatCompletionRequest, state: ServerState, video: bool
) -> tuple[ImageGenerationRequest | VideoGenerationRequest, Callable[[], Awaitable[list[Image.Image]]] | None]:
    """The Images (edit) or Videos request the chat request stands for, and the reader of its input images (their
    data URLs' bytes are decoded from base64 here, the images once the request has passed its checks)."""
    model = body.model or state.serving.served_model_names[0]
    if body.stream:
        raise APIError(
            400,
            "chat completions of a diffusion model are answered whole: set stream to false (POST "
            "/v1/images/generations streams partial images)",
            param="stream",
            code="invalid_value",
        )
    params = _generation_params(body)
    llm = sorted(params.keys() & LLM_FIELDS)
    if llm:
        made = "videos" if video else "images"
        raise APIError(
            400,
            f"{model} is a diffusion model: it makes {made} from the user messages and generates no text, so "
            f"{', '.join(llm)} (fields of LLM chat requests) cannot apply; send the prompt as a user message, with "
            f"generation parameters such as size or num_inference_steps",
            param=llm[0],
            code="model_not_supported",
        )
    prompt, urls = _prompt_and_images(body)
    request_class = VideoGenerationRequest if video else ImageEditRequest if urls else ImageGenerationRequest
    params = _api_fields(params, request_class)
    if not video:
        params = _image_size(params)
    fields = {"prompt": prompt, "model": body.model, **params}
    try:
        request = request_class.model_validate(fields)
    except ValidationError as exc:  # answered as a body's schema errors are, naming the field
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    if not urls:
        return request, None
    param = "input_reference" if video else "image"
    contents = [_decode_data_url(url, where) for url, where in urls]

    async def read_images() -> list[Image.Image]:  # once the API it becomes has checked the request
        return await asyncio.to_thread(lambda: [decode_image(data, param, state.serving) for data in contents])

    return request, read_images


def _generation_params(body: ChatCompletionRequest) -> dict[str, Any]:
    """The generation parameters, from the top level and from a literal ``extra_body`` (one key in one place)."""
    top, nested = dict(body.model_extra or {}), body.extra_body or {}
    twice = sorted(top.keys() & nested.keys())
    if twice:
        raise APIError(
            400,
            f"{twice[0]} is given at the top level and in extra_body: give it once",
            param=twice[0],
            code="invalid_value",
        )
    return {**top, **nested}


def _api_fields(params: dict[str, Any], request_class: type[BaseModel]) -> dict[str, Any]:
    """Upstream's sampling-parameter names as the API's fields: each field that fills a sampling parameter of another
    name (its `Sampling`) also takes that name, as ``n`` takes ``num_outputs_per_prompt``."""
    params = dict(params)
    for sampling_name, field in api_names(request_class).items():
        if sampling_name in params:
            if field in params:
                raise APIError(400, f"give {field} or {sampling_name}, not both", param=field, code="invalid_value")
            params[field] = params.pop(sampling_name)
    return params


def _image_size(params: dict[str, Any]) -> dict[str, Any]:
    """Upstream's ``height`` with ``width`` as the Images API's ``size``."""
    check_sides(params.get("size"), params.get("width"), params.get("height"))
    if "width" in params:
        params = dict(params)
        width, height = params.pop("width"), params.pop("height")
        if not all(isinstance(side, int) and not isinstance(side, bool) for side in (width, height)):
            raise APIError(400, "width and height must be integers (pixels)", param="width", code="invalid_value")
        params["size"] = f"{width}x{height}"
    return params


def _prompt_and_images(body: ChatCompletionRequest) -> tuple[str, list[tuple[str, str]]]:
    """The prompt (the user messages' text parts, joined with spaces, as upstream joins them) and each image part's
    URL with where it is (``messages[i].content[j]``)."""
    texts, urls = [], []
    for i, message in enumerate(body.messages):
        if message.role != "user":
            raise APIError(
                400,
                f"messages[{i}] has role {message.role!r}: a diffusion model takes its prompt from user messages "
                "only (text parts, and image_url parts for its input images)",
                param="messages",
                code="invalid_value",
            )
        if isinstance(message.content, str):
            texts.append(message.content)
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type == "text":
                if part.text is None or part.image_url is not None:
                    raise APIError(400, f"{where}: a text part has text only", param="messages", code="invalid_value")
                texts.append(part.text)
            else:
                if part.image_url is None or part.text is not None:
                    raise APIError(
                        400, f"{where}: an image_url part has image_url only", param="messages", code="invalid_value"
                    )
                urls.append((part.image_url.url, where))
    prompt = " ".join(text.strip() for text in texts if text.strip())
    if not prompt:
        raise APIError(400, "the user messages have no text: it is the prompt", param="messages", code="invalid_value")
    return prompt, urls


def _decode_data_url(url: str, where: str) -> bytes:
    if not _DATA_URL.match(url):
        raise APIError(
            400,
            f"{where}: image_url must be a data URL (data:image/png;base64,...); this server fetches no URLs",
            param="messages",
            code="invalid_value",
        )
    try:
        return base64.b64decode(url.split(",", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(
            400, f"{where}: the data URL is not valid base64", param="messages", code="invalid_value"
        ) from None


def _data_url(media_type: str, content: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(content).decode('ascii')}"


def _requests(state: ServerState):
    """The outcome counter of the API a chat request becomes."""
    video = state.omni is not None and state.omni.output_kind == "video"
    return metrics.video_requests if video else metrics.image_requests


class _ChatRoute(APIRoute):
    """Counts a body that does not fit `ChatCompletionRequest` (or the request it becomes) as an invalid request of
    the API it would have become; the app's handler answers it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def counted(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                _requests(request.app.state.server).labels("invalid").inc()
                raise

        return counted


def build_chat_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(check_api_key), Depends(check_query)])
    router.add_api_route(
        "/v1/chat/completions",
        create_chat_completion,
        methods=["POST"],
        response_model=ChatCompletionResponse,
        response_model_exclude_none=True,
        responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)},
        route_class_override=_ChatRoute,
    )
    return router
