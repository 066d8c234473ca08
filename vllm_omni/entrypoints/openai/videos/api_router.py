"""OpenAI's Videos API: asynchronous video jobs on the same engine, MP4 output (PyAV)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from PIL import Image
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni.entrypoints.openai.admission import admit, refusal_outcome, report_ignored, selected_adapters
from vllm_omni.entrypoints.openai.checks import (
    check_api_key,
    check_query,
    check_request,
    check_sides,
)
from vllm_omni.entrypoints.openai.disconnect import ClientDisconnected
from vllm_omni.entrypoints.openai.errors import APIError, error_info
from vllm_omni.entrypoints.openai.images.image_files import attachment
from vllm_omni.entrypoints.openai.media import (
    MediaReference,
    fold_form_references,
    read_json_object,
    read_references,
    video_reference,
)
from vllm_omni.entrypoints.openai.outcomes import Outcome, failure, next_output
from vllm_omni.entrypoints.openai.protocol import (
    SHAPE_FIELDS,
    ErrorInfo,
    VideoDeleted,
    VideoGenerationRequest,
    VideoList,
    VideoObject,
    VideoRemixRequest,
)
from vllm_omni.entrypoints.openai.request_fields import ignored_fields
from vllm_omni.entrypoints.openai.rollout_fields import output_log_probs
from vllm_omni.entrypoints.openai.uploads import form_files, read_images
from vllm_omni.entrypoints.openai.videos.video_jobs import VideoJob, decode_mp4, encode_mp4, encode_png
from vllm_omni.errors import RequestFailedError, StageUnavailableError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.sampling_params import DEFAULT_VIDEO_FPS, ImageTask

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.sampling_params import AdmittedParams

logger = init_logger(__name__)

_FORM_TYPES = ("multipart/form-data", "application/x-www-form")


async def _run(state: ServerState, job: VideoJob) -> None:
    outcome = "failed"
    try:
        output = None
        async for output in state.loaded_omni.generate(job.prompt, job.admitted, request_id=job.id):
            if not output.finished:  # off the loop, as every encoding here
                job.thumbnail = await asyncio.to_thread(encode_png, output.images[0])
                job.preview_index = output.partial_image_index
        if output is None or not output.finished:
            raise RequestFailedError(job.id, "aborted")
        job.timer.mark_engine(output, job.admitted.params)
        frames, job.revised_prompt = output.videos[0], output.revised_prompt
        job.log_probs = output_log_probs(output)[0]
        assert job.admitted.params.fps is not None, "complete params of a video"
        job.content = await asyncio.to_thread(encode_mp4, frames, job.admitted.params.fps)
        job.timer.mark("encoding")
        job.thumbnail = await asyncio.to_thread(encode_png, frames[len(frames) // 2])
        job.timer.observe("videos")
        job.status, outcome = "completed", "completed"
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except StageUnavailableError as exc:
        outcome = "unavailable"
        job.status, job.error = "failed", ErrorInfo(message=str(exc), type="server_error", code="service_unavailable")
    except RequestFailedError as exc:
        error = failure(exc, state)[1]
        job.status, job.error = "failed", error_info(error.status, error.message, code=error.code)
    except Exception as exc:  # noqa: BLE001 - an encoding error fails this job only
        logger.exception("video job %s failed", job.id)
        job.status = "failed"
        job.error = ErrorInfo(message=f"{type(exc).__name__}: {exc}", type="server_error", code="encoding_failed")
    finally:
        job.completed_at, job.finished_monotonic = int(time.time()), time.monotonic()
        metrics.video_requests.labels(outcome).inc()


def build_videos_router() -> APIRouter:
    """The /v1/videos routes; the server's state holds the jobs (``state.videos``)."""
    router = APIRouter(prefix="/v1/videos", dependencies=[Depends(check_api_key), Depends(check_query)])
    router.add_api_route(
        "", create_video, methods=["POST"], response_model=VideoObject, response_model_exclude_none=True
    )
    router.add_api_route(
        "/sync",
        create_video_sync,
        methods=["POST"],
        response_class=Response,
        responses={200: {"content": {"video/mp4": {}}}},
    )
    router.add_api_route(
        "/{video_id}/remix", remix_video, methods=["POST"], response_model=VideoObject, response_model_exclude_none=True
    )
    router.add_api_route("", list_videos, methods=["GET"], response_model=VideoList, response_model_exclude_none=True)
    router.add_api_route(
        "/{video_id}", get_video, methods=["GET"], response_model=VideoObject, response_model_exclude_none=True
    )
    router.add_api_route("/{video_id}/content", get_video_content, methods=["GET"])
    router.add_api_route("/{video_id}", delete_video, methods=["DELETE"], response_model=VideoDeleted)
    return router


