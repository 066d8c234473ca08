"""The local diffusers folder a `ModelSource` names, made once on the driver so that every stage and Ray replica
loads the same files: the folder itself, a Hugging Face snapshot (fetched through the hub cache, only what the
stages load), or a single-file checkpoint (local, or fetched from a repo) converted into a diffusers folder (kept while
the file is unchanged). A GGUF file is not converted: its folder links to it (`vllm_omni.diffusion.features.gguf`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

from vllm_omni.config.model_source import ModelSource, ModelSourceError, is_gguf_type, split_hub_file
from vllm_omni.config.vllm_device import set_device_hint
from vllm_omni.diffusion.engine.roles import ROLES
from vllm_omni.diffusion.features.gguf import GGUF_SUFFIX, GgufError, check_gguf_file, link_gguf_denoiser
from vllm_omni.diffusion.pipeline.components import DENOISERS
from vllm_omni.diffusion.pipeline.runner import read_model_index
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.ckpt", "*.pt", "*.pth", "*.gguf", "*.onnx", "*.msgpack", "*.h5")
"""Weight files: what a full single-file checkpoint replaces in the repo that supplies its configs."""


def local_model_folder(source: ModelSource, stage_types: Iterable[str], trust_remote_code: bool = False) -> str:
    """The diffusers folder to load for a deployment of ``stage_types``; downloads and converts as needed.
    ``trust_remote_code``: a stage trusts the repo's own code (diffusers imports its pipeline class to download)."""
    if source.kind == "folder":
        return source.model
    if source.kind == "repo":
        skips = {ROLES[stage_type].skips for stage_type in stage_types if stage_type in ROLES}  # not llm stages
        return hub_snapshot(source.model, source, skips or {()}, trust_remote_code)
    if source.kind == "hub_file":
        return single_file_folder(source, hub_file(source))
    return single_file_folder(source)


def hub_snapshot(
    repo_id: str, source: ModelSource, skips: Iterable[tuple[str, ...]], trust_remote_code: bool = False
) -> str:
    """The snapshot folder of ``repo_id`` at ``source.revision`` in the hub cache, holding at least the components
    each stage loads (one ``skips`` tuple per stage). Every stage is pinned to the same commit. A repo whose
    pipeline class is its own code downloads only with ``trust_remote_code`` (diffusers imports that class to
    learn its components)."""
    from diffusers import DiffusionPipeline
    from huggingface_hub import constants, resolve_revision

    where: dict[str, Any] = dict(
        cache_dir=source.download_dir, token=source.hf_token, local_files_only=constants.HF_HUB_OFFLINE
    )
    with _hub_errors(repo_id, source):
        revision = resolve_revision(repo_id, revision=source.revision, **where)
        for skipped in sorted(set(skips)):
            # diffusers fetches only the pipeline's own files, one weight format per component, none of the
            # components passed in (here: None for those the stage skips).
            try:
                folder = DiffusionPipeline.download(
                    repo_id, revision=revision, trust_remote_code=trust_remote_code, **where, **dict.fromkeys(skipped)
                )
            except ValueError:
                if not trust_remote_code:
                    _refuse_untrusted_pipeline(repo_id, source)
                raise
    folder = os.fspath(folder)
    logger.info("Model %s at revision %s: %s", repo_id, source.revision or "main", folder)
    return folder


