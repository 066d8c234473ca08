"""`ModelSource`: where the served model comes from (a diffusers folder, a Hugging Face repo id, or a single-file
checkpoint), with vLLM's hub flags; checked at construction, before anything is read or downloaded.

`vllm_omni.diffusion.model_files` turns it into the local diffusers folder every stage loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")
"""Checkpoint files diffusers' ``from_single_file`` reads."""

ModelKind = Literal["folder", "repo", "single_file"]


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


def kind_of(name: str, flag: str) -> ModelKind:
    """What ``name`` is: a local folder, a single-file checkpoint, or (if no such path exists) a repo id."""
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "model_index.json")):
            raise ValueError(f"{flag} {name!r} is a folder but not a diffusers folder: it has no model_index.json")
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
    raise ValueError(
        f"{flag} {name!r} is neither a local diffusers folder, a single-file checkpoint "
        f"({', '.join(SINGLE_FILE_SUFFIXES)}) nor a Hugging Face repo id (org/name): no such path"
    )


@dataclass(frozen=True)
class ModelSource:
    """The model a deployment serves and how to fetch it; the flags are vLLM's (docs/serving.md, Model sources)."""

    model: str
    """A local diffusers folder, a Hugging Face repo id (``org/name``), or a single-file checkpoint."""

    revision: str | None = None
    """Branch, tag or commit of a repo id (``--revision``); ``None``: ``main``."""

    download_dir: str | None = None
    """Hugging Face cache directory to download into and load from (``--download-dir``); ``None``: ``HF_HUB_CACHE``."""

    hf_token: str | bool | None = None
    """Hub token (``--hf-token``); ``True``: the one ``hf auth login`` saved; ``None``: ``HF_TOKEN`` or that one."""

    model_config: str | None = None
    """For a single-file checkpoint: the diffusers folder or repo id that supplies the configs and the components
    the file lacks (``--model-config``); ``None``: the repo diffusers infers from the file's keys."""

    def __post_init__(self):
        object.__setattr__(self, "model", os.fspath(self.model))
        kind = kind_of(self.model, "model")
        if self.model_config is not None:
            if kind != "single_file":
                raise ValueError(
                    f"model_config (--model-config) is for a single-file checkpoint; model {self.model!r} is a "
                    f"{'diffusers folder' if kind == 'folder' else 'repo id'}, which has its own configs: remove it"
                )
            if kind_of(self.model_config, "model_config (--model-config)") == "single_file":
                raise ValueError(
                    f"model_config (--model-config) {self.model_config!r} is a checkpoint file; give the diffusers "
                    "folder or repo id that supplies the configs"
                )
        uses_hub = kind == "repo" or (kind == "single_file" and self.model_config_kind != "folder")
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
    def model_config_kind(self) -> ModelKind | None:
        """What `model_config` is, if given."""
        return None if self.model_config is None else kind_of(self.model_config, "model_config (--model-config)")