def _job(state: ServerState, video_id: str) -> VideoJob:
    job = state.videos.get(video_id)
    if job is None:
        raise APIError(
            404, f"No video job {video_id!r} (it may have expired)", param="video_id", code="video_not_found"
        )
    return job


def _start(
    raw_request: Request,
    state: ServerState,
    body: VideoGenerationRequest,
    admitted: AdmittedParams,
    timer: metrics.PhaseTimer,
    remixed_from: str | None = None,
) -> VideoObject:
    """A new job for an admitted request, stored and running: its first view."""
    job = VideoJob(
        id=new_video_id(),
        model=body.model or state.serving.served_model_names[0],
        prompt=body.prompt,
        admitted=admitted,
        timer=timer,
        remixed_from=remixed_from,
    )
    state.videos.add(job)
    report_ignored(raw_request, body, admitted, "videos", job.id)
    job.task = asyncio.create_task(_run(state, job))
    return job.view(state.loaded_omni)


async def create_video(raw_request: Request) -> VideoObject:
    # The body is read here (JSON or a form), and this route counts its own invalid requests.
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    try:
        body, references, reference = await _read(raw_request, timer)
        try:
            admitted = await accept(state, body, _upload_reader(state, references, reference), timer)
        finally:
            for upload in references:  # its spooled file
                await upload.close()
    except Exception as exc:
        metrics.video_requests.labels(refusal_outcome(exc) if isinstance(exc, APIError) else "invalid").inc()
        raise
    return _start(raw_request, state, body, admitted, timer)  # counted when the job ends


async def create_video_sync(raw_request: Request) -> Response:
    """Upstream vllm-omni's synchronous route: the same request as ``POST /v1/videos``, answered with the MP4
    itself once it is made."""
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    try:
        body, references, reference = await _read(raw_request, timer)
    except Exception:
        metrics.video_requests.labels("invalid").inc()
        raise
    try:
        request_id = new_video_id()
        reader = _upload_reader(state, references, reference)
        content = await run_sync(raw_request, state, body, reader, timer, request_id)
    finally:
        for upload in references:  # its spooled file
            await upload.close()
    if content is None:
        return Response(status_code=499)  # nobody reads it; the request was aborted and its slot freed
    return Response(content, media_type="video/mp4", headers=attachment(f"{request_id}.mp4"))


async def remix_video(video_id: str, raw_request: Request) -> VideoObject:
    """OpenAI's remix: a new job that makes a video from the completed video ``video_id`` and a new prompt, with
    the served model's video-to-video variant (`ModelCard.variants`); its size, frames and frame rate are the
    source's."""
    state: ServerState = raw_request.app.state.server
    timer = metrics.PhaseTimer(state.trace(raw_request.headers))
    try:
        body, frames, source = await _read_remix(raw_request, state, video_id, timer)
        params = source.admitted.params
        admitted = admit(
            state,
            body.model_copy(update={"fps": params.fps}),
            ignored_fields(body),
            height=params.height,
            width=params.width,
            video=frames,
            lora=selected_adapters(state, body),
        )
        timer.mark("completion")
    except Exception as exc:
        metrics.video_requests.labels(refusal_outcome(exc) if isinstance(exc, APIError) else "invalid").inc()
        raise
    return _start(raw_request, state, body, admitted, timer, remixed_from=video_id)  # counted when the job ends


async def _read_remix(
    raw_request: Request, state: ServerState, video_id: str, timer: metrics.PhaseTimer
) -> tuple[VideoRemixRequest, list[Image.Image], VideoJob]:
    """A remix's body (JSON), checked, and its source: a completed job of a model with a video-to-video variant,
    whose frames are read back from its MP4."""
    data = await read_json_object(raw_request) if await raw_request.body() else {}
    timer.mark("parse")
    try:
        body = VideoRemixRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    check_request(state, body, kind="video", task="video")
    for name in SHAPE_FIELDS:
        if getattr(body, name) is not None:
            why = f"{name} follows the source video in a remix: leave it out"
            raise APIError(400, why, param=name, code="invalid_value")
    source = _job(state, video_id)
    if source.status != "completed" or source.content is None:
        why = f"Video {video_id} is {source.status}, not completed: only a completed video can be remixed"
        raise APIError(400, why, param="video_id", code="video_not_ready")
    frames = await asyncio.to_thread(decode_mp4, source.content)  # off the loop
    timer.mark("validation")
    return body, frames, source