@contextlib.contextmanager
def _hub_errors(repo_id: str, source: ModelSource) -> Iterator[None]:
    """Hub failures as one `ModelSourceError` that names the repo, the revision and the reason."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    what = f"model {repo_id!r} at revision {source.revision or 'main'!r}"
    revision_flag = f" --revision {source.revision}" if source.revision else ""
    cache = source.download_dir or constants.HF_HUB_CACHE
    try:
        yield
    except Exception as exc:
        causes: list[BaseException] = []
        link: BaseException | None = exc
        while link is not None and link not in causes:
            causes.append(link)
            link = link.__cause__ or link.__context__
        for cause in causes:
            if isinstance(cause, GatedRepoError):
                reason = (
                    f"the repo is gated: accept its conditions on {constants.ENDPOINT}/{repo_id}, then give "
                    "--hf-token (or set HF_TOKEN) for an account that did"
                )
            elif isinstance(cause, RevisionNotFoundError):
                reason = "the repo has no such revision (a branch, tag or commit)"
            elif isinstance(cause, RemoteEntryNotFoundError):
                hub_file = split_hub_file(source.model)
                missing = hub_file[1] if hub_file and hub_file[0] == repo_id else "a file the model needs"
                reason = f"the repo has no {missing} at this revision"
            elif isinstance(cause, RepositoryNotFoundError):
                reason = f"no such repo on {constants.ENDPOINT} (a private one needs --hf-token or HF_TOKEN)"
            elif isinstance(cause, LocalTokenNotFoundError):
                reason = "--hf-token was given without a value and no token is saved (run `hf auth login`)"
            elif isinstance(cause, (LocalEntryNotFoundError, RevisionResolutionError)):
                reason = (
                    f"it is not in the Hugging Face cache {cache} and HF_HUB_OFFLINE=1 forbids downloading: "
                    f"download it first (`hf download {repo_id}{revision_flag}`) or unset HF_HUB_OFFLINE"
                    if constants.HF_HUB_OFFLINE
                    else f"the Hub cannot be reached and it is not in the Hugging Face cache {cache} ({cause})"
                )
            elif isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                reason = f"the disk is full: free space in {cache} or give --download-dir on a larger disk"
            else:
                continue
            raise ModelSourceError(f"{what}: {reason}") from causes[0]
        raise


def hub_file(source: ModelSource) -> str:
    """The local path of ``source.model``'s file in its repo (``org/name:FILE``), downloaded into the hub cache; a
    GGUF quantization type names the repo's one ``.gguf`` of that type (``...-Q4_0.gguf``), as in vLLM."""
    from huggingface_hub import HfApi, constants, hf_hub_download, resolve_revision

    found = split_hub_file(source.model)
    assert found is not None, f"{source.model} names no file in a repo"  # the caller checked
    repo_id, file = found
    where: dict[str, Any] = dict(
        cache_dir=source.download_dir, token=source.hf_token, local_files_only=constants.HF_HUB_OFFLINE
    )
    with _hub_errors(repo_id, source):
        revision = resolve_revision(repo_id, revision=source.revision, **where)
        if is_gguf_type(file):
            if constants.HF_HUB_OFFLINE:  # what the cache holds of that commit
                snapshot = os.path.join(_repo_cache(repo_id, source), "snapshots", revision.resolved)
                names = [os.path.relpath(p, snapshot) for p in glob.glob(f"{snapshot}/**/*", recursive=True)]
            else:
                names = HfApi().list_repo_files(repo_id, revision=revision.resolved, token=source.hf_token)
            file = _gguf_of_type(source, names, file)
        path = hf_hub_download(repo_id, file, revision=revision, **where)
    logger.info("Model %s at revision %s: %s", source.model, source.revision or "main", path)
    return path


def _gguf_of_type(source: ModelSource, names: list[str], qtype: str) -> str:
    from huggingface_hub import constants

    suffixes = tuple(f"{sep}{qtype}{GGUF_SUFFIX}".lower() for sep in ("-", "_", "."))
    found = sorted(n for n in names if n.lower().endswith(suffixes) or os.path.basename(n).lower() == suffixes[0][1:])
    if len(found) != 1:
        ggufs = sorted(n for n in names if n.endswith(GGUF_SUFFIX))
        raise ModelSourceError(
            f"model {source.model!r} at revision {source.revision or 'main'!r}: the repo "
            f"{'as the Hugging Face cache holds it (HF_HUB_OFFLINE=1) ' if constants.HF_HUB_OFFLINE else ''}has "
            f"{'no' if not found else len(found)} .gguf file{'' if len(found) == 1 else 's'} of type {qtype} "
            f"({', '.join(found or ggufs) or 'no .gguf files at all'}); name the file: org/name:FILE.gguf"
        )
    return found[0]


def _repo_cache(repo_id: str, source: ModelSource) -> str:
    from huggingface_hub import constants

    return os.path.join(source.download_dir or constants.HF_HUB_CACHE, f"models--{repo_id.replace('/', '--')}")


