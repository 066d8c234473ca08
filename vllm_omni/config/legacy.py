"""The deprecated batch-size aliases, in one place.

``diffusion_batch_size`` (a Python keyword and a YAML key) and the YAML key
``runtime: {max_batch_size: N}`` once overwrote ``max_num_seqs`` with 1. They are
accepted only here, at the public edge: each one warns (``FutureWarning`` naming
``max_num_seqs``, plus one log line) and then acts as ``max_num_seqs`` at the layer
where it was written. Nothing past this module knows they exist.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Any

from vllm_omni.logger import init_logger

logger = init_logger(__name__)

ALIAS = "diffusion_batch_size"
YAML_RUNTIME_KEY = "runtime"
YAML_RUNTIME_ALIAS = "max_batch_size"
REMOVAL_VERSION = "0.3.0"
"""The release that deletes this module; a test fails once the package version reaches it."""

_PACKAGE_PREFIX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""Frames in files under this prefix are vllm_omni's own: the warning points at the first caller outside them."""


def _warn(message: str) -> None:
    logger.warning(message)
    if sys.version_info >= (3, 12):
        warnings.warn(message, FutureWarning, skip_file_prefixes=(_PACKAGE_PREFIX,))
    else:  # Python < 3.12 has no skip_file_prefixes: count vllm_omni's frames by hand. Drop with Python 3.11.
        frame: FrameType | None = sys._getframe()
        level = 1  # level 1 is this function, in the package
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_PREFIX):
            frame, level = frame.f_back, level + 1
        warnings.warn(message, FutureWarning, stacklevel=level)


def _deprecation_message(old: str, where: str) -> str:
    return (
        f"{old} ({where}) is deprecated and will be removed in vllm-omni {REMOVAL_VERSION}; "
        f"use max_num_seqs instead. It is applied as max_num_seqs."
    )


def pop_python_alias(kwargs: dict[str, Any], max_num_seqs: int | None) -> tuple[int | None, bool]:
    """Take ``diffusion_batch_size`` out of ``kwargs`` (Omni/AsyncOmni keywords).

    Returns ``(max_num_seqs, from_alias)``: the value to use at the Python layer and
    whether the alias supplied it.
    """
    if ALIAS not in kwargs:
        return max_num_seqs, False
    value = kwargs.pop(ALIAS)
    if max_num_seqs is not None and max_num_seqs != value:
        raise ValueError(
            f"{ALIAS}={value!r} and max_num_seqs={max_num_seqs!r} were both given with different values; "
            f"{ALIAS} is a deprecated alias of max_num_seqs: pass max_num_seqs only."
        )
    _warn(_deprecation_message(f"The keyword {ALIAS}={value!r}", "Omni/AsyncOmni argument"))
    if max_num_seqs is not None:
        return max_num_seqs, False
    return value, True


def pop_yaml_aliases(stage: dict[str, Any], where: str) -> tuple[dict[str, Any], set[str]]:
    """Rewrite the legacy keys of one YAML stage mapping into ``max_num_seqs``.

    ``where`` names the file and stage for messages. Returns the rewritten mapping
    (a copy) and the keys of it that an alias supplied.
    """
    stage = dict(stage)
    aliases: dict[str, Any] = {}
    if ALIAS in stage:
        aliases[ALIAS] = stage.pop(ALIAS)
    runtime = stage.get(YAML_RUNTIME_KEY)
    if isinstance(runtime, dict) and YAML_RUNTIME_ALIAS in runtime:
        runtime = dict(runtime)
        aliases[f"{YAML_RUNTIME_KEY}.{YAML_RUNTIME_ALIAS}"] = runtime.pop(YAML_RUNTIME_ALIAS)
        if runtime:
            unknown = ", ".join(f"{YAML_RUNTIME_KEY}.{k}" for k in runtime)
            raise ValueError(
                f"unknown key(s) {unknown} in {where}; the legacy runtime block may hold only max_batch_size"
            )
        del stage[YAML_RUNTIME_KEY]
    if not aliases:
        return stage, set()

    written = {**aliases, **{k: v for k, v in stage.items() if k == "max_num_seqs"}}
    if len(set(map(repr, written.values()))) > 1:
        given = ", ".join(f"{k}={v!r}" for k, v in written.items())
        raise ValueError(f"conflicting batch sizes in {where}: {given}; keep max_num_seqs only.")
    for key, value in aliases.items():
        _warn(_deprecation_message(f"The YAML key {key}: {value!r}", where))
    if "max_num_seqs" in stage:
        return stage, set()
    return {**stage, "max_num_seqs": next(iter(aliases.values()))}, {"max_num_seqs"}