async def list_videos(
    raw_request: Request, limit: int = 20, after: str | None = None, order: str = "desc"
) -> VideoList:
    """The jobs, newest first (``order=desc``, OpenAI's default) or oldest first (``asc``), ``limit`` of them
    after the job ``after``."""
    state: ServerState = raw_request.app.state.server
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit", code="invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', not {order!r}", param="order", code="invalid_value")
    jobs = state.videos.newest_first()
    if order == "asc":
        jobs.reverse()
    if after is not None:
        ids = [j.id for j in jobs]
        if after not in ids:
            raise APIError(400, f"after={after!r} is not a video id", param="after", code="invalid_value")
        jobs = jobs[ids.index(after) + 1 :]
    page = [j.view(state.loaded_omni) for j in jobs[:limit]]
    return VideoList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(jobs) > limit,
    )


async def get_video(video_id: str, raw_request: Request) -> VideoObject:
    state: ServerState = raw_request.app.state.server
    return _job(state, video_id).view(state.loaded_omni)


async def get_video_content(video_id: str, raw_request: Request, variant: str = "video") -> Response:
    """The MP4 (``variant=video``), or a PNG (``variant=thumbnail``): the latest preview of a running job that
    asked for ``partial_images``, or the middle frame of a completed video."""
    job = _job(raw_request.app.state.server, video_id)
    if variant not in ("video", "thumbnail"):
        raise APIError(
            400, f"variant must be 'video' or 'thumbnail', not {variant!r}", param="variant", code="invalid_value"
        )
    if variant == "thumbnail" and job.thumbnail is not None:
        return Response(job.thumbnail, media_type="image/png", headers=attachment(f"{video_id}.png"))
    if job.status != "completed":
        why = f"Video {video_id} is {job.status}, not completed"
        if variant == "thumbnail":
            why += ", and has no preview yet (create it with partial_images to get previews while it runs)"
        raise APIError(400, why, param="video_id", code="video_not_ready")
    return Response(job.content, media_type="video/mp4", headers=attachment(f"{video_id}.mp4"))


async def delete_video(video_id: str, raw_request: Request) -> VideoDeleted:
    state: ServerState = raw_request.app.state.server
    job = _job(state, video_id)
    state.videos.pop(video_id)
    if job.task is not None and not job.task.done():
        job.task.cancel()  # AsyncOmni aborts the request: its slot is freed
    return VideoDeleted(id=video_id)


async def _read(
    raw_request: Request, timer: metrics.PhaseTimer
) -> tuple[VideoGenerationRequest, list[UploadFile], MediaReference | None]:
    """The request's body, JSON or a form, and its ``input_reference`` upload if it has one (read by `accept`, once
    the request passed its checks; the caller closes it), or the image it gives by reference (media.py)."""
    references = []
    if not await raw_request.body():  # no body: refused as {} is, naming the missing fields
        data = {}
    elif raw_request.headers.get("content-type", "").lower().startswith(_FORM_TYPES):
        try:
            form = await raw_request.form(max_files=1, max_fields=64)
        except StarletteHTTPException as exc:  # a malformed body, or more than one file
            raise APIError(400, f"The form could not be read: {exc.detail}", code="invalid_form") from None
        references = form_files(form, "input_reference")
        data = fold_form_references({k: v for k, v in form.items() if k != "input_reference"})
    else:
        data = await read_json_object(raw_request)
    timer.mark("parse")
    try:
        reference = video_reference(data, uploaded=bool(references))
        body = VideoGenerationRequest.model_validate(data)
    except ValidationError as exc:
        for upload in references:
            await upload.close()
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    except APIError:
        for upload in references:
            await upload.close()
        raise
    return body, references, reference