def single_file_folder(source: ModelSource, path: str | None = None) -> str:
    """A diffusers folder made once from the single-file checkpoint ``path`` (default: ``source.model``): the whole
    pipeline when the file holds one (SD, SDXL, SD3 files hold their VAE), else the repo's pipeline with the file as
    its denoiser; a GGUF file stays as it is, linked from the denoiser's subfolder."""
    import diffusers
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    path = path or source.model
    model_type, whole, dtype = _inspect_checkpoint(source, path)
    base = source.model_config
    if base is None:
        if model_type not in DIFFUSERS_DEFAULT_PIPELINE_PATHS:
            raise ModelSourceError(
                f"model {source.model!r}: diffusers cannot tell which model this checkpoint is, so it cannot infer "
                "its configs; give --model-config with the diffusers folder or repo id of its base model"
            )
        base = DIFFUSERS_DEFAULT_PIPELINE_PATHS[model_type]["pretrained_model_name_or_path"]
        logger.info("Single-file checkpoint %s looks like %s; configs from %s", source.model, model_type, base)
    # --revision is MODEL's: for a file in a repo, that repo's; the base is read at its main branch.
    base_source = dataclasses.replace(source, revision=None) if source.kind == "hub_file" else source
    try:
        if os.path.isdir(base):
            base_folder = base
        elif whole:
            base_folder = _config_snapshot(base, base_source)
        else:
            denoisers = tuple(_denoisers(read_model_index_of(base, base_source)))
            base_folder = hub_snapshot(base, base_source, [denoisers])  # all but the denoiser: the file replaces it
            _fetch_configs(base, base_source, base_folder, denoisers)  # ... and its config, which the file lacks
    except ModelSourceError as exc:
        if source.model_config is not None:
            raise
        raise ModelSourceError(
            f"model {source.model!r}: diffusers takes this {model_type} checkpoint's configs from {exc}; or give "
            "--model-config with the diffusers folder or repo id of its base model"
        ) from exc
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{os.path.abspath(base_folder)}"
    key += f"|{diffusers.__version__}"
    folder = os.path.join(_vllm_cache_root(), "omni", "single-file", hashlib.sha256(key.encode()).hexdigest()[:24])
    if os.path.isfile(os.path.join(folder, "model_index.json")):
        logger.info("Single-file checkpoint %s: using its diffusers folder %s", source.model, folder)
        return folder
    return _convert_once(source, path, base_folder, whole, dtype, folder)


def _inspect_checkpoint(source: ModelSource, path: str) -> tuple[str, bool, Any]:
    """What a single-file checkpoint is: the model type diffusers infers (``GGUF`` for a GGUF file, checked), whether
    it holds the whole pipeline (its VAE's keys), and the dtype of its weights (``None`` for a GGUF file)."""
    import torch
    from diffusers.loaders.single_file_utils import (
        LDM_VAE_KEYS,
        infer_diffusers_model_type,
        load_single_file_checkpoint,
    )

    if path.endswith(GGUF_SUFFIX):  # the denoiser alone; ModelSource asked for its base (--model-config)
        try:
            check_gguf_file(path)
        except GgufError as exc:
            raise ModelSourceError(f"model {source.model!r}: {exc}") from exc
        return "GGUF", False, None
    checkpoint = load_single_file_checkpoint(path, local_files_only=True)
    model_type = infer_diffusers_model_type(checkpoint)
    whole = any(key.startswith(tuple(LDM_VAE_KEYS)) for key in checkpoint)
    dtype = next((t.dtype for t in checkpoint.values() if torch.is_floating_point(t)), torch.float32)
    del checkpoint  # from_single_file reads the file again; a large one should not be held twice
    return model_type, whole, dtype


def _convert_once(source: ModelSource, path: str, base_folder: str, whole: bool, dtype: Any, folder: str) -> str:
    """``folder``, converted from the checkpoint into a partial folder of this process and moved into place (one
    that another process converted meanwhile is kept)."""
    partial = f"{folder}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        _convert(source, path, base_folder, whole, dtype, partial)
        os.replace(partial, folder)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "model_index.json")):
            raise
        logger.info("Single-file checkpoint %s was converted meanwhile by another process (%s)", source.model, exc)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written stays behind
        raise
    logger.info("Single-file checkpoint %s converted to the diffusers folder %s", source.model, folder)
    return folder


def _convert(source: ModelSource, path: str, base_folder: str, whole: bool, dtype, into: str) -> None:
    """Write the diffusers folder of the checkpoint ``path`` into ``into``: a whole pipeline's components, or the
    denoiser (a GGUF one: its config and a link to the file) with links to the base's other components."""
    components = read_model_index(base_folder)
    denoisers = _denoisers(components)
    if not whole and len(denoisers) != 1:
        raise ModelSourceError(
            f"model {source.model!r}: it holds one denoiser, and its base {base_folder!r} has {len(denoisers)} "
            f"({', '.join(denoisers)}); serve the diffusers folder or repo instead"
        )
    if whole:
        _save_converted(source, path, base_folder, components["_class_name"], None, dtype, into)
        return
    if path.endswith(GGUF_SUFFIX):
        link_gguf_denoiser(path, os.path.join(base_folder, denoisers[0]), os.path.join(into, denoisers[0]))
    else:
        _save_converted(source, path, base_folder, components[denoisers[0]][1], denoisers[0], dtype, into)
    for other in components:  # the base's own files: linked, not copied
        if other != denoisers[0] and os.path.isdir(os.path.join(base_folder, other)):
            os.symlink(os.path.realpath(os.path.join(base_folder, other)), os.path.join(into, other))
    shutil.copyfile(os.path.join(base_folder, "model_index.json"), os.path.join(into, "model_index.json"))


