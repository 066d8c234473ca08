"""Admission of a checked generation request: its sampling parameters built once from the request's `Sampling`
fields and what its route computed, completed by the model (defaults, a seed), within the operator's limits and
the waiting queue. Every refusal is an `APIError` naming the API field: 400, 404 (an unknown adapter), 429 (the
queue is full) or 503; `refusal_outcome` is how the routes count one. The fields the model would not use are
accepted and reported (`report_ignored`), or refused under ``--strict-fields``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fastapi import Request
from pydantic import BaseModel, ValidationError

from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.request_fields import api_names, sampling_fields
from vllm_omni.errors import SamplingParamsError, StageUnavailableError, UnknownLoraError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.outputs import IgnoredField
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.entrypoints.openai.server_state import ServerState
    from vllm_omni.sampling_params import AdmittedParams


logger = init_logger(__name__)

WARNING = "vllm_omni.warning"
"""The ``Warning`` header of the request's answer, in its ASGI scope (`report_ignored`); the app's
`WarningHeaderMiddleware` adds it as the answer starts, so a stream carries it too."""

API_PARAM = {"height": "size", "width": "size", "mask_image": "mask"}
"""The API field each of these sampling parameters is computed from by the routes, which an error about it names (a
request field copied under another name is named by its `Sampling`: `api_names`)."""


def check_limits(params: OmniDiffusionSamplingParams, serving: ServingConfig) -> None:
    """The operator's size and step limits, applied to complete parameters (the model's defaults included); audio
    has no size (the model card bounds its length), speech neither size nor steps (``max_new_tokens`` bounds it)."""
    pixels = params.width * params.height if params.width is not None and params.height is not None else 0
    if pixels > serving.max_image_pixels:
        raise APIError(
            400,
            f"size {params.width}x{params.height} exceeds the limit of {serving.max_image_pixels} pixels",
            param="size",
            code="invalid_value",
        )
    if params.num_inference_steps is not None and params.num_inference_steps > serving.max_inference_steps:
        raise APIError(
            400,
            f"num_inference_steps={params.num_inference_steps} is above the limit of {serving.max_inference_steps}",
            param="num_inference_steps",
            code="invalid_value",
        )


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


def _api_param(body: BaseModel, name: str) -> str:
    """The request field that the sampling parameter (or ``extra_args`` key) ``name`` came from."""
    return api_names(type(body)).get(name) or API_PARAM.get(name, name)


def admit(state: ServerState, body: BaseModel, ignored: Sequence[IgnoredField] = (), **computed) -> AdmittedParams:
    """The request's parameters completed once (the model's defaults filled in: ``size: auto``, default steps...,
    and a seed drawn), within the operator's limits; every problem is a 400 naming the API field, and a full queue
    a 429. The parameters are the request's `Sampling` fields (`sampling_fields`) and those its route ``computed``
    from other fields; ``ignored``: the request's fields that the route knows have no effect here (OpenAI's
    `Ignored` fields, ``output_compression`` with ``png``), named as the API names them, reported with the model's
    own (`report_ignored`) or, under ``--strict-fields``, refused first. It is local work (each stage admits from
    its model card; no replica is asked), so it runs on the event loop."""
    if ignored and state.serving.strict_fields:
        first = ignored[0]
        raise APIError(
            400,
            f"{first.param} has no effect on this server: {first.reason}; leave it out (--strict-fields)",
            param=first.param,
            code="invalid_value",
        )
    try:
        admitted = state.loaded_omni.admit(OmniDiffusionSamplingParams(**sampling_fields(body), **computed))
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
    if ignored:
        admitted = dataclasses.replace(admitted, ignored=(*ignored, *admitted.ignored))
    check_limits(admitted.params, state.serving)
    if state.loaded_omni.num_waiting >= state.serving.max_waiting_requests:
        raise APIError(
            429,
            f"Too many requests waiting ({state.serving.max_waiting_requests}); retry later",
            code="too_many_waiting_requests",
        )
    return admitted


def report_ignored(raw_request: Request, body: BaseModel, admitted: AdmittedParams, api: str, request_id: str) -> None:
    """The fields of an admitted request that the model would not use (`AdmittedParams.ignored`, named as the API
    names them), never silent, as vLLM logs the fields it ignores: one log line with the request's id and route,
    ``vllm_omni:ignored_fields_total{api,field}`` for each, and a ``Warning`` header on the answer with one value
    per field, ``299 - "<field> ignored: <why>"`` (RFC 7234 §5.5: 299 is a persistent warning, ``-`` no agent
    name). ``api``: ``images``, ``videos`` or ``audio``, the API the request is counted in."""
    if not admitted.ignored:
        return
    fields = [_api_param(body, field.param.removeprefix("extra_args.")) for field in admitted.ignored]
    texts = [f"{name} ignored: {field.reason}" for name, field in zip(fields, admitted.ignored, strict=True)]
    logger.warning("request %s (%s %s): %s", request_id, raw_request.method, raw_request.url.path, "; ".join(texts))
    for name in fields:
        metrics.ignored_fields.labels(api, name).inc()
    quoted = (text.replace("\\", "\\\\").replace('"', '\\"') for text in texts)  # warn-text is a quoted-string
    raw_request.scope[WARNING] = ", ".join(f'299 - "{text}"' for text in quoted)


def refusal_outcome(error: APIError) -> str:
    """How a generation request refused before it ran is counted: ``overloaded`` (429), ``unavailable`` (503) or
    ``invalid``."""
    return {429: "overloaded", 503: "unavailable"}.get(error.status, "invalid")
