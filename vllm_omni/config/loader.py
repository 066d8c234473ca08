"""Read a deploy YAML into a `DeployConfig`: flat per-stage keys, unknown keys are errors."""

from __future__ import annotations

import os
from typing import Any

import yaml
from pydantic import ValidationError

from vllm_omni.config.legacy import pop_yaml_aliases
from vllm_omni.config.stage import YAML_STAGE_KEYS, DeployConfig, Source, StageDeployConfig


def load_deploy_config(path: str | os.PathLike[str]) -> DeployConfig:
    """Parse and validate ``path``; every error names the file, the stage and the key."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"deploy config not found: {path} (given as deploy_config / --deploy-config)") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"deploy config {path} is not valid YAML: {exc}") from None

    if not isinstance(document, dict) or "stages" not in document:
        raise ValueError(f"deploy config {path} must be a mapping with a 'stages' list")
    unknown = sorted(set(document) - {"stages"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown} in {path}; the only top-level key is 'stages'")
    if not isinstance(document["stages"], list):
        raise ValueError(f"'stages' in {path} must be a list of stage mappings")

    stages = [_load_stage(raw, index, path) for index, raw in enumerate(document["stages"])]
    try:
        return DeployConfig(stages=stages)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, path)) from None


def _load_stage(raw: Any, index: int, path: str) -> StageDeployConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"stage #{index} in {path} must be a mapping, got {type(raw).__name__}")
    where = f"stage {raw.get('stage_id', index)} of {path}"
    if "provenance" in raw:
        raise ValueError(f"unknown key 'provenance' in {where}: provenance is recorded by vllm-omni, not configured")
    raw, alias_keys = pop_yaml_aliases(raw, where)
    provenance: dict[str, Source] = {key: "legacy_alias" if key in alias_keys else "deploy_yaml" for key in raw}
    try:
        return StageDeployConfig(**raw, provenance=provenance)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, where)) from None


def describe_validation_error(exc: ValidationError, where: str) -> str:
    """One readable line per problem, each naming the key, the value and ``where`` it was written."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r} in {where}; allowed keys: {', '.join(YAML_STAGE_KEYS)}")
        elif err["type"] == "value_error":  # our own validators: the message names the problem
            lines.append(f"invalid {key} in {where}: {err['ctx']['error']}")
        else:
            lines.append(f"invalid {key}={err.get('input')!r} in {where}: {err['msg']}")
    return "; ".join(lines)