def _fetch_configs(repo_id: str, source: ModelSource, snapshot: str, components: Iterable[str]) -> None:
    """Each of ``components``' ``config.json`` into ``snapshot`` (a commit's folder in the hub cache)."""
    from huggingface_hub import constants, hf_hub_download

    with _hub_errors(repo_id, source):
        for name in components:
            hf_hub_download(
                repo_id,
                f"{name}/config.json",
                revision=os.path.basename(snapshot),  # the snapshot's commit
                cache_dir=source.download_dir,
                token=source.hf_token,
                local_files_only=constants.HF_HUB_OFFLINE,
            )


def _denoisers(index: dict) -> list[str]:
    """The denoisers a ``model_index.json`` names (not an optional one it leaves empty: Wan 2.1's ``transformer_2``)."""
    return [name for name in DENOISERS if isinstance(index.get(name), list) and index[name][0] is not None]


def _save_converted(
    source: ModelSource, path: str, base_folder: str, what: str, denoiser: str | None, dtype, into: str
) -> None:
    """Save the checkpoint ``path`` as ``what`` in diffusers' layout: the whole pipeline (``denoiser`` ``None``),
    or the one denoiser into its subfolder."""
    import diffusers

    try:
        if denoiser is None:
            pipeline = getattr(diffusers, what).from_single_file(
                path, config=base_folder, torch_dtype=dtype, local_files_only=True
            )
            pipeline.save_pretrained(into)
            return
        model = getattr(diffusers, what).from_single_file(
            path, config=base_folder, subfolder=denoiser, torch_dtype=dtype, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001 - diffusers raises anything from KeyError to RuntimeError here
        raise ModelSourceError(
            f"model {source.model!r}: diffusers could not load it as {what} with the configs of {base_folder!r} "
            f"({type(exc).__name__}: {exc}); check that --model-config names its base model"
        ) from exc
    model.save_pretrained(os.path.join(into, denoiser))


def _refuse_untrusted_pipeline(repo_id: str, source: ModelSource) -> None:
    """When ``repo_id``'s pipeline class is its own code, which diffusers refused to run, say so naming the flag
    (diffusers' error names only its Python keyword); else return, for the caller to raise what failed."""
    index = read_model_index_of(repo_id, source)  # fetched already by the download that failed
    if isinstance(index.get("_class_name"), list):
        module, cls = index["_class_name"]
        raise ModelSourceError(
            f"model {repo_id!r} at revision {source.revision or 'main'!r}: its pipeline class {cls} is the repo's own "
            f"code ({module}.py), which runs only when you trust it: read it, then give --trust-remote-code (vllm "
            "serve) or trust_remote_code=True (Omni)"
        )


def read_model_index_of(repo_id: str, source: ModelSource) -> dict:
    """A repo's ``model_index.json``, fetched alone."""
    from huggingface_hub import constants, hf_hub_download

    with _hub_errors(repo_id, source):
        path = hf_hub_download(
            repo_id,
            "model_index.json",
            revision=source.revision,
            cache_dir=source.download_dir,
            token=source.hf_token,
            local_files_only=constants.HF_HUB_OFFLINE,
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _config_snapshot(repo_id: str, source: ModelSource) -> str:
    """The configs, tokenizers and scheduler of ``repo_id``, without weights (a whole checkpoint has its own)."""
    from huggingface_hub import constants, snapshot_download

    with _hub_errors(repo_id, source):
        return snapshot_download(
            repo_id,
            revision=source.revision,
            cache_dir=source.download_dir,
            token=source.hf_token,
            local_files_only=constants.HF_HUB_OFFLINE,
            ignore_patterns=list(_WEIGHT_PATTERNS),
        )


def _vllm_cache_root() -> str:
    set_device_hint()
    import vllm.envs

    return vllm.envs.VLLM_CACHE_ROOT
