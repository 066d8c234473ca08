"""The keys of an ``llm`` stage: the LLM it runs on vLLM's engine, and how it rewrites a request's prompt.

``engine_args`` and ``sampling`` are checked against vLLM's own ``EngineArgs`` and ``SamplingParams`` (of the
vLLM in this process), so an unknown key is refused by name before anything starts. The stage's knobs that vLLM
also has are not repeated here: ``max_num_seqs`` and ``scheduling_policy`` are the stage's, and go to vLLM as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import string
from collections.abc import Callable, Mapping
from typing import Any, Literal

from vllm_omni.config.vllm_device import set_device_hint

LlmMode = Literal["chat", "completion", "tts"]
"""How the stage turns a request's prompt into the LLM's input: a chat with ``system_prompt`` through the
tokenizer's chat template, ``prompt_template`` with ``{prompt}`` in it, or (``tts``: the talker of a speech model)
the speech family's own prompt format with the request's voice, its generated code tokens streamed to the ``codec``
stage that takes it."""

_OWNED_ENGINE_ARGS = {
    "max_num_seqs": "the stage's max_num_seqs knob (--max-num-seqs, or max_num_seqs in the stage's YAML), which "
    "goes to vLLM as its max_num_seqs",
    "scheduling_policy": "the stage's scheduling_policy knob (--scheduling-policy, or scheduling_policy in the "
    "stage's YAML), which goes to vLLM as its scheduling_policy",
    "model": "the stage's model key",
    "disable_log_stats": "nothing: the stage's metrics (vllm_omni:batch_num_requests) come from vLLM's scheduler "
    "stats, so they stay on",
    "enable_logging_iteration_details": "nothing: the stage's batch metric (vllm_omni:batch_num_requests) reads "
    "the sequences of each engine step from them, so they stay on",
}
"""``EngineArgs`` fields the stage sets itself, and what sets them instead."""

_OWNED_SAMPLING = {
    "seed": "the request's seed (drawn when it gives none), so that a re-run makes the same prompt",
    "n": "nothing: the stage makes one revised prompt per request",
    "output_kind": "nothing: the stage reads each request's final output",
}
"""``SamplingParams`` fields the stage sets per request."""


@functools.cache
def _engine_arg_names() -> frozenset[str]:
    set_device_hint()
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs))


@functools.cache
def _sampling_names() -> frozenset[str]:
    set_device_hint()
    from vllm import SamplingParams

    return frozenset(SamplingParams.__struct_fields__)


def _check_keys(
    value: Any, knob: str, owner: str, names: Callable[[], frozenset[str]], owned: Mapping[str, str]
) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{knob} must be a mapping of vLLM {owner} fields to values, got {value!r}")
    for key in value:
        if key in owned:
            raise ValueError(f"{knob} must not set {key!r}: it is set by {owned[key]}")
    unknown = sorted(k for k in value if k not in names())
    if unknown:
        raise ValueError(
            f"{knob} has unknown key(s) {', '.join(map(repr, unknown))}: not fields of vLLM's {owner} "
            f"(fields: {', '.join(sorted(names() - owned.keys()))})"
        )
    return dict(value)


def check_engine_args(value: Any) -> dict[str, Any] | None:
    """``engine_args``: vLLM ``EngineArgs`` fields, none of those the stage sets itself."""
    return _check_keys(value, "engine_args", "EngineArgs", _engine_arg_names, _OWNED_ENGINE_ARGS)


def check_sampling(value: Any) -> dict[str, Any] | None:
    """``sampling``: vLLM ``SamplingParams`` fields, none of those the stage sets per request."""
    return _check_keys(value, "sampling", "SamplingParams", _sampling_names, _OWNED_SAMPLING)


def check_llm_stage(stage_id: int, values: Mapping[str, Any], written: Callable[[str], str]) -> None:
    """The keys of an ``llm`` stage together: the prompt keys of its mode, an interpreter that runs (its model and
    backend: `check_stage_keys`)."""
    where = f"stage {stage_id} (llm)"
    if values["mode"] == "tts":
        given = [written(key) for key in ("system_prompt", "prompt_template") if values[key] is not None]
        if given:
            raise ValueError(
                f"{where}: {', '.join(given)}: in mode 'tts' the speech family's own prompt format frames the "
                "text (vllm_omni/codec/families.py); remove them"
            )
    if values["mode"] == "chat" and values["prompt_template"] is not None:
        raise ValueError(
            f"{where}: {written('prompt_template')} is for mode 'completion', but {written('mode')}: in chat mode "
            "the tokenizer's chat template frames the prompt (with system_prompt); remove prompt_template or set "
            "mode to 'completion'"
        )
    if values["mode"] == "completion":
        if values["system_prompt"] is not None:
            raise ValueError(
                f"{where}: {written('system_prompt')} is for mode 'chat', but {written('mode')}: put the "
                "instructions into prompt_template, or set mode to 'chat'"
            )
        try:  # exactly {prompt}: no other field, and no index, attribute, conversion or format spec on it
            fields = [
                f[1:] for f in string.Formatter().parse(values["prompt_template"] or "{prompt}") if f[1] is not None
            ]
        except ValueError:
            fields = []
        if not fields or any(field != ("prompt", "", None) for field in fields):
            raise ValueError(
                f"{where}: {written('prompt_template')} must contain {{prompt}} (where the request's prompt goes) "
                "and no other {field}; write a literal brace as {{ or }}"
            )
    executable = values["python_executable"]
    if executable is not None and not (os.path.isfile(executable) and os.access(executable, os.X_OK)):
        raise ValueError(
            f"{where}: {written('python_executable')} is not an executable file; build the CPU venv with "
            "`make llm-cpu-venv` (then .venv-llm-cpu/bin/python), or leave it unset to run the server's own vLLM"
        )
