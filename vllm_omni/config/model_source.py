"""`ModelSource`: where the served model comes from (a diffusers folder, a Hugging Face repo id, or a single-file
checkpoint, local or in a repo), with vLLM's hub flags; checked at construction, before anything is read or
downloaded.

`vllm_omni.model_sources.files` turns it into the local diffusers folder every stage loads.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".gguf")
"""Checkpoint files diffusers' ``from_single_file`` reads (a ``.gguf`` one with its ``GGUFQuantizationConfig``)."""

ModelKind = Literal["folder", "repo", "single_file", "hub_file"]
"""``hub_file``: a single-file checkpoint in a Hugging Face repo, ``org/name:FILE`` (see `split_hub_file`)."""

_GGUF_TYPE = re.compile(r"(?:[IT]?Q[0-9][0-9A-Z_]*|BF16|F16|F32)", re.IGNORECASE)
"""A GGUF quantization type as vLLM's ``repo_id:quant_type`` names one (``Q8_0``, ``Q4_K_M``, ``IQ2_XS``, ``F16``)."""


class ModelSourceError(ValueError):
    """The model cannot be fetched or read; the message names the model, its revision and the reason."""


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a valid Hugging Face repo id (``org/name`` or ``name``); says nothing of the Hub."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not os.path.isabs(name) and not name.startswith(".")


def split_hub_file(name: str) -> tuple[str, str] | None:
    """``(repo_id, file)`` of ``org/name:FILE``, a checkpoint in a Hugging Face repo: FILE is its path in the repo
    (a ``.safetensors``, ``.ckpt`` or ``.gguf``), or, as in vLLM's ``repo_id:quant_type``, a GGUF quantization type
    that names the repo's one ``.gguf`` of that type (``org/name:Q4_0`` → ``...-Q4_0.gguf``). ``None``: not of that
    form (nothing of the Hub is asked)."""
    repo, colon, file = name.partition(":")
    if not colon or not file or not is_repo_id(repo) or not (file.endswith(SINGLE_FILE_SUFFIXES) or is_gguf_type(file)):
        return None
    return repo, file


def is_gguf_type(name: str) -> bool:
    """Whether ``name`` is a GGUF quantization type (``Q8_0``, ``Q4_K_M``, ...), not a file name."""
    return _GGUF_TYPE.fullmatch(name) is not None


def is_gguf_model(name: str) -> bool:
    """Whether the model ``name`` (MODEL, as `ModelSource` takes it) is a GGUF file: a local ``.gguf``, or
    ``org/name:FILE.gguf`` / ``org/name:QUANT_TYPE``."""
    if os.path.exists(name):
        return name.endswith(".gguf")
    hub_file = split_hub_file(name)
    return hub_file is not None and (hub_file[1].endswith(".gguf") or is_gguf_type(hub_file[1]))


def kind_of(name: str, flag: str) -> ModelKind:
    """What ``name`` is: a local folder, a single-file checkpoint, or (if no such path exists) a repo id or a file in
    one (``org/name:FILE``)."""
    if os.path.isdir(name):
        if not any(os.path.isfile(os.path.join(name, index)) for index in ("model_index.json", "config.json")):
            raise ValueError(
                f"{flag} {name!r} is a folder but neither a diffusers folder (model_index.json) nor a transformers "
                "one (config.json: a speech model's talker)"
            )
        return "folder"
    if os.path.isfile(name):
        if not name.endswith(SINGLE_FILE_SUFFIXES):
            raise ValueError(
                f"{flag} {name!r} is a file but not a single-file checkpoint: give a "
                f"{' or '.join(SINGLE_FILE_SUFFIXES)} file, a diffusers folder or a Hugging Face repo id"
            )
        return "single_file"
    if is_repo_id(name):
        return "repo"
    if split_hub_file(name):
        return "hub_file"
    repo, colon, file = name.partition(":")
    if colon and is_repo_id(repo):
        raise ValueError(
            f"{flag} {name!r} names {file!r} in the Hugging Face repo {repo!r}, which is not a single-file "
            f"checkpoint: give its path in the repo ({', '.join(SINGLE_FILE_SUFFIXES)}) or a GGUF quantization type "
            "(org/name:Q8_0)"
        )
    raise ValueError(
        f"{flag} {name!r} is neither a local diffusers folder, a single-file checkpoint "
        f"({', '.join(SINGLE_FILE_SUFFIXES)}), a Hugging Face repo id (org/name) nor a file in one "
        "(org/name:FILE): no such path"
    )


@dataclass(frozen=True)
class ModelSource:
    """The model a deployment serves and how to fetch it; the flags are vLLM's (docs/serving.md, Model sources)."""

    model: str
    """A local diffusers folder, a Hugging Face repo id (``org/name``), or a single-file checkpoint: a local file or
    one in a repo (``org/name:FILE``, ``org/name:QUANT_TYPE`` for a GGUF)."""

    revision: str | None = None
    """Branch, tag or commit of a repo id (``--revision``); ``None``: ``main``."""

    download_dir: str | None = None
    """Hugging Face cache directory to download into and load from (``--download-dir``); ``None``: ``HF_HUB_CACHE``."""

    hf_token: str | bool | None = None
    """Hub token (``--hf-token``); ``True``: the one ``hf auth login`` saved; ``None``: ``HF_TOKEN`` or that one."""

    model_config: str | None = None
    """For a single-file checkpoint: the diffusers folder or repo id that supplies the configs and the components
    the file lacks (``--model-config``); ``None``: the repo diffusers infers from the file's keys. Required for a
    GGUF file, which holds the denoiser alone."""

    def __post_init__(self):
        object.__setattr__(self, "model", os.fspath(self.model))
        kind = kind_of(self.model, "model")
        if self.model_config is None and self.is_gguf:
            raise ValueError(
                f"model {self.model!r} is a GGUF file, which holds the denoiser alone: give --model-config "
                "(model_config) with the diffusers folder or repo id of its base model, which supplies the configs "
                "and the other components"
            )
        if self.model_config is not None:
            if kind not in ("single_file", "hub_file"):
                raise ValueError(
                    f"model_config (--model-config) is for a single-file checkpoint; model {self.model!r} is a "
                    f"{'diffusers folder' if kind == 'folder' else 'repo id'}, which has its own configs: remove it"
                )
            if kind_of(self.model_config, "model_config (--model-config)") in ("single_file", "hub_file"):
                raise ValueError(
                    f"model_config (--model-config) {self.model_config!r} is a checkpoint file; give the diffusers "
                    "folder or repo id that supplies the configs"
                )
        uses_hub = kind in ("repo", "hub_file") or (kind == "single_file" and self.model_config_kind != "folder")
        for name, flag in (("revision", "--revision"), ("download_dir", "--download-dir"), ("hf_token", "--hf-token")):
            if getattr(self, name) is not None and not uses_hub:
                raise ValueError(
                    f"{name} ({flag}) applies to a Hugging Face repo id, and nothing here comes from the Hub "
                    f"(model {self.model!r} is a local {kind.replace('_', '-')}): remove it"
                )

    @property
    def kind(self) -> ModelKind:
        """What `model` is."""
        return kind_of(self.model, "model")

    @property
    def is_gguf(self) -> bool:
        """Whether `model` is a GGUF file (local or in a repo): its denoiser loads with diffusers'
        ``GGUFQuantizationConfig``, and the stages' ``quantization`` is ``gguf``."""
        return is_gguf_model(self.model)

    @property
    def model_config_kind(self) -> ModelKind | None:
        """What `model_config` is, if given."""
        return None if self.model_config is None else kind_of(self.model_config, "model_config (--model-config)")
