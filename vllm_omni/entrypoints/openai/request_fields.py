"""What a request field of the generation APIs declares besides its type (`Sampling`, `Ignored`), and what
admission, error messages and the chat adapter read of those declarations (`sampled`, `api_names`,
`sampling_fields`, `ignored_fields`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from vllm_omni.outputs import IgnoredField


@dataclass(frozen=True)
class Sampling:
    """What makes a request field one that its route copies into the request's `OmniDiffusionSamplingParams` as it
    is (``Annotated[T, Sampling()]``): under the sampling field ``name`` (the request field's own name when unset),
    or with ``extra_args`` into ``extra_args`` (a keyword of the pipeline call, which the model card refuses naming
    it where the pipeline cannot take it), there only when the request sets it. Admission (`sampling_fields`), the
    ``param`` of an error about a sampling field (`api_names`) and the chat adapter's upstream names read it. Fields
    that the route computes into sampling fields (``size``, ``quality``, ``seconds``, ``lora``) have none."""

    name: str | None = None
    """The `OmniDiffusionSamplingParams` field (or ``extra_args`` key) it fills, when its name differs."""

    extra_args: bool = False
    """It travels in ``extra_args``: an extension of one pipeline family rather than a sampling field of every one."""


@functools.cache
def sampled(model: type[BaseModel]) -> dict[str, Sampling]:
    """The request model's fields that its route copies into the sampling parameters, each with its `Sampling`."""
    return {
        name: marker
        for name, info in model.model_fields.items()
        for marker in info.metadata
        if isinstance(marker, Sampling)
    }


@functools.cache
def api_names(model: type[BaseModel]) -> dict[str, str]:
    """The request model's fields that fill a sampling field of another name, by that name (``n`` fills
    ``num_outputs_per_prompt``)."""
    return {marker.name: name for name, marker in sampled(model).items() if marker.name is not None}


def sampling_fields(body: BaseModel) -> dict[str, Any]:
    """The `OmniDiffusionSamplingParams` fields that the request's `Sampling` fields give, ``extra_args`` with the
    extensions the request set."""
    fields: dict[str, Any] = {}
    extra_args: dict[str, Any] = {}
    for name, marker in sampled(type(body)).items():
        value = getattr(body, name)
        if not marker.extra_args:
            fields[marker.name or name] = value
        elif value is not None:  # unset: left out, so the pipeline call keeps its own default
            extra_args[marker.name or name] = value
    return {**fields, "extra_args": extra_args}


@dataclass(frozen=True)
class Ignored:
    """What makes a request field one of OpenAI's that has no effect on this server (``Annotated[T, Ignored(why)]``):
    accepted so that clients that send it work, and, when a request sets it, reported as every field the model would
    not use is (the ``Warning`` header, the log line and ``vllm_omni:ignored_fields_total``), or refused under
    ``--strict-fields`` (docs/serving.md, "Ignored fields")."""

    reason: str
    """Why it changes nothing here: the ``Warning``'s text, and the refusal's under ``--strict-fields``."""


@functools.cache
def _ignored(model: type[BaseModel]) -> dict[str, Ignored]:
    return {
        name: marker
        for name, info in model.model_fields.items()
        for marker in info.metadata
        if isinstance(marker, Ignored)
    }


def ignored_fields(body: BaseModel) -> list[IgnoredField]:
    """The request's `Ignored` fields that it set (to anything but null), named as the API names them."""
    return [
        IgnoredField(name, marker.reason)
        for name, marker in _ignored(type(body)).items()
        if name in body.model_fields_set and getattr(body, name) is not None
    ]