async def accept(
    state: ServerState,
    body: VideoGenerationRequest,
    read_image: Callable[[], Awaitable[list[Image.Image]]] | None,
    timer: metrics.PhaseTimer,
    sync: bool = False,
) -> AdmittedParams:
    """The request checked, its ``input_reference`` read (``read_image``, only once the checks passed: an image
    model is refused before any file is decoded) and its parameters admitted (on the loop, as in images/api_router.py),
    timing each phase; ``sync``: answered at once, with no job to show previews on."""
    _check(state, body, task="image" if read_image else "text")
    for field, why in (("partial_images", "previews of a running job"), ("logprobs", "its log_probs")):
        if sync and getattr(body, field):
            raise APIError(
                400,
                f"a synchronous video answers with the MP4 only: use POST /v1/videos for {why}",
                param=field,
                code="invalid_value",
            )
    image = await read_image() if read_image else None
    timer.mark("validation")
    admitted = _admit(state, body, image)
    timer.mark("completion")
    return admitted


def _upload_reader(
    state: ServerState, references: list[UploadFile], reference: MediaReference | None = None
) -> Callable[[], Awaitable[list[Image.Image]]] | None:
    """`accept`'s ``read_image`` for an ``input_reference`` upload, or an image given by reference, if there is
    one."""
    if reference is not None:
        return lambda: read_references([reference], state.serving)
    if not references:
        return None
    return lambda: read_images(references, "input_reference", state.serving)


def new_video_id() -> str:
    """A video request's id, as a job's and a synchronous answer's filename show it."""
    return f"video_{secrets.token_hex(16)}"


async def run_sync(
    raw_request: Request,
    state: ServerState,
    body: VideoGenerationRequest,
    read_image: Callable[[], Awaitable[list[Image.Image]]] | None,
    timer: metrics.PhaseTimer,
    request_id: str,
) -> bytes | None:
    """Admit the request as ``request_id``, run it and return its MP4 (``/v1/videos/sync``, and chat completions of
    a video model), counted as a video request; ``None`` when the client went away first (the request was
    aborted)."""
    with Outcome(metrics.video_requests, aborted="cancelled") as outcome:
        admitted = await accept(state, body, read_image, timer, sync=True)
        outcome.running()
        report_ignored(raw_request, body, admitted, "videos", request_id)
        generation = state.loaded_omni.generate(body.prompt, admitted, request_id=request_id)
        try:
            output = await next_output(raw_request, generation, outcome)
        except ClientDisconnected:
            return None
        timer.mark_engine(output, admitted.params)
        assert admitted.params.fps is not None, "complete params of a video"
        content = await asyncio.to_thread(encode_mp4, output.videos[0], admitted.params.fps)  # off the loop
        timer.mark("encoding")
        timer.observe("videos")
        outcome.completed()
        return content


def _check(state: ServerState, body: VideoGenerationRequest, task: ImageTask) -> None:
    """The job's own checks (`check_request` reads only this process's state: it runs on the event loop)."""
    check_request(state, body, kind="video", task=task)
    if body.seconds is not None and body.num_frames is not None:
        raise APIError(400, "give seconds or num_frames, not both", param="seconds", code="invalid_value")
    check_sides(body.size, body.width, body.height)


def _admit(state: ServerState, body: VideoGenerationRequest, image: list[Image.Image] | None) -> AdmittedParams:
    """The job's complete parameters (model defaults filled in, seed drawn), within the operator's limits;
    ``image``: its ``input_reference`` (image-to-video). Its `Sampling` fields are copied; the others are computed
    here."""
    num_frames = body.num_frames
    if body.seconds is not None:
        step = state.loaded_omni.model_card.frame_multiple
        num_frames = step * max(1, round(body.seconds * (body.fps or DEFAULT_VIDEO_FPS) / step)) + 1
    width, height = body.dimensions() or (None, None)
    admitted = admit(
        state,
        body,
        ignored_fields(body),
        height=height,
        width=width,
        num_frames=num_frames,
        image=image,
        lora=selected_adapters(state, body),
    )
    num_frames = admitted.params.num_frames
    assert num_frames is not None, "complete params of a video"
    if num_frames > state.serving.max_video_frames:
        raise APIError(
            400,
            f"{num_frames} frames are above the limit of {state.serving.max_video_frames}",
            param="seconds" if body.seconds is not None else "num_frames",
            code="invalid_value",
        )
    return admitted
