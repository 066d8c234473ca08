"""The one resolver of stage knobs. It is the only writer of ``max_num_seqs``.

Precedence, lowest to highest (docs/configuration.md):

1. built-in default (the `StageDeployConfig` field default)
2. the deploy YAML, per stage
3. the global CLI flag / Python keyword, when given
4. ``stage_overrides`` (``--stage-overrides``), per stage
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn

from pydantic import ValidationError

from vllm_omni.config.cache import (
    PER_REQUEST_BACKENDS,
    REFUSED_BACKENDS,
    WHOLE_CALL_BACKENDS,
    cache_hook_config,
    parse_cache_config,
)
from vllm_omni.config.knob import STAGE_TYPES_OF_SCOPE
from vllm_omni.config.llm import check_llm_stage
from vllm_omni.config.loader import load_deploy_config
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.parallel import check_parallel
from vllm_omni.config.quantization import GGUF_SOURCE, check_quantization, is_gguf
from vllm_omni.config.speech import check_speech_graph, speech_deploy
from vllm_omni.config.stage import (
    KNOBS,
    LORA_KNOBS,
    RAY_ONLY_KNOBS,
    STAGE_KNOBS,
    DeployConfig,
    Source,
    StageDeployConfig,
)
from vllm_omni.config.stage_types import STAGE_TYPES, check_stage_keys

GlobalSource = Literal["cli", "python"]

LLM_STAGE_TYPES = STAGE_TYPES_OF_SCOPE["llm"]
ADAPTING_STAGE_TYPES = STAGE_TYPES_OF_SCOPE["lora"]
STAGE_TYPES_OF_KNOB = {
    name: STAGE_TYPES_OF_SCOPE[knob.scope] for name, knob in KNOBS.items() if knob.scope in STAGE_TYPES_OF_SCOPE
}
"""The stage types a knob applies to, for the knobs that do not apply to every stage."""


def _either(names: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _knob_name(knob: str, source: Source) -> str:
    """How the user wrote ``knob`` at ``source``: the flag, the keyword or the key."""
    if source == "cli":
        return "--" + knob.replace("_", "-")
    if source == "python":
        return f"{knob}="
    return knob


def _check_knobs(values: Mapping[str, Any], where: str, source: Source) -> None:
    unknown = [k for k in values if k not in STAGE_KNOBS]
    if unknown:
        names = ", ".join(_knob_name(k, source) for k in unknown)
        allowed = ", ".join(_knob_name(k, source) for k in STAGE_KNOBS)
        raise ValueError(f"unknown stage knob(s) {names} in {where}; allowed: {allowed}")
    try:
        StageDeployConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_knob_name(str(e['loc'][0]), source)} {e.get('input')!r}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"invalid value in {where}: {problems}") from None


def _normalize_overrides(
    stage_overrides: Mapping[int | str, Mapping[str, Any]] | None, stage_ids: list[int]
) -> dict[int, Mapping[str, Any]]:
    normalized: dict[int, Mapping[str, Any]] = {}
    for key, knobs in (stage_overrides or {}).items():
        is_id = (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.isdigit())
        if not is_id:
            raise ValueError(f"stage_overrides key {key!r} is not a stage id; stage ids: {stage_ids}")
        stage_id = int(key)
        if stage_id not in stage_ids:
            raise ValueError(f"stage_overrides names stage {stage_id}, which does not exist; stage ids: {stage_ids}")
        if stage_id in normalized:
            raise ValueError(f"stage_overrides names stage {stage_id} twice (as {key!r} and another key)")
        if not isinstance(knobs, Mapping):
            raise ValueError(f"stage_overrides[{key!r}] must be a mapping of knob to value, got {knobs!r}")
        _check_knobs(knobs, f"stage_overrides for stage {stage_id}", "stage_override")
        normalized[stage_id] = knobs
    return normalized


def resolve_stage_configs(
    deploy: DeployConfig | str | os.PathLike[str] | None = None,
    *,
    global_knobs: Mapping[str, Any] | None = None,
    global_source: GlobalSource = "python",
    global_alias_knobs: frozenset[str] | set[str] = frozenset(),
    stage_overrides: Mapping[int | str, Mapping[str, Any]] | None = None,
    model: ModelSource | None = None,
    codec_model: str | None = None,
) -> list[StageDeployConfig]:
    """Apply the four layers and return one frozen config per stage, with provenance.

    ``deploy`` is a `DeployConfig` or the path of a deploy YAML. ``global_knobs`` holds
    only the knobs the user gave (CLI flags or Python keywords); ``global_alias_knobs``
    names those of them that a deprecated alias supplied. ``model``: the served model, for the knobs it decides
    (a ``.gguf`` file sets ``quantization: gguf``, provenance ``model``); ``None``: not checked against one.
    ``codec_model``: serve ``model`` as the talker of a speech model with this codec (`speech_deploy`), instead of
    a deploy YAML.
    """
    if codec_model is not None:
        if deploy is not None or model is None:
            raise ValueError(
                "codec_model (--codec-model) deploys MODEL as a talker with that codec; a deploy YAML lists its "
                "stages itself (a codec stage's model key): give one or the other"
            )
        deploy = speech_deploy(model.model, codec_model)
    deploy = _as_deploy_config(deploy)
    global_knobs = dict(global_knobs or {})
    _check_knobs(global_knobs, "the command line" if global_source == "cli" else "the Omni arguments", global_source)
    overrides = _normalize_overrides(stage_overrides, [s.stage_id for s in deploy.stages])
    global_sources: dict[str, Source] = {
        k: "legacy_alias" if k in global_alias_knobs else global_source for k in global_knobs
    }
    resolved = [
        _resolve_stage(stage, (global_knobs, global_sources), overrides.get(stage.stage_id, {}), model)
        for stage in deploy.stages
    ]
    _check_lora_stages(resolved, global_knobs, global_source)
    check_speech_graph(resolved)
    if model is not None:
        _check_diffusers_folder(resolved, model)
    return resolved


def _check_diffusers_folder(stages: list[StageDeployConfig], model: ModelSource) -> None:
    """A local folder served by diffusers stages is a diffusers folder; a transformers folder is a talker."""
    folder = model.model if model.kind == "folder" else None
    runs_diffusers = any(STAGE_TYPES[stage.stage_type].runs == "diffusers" for stage in stages)
    if folder is not None and runs_diffusers and not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise ValueError(
            f"model {folder!r} is a folder but not a diffusers folder: it has no model_index.json (a transformers "
            "folder serves as a speech model's talker, with --codec-model)"
        )


def _as_deploy_config(deploy: DeployConfig | str | os.PathLike[str] | None) -> DeployConfig:
    """The deploy layer as a `DeployConfig`: none given is the built-in one, a path is loaded from its YAML."""
    if deploy is None:
        return DeployConfig()
    if not isinstance(deploy, DeployConfig):
        return load_deploy_config(deploy)
    return deploy


def _resolve_stage(
    stage: StageDeployConfig,
    global_layer: tuple[Mapping[str, Any], Mapping[str, Source]],
    stage_override: Mapping[str, Any],
    model: ModelSource | None,
) -> StageDeployConfig:
    """One stage's frozen config: its knobs layered, the knobs that follow from others filled in, then checked
    (alone, together and against ``model``) before anything is built from them."""
    layers: list[tuple[Mapping[str, Any], Mapping[str, Source]]] = [
        (
            {k: getattr(stage, k) for k in stage.model_fields_set},
            {k: stage.provenance.get(k, "deploy_yaml") for k in stage.model_fields_set},
        ),
        global_layer,
        (stage_override, dict.fromkeys(stage_override, "stage_override")),
    ]
    values, provenance = _layer_knobs(stage, layers, global_layer[0])
    if values["distributed_executor_backend"] is None:
        values["distributed_executor_backend"] = _default_executor_backend(stage, values)
    if stage.stage_type in STAGE_TYPES_OF_KNOB["quantization"]:
        _resolve_quantization(stage.stage_id, values, provenance, model)
    _check_combination(stage.stage_id, values, provenance)
    check_parallel(stage.stage_id, values, _writer(values, provenance), _local_folder(model))
    check_stage_keys(stage.stage_type, stage.stage_id, values, _writer(values, provenance))
    if stage.stage_type in LLM_STAGE_TYPES:
        check_llm_stage(stage.stage_id, values, _writer(values, provenance))
    return StageDeployConfig(
        stage_id=stage.stage_id,
        stage_type=stage.stage_type,
        inputs=stage.inputs,
        **values,
        provenance=provenance,
    )


def _layer_knobs(
    stage: StageDeployConfig,
    layers: list[tuple[Mapping[str, Any], Mapping[str, Source]]],
    global_knobs: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Source]]:
    """Each knob's value and provenance: the built-in default, overridden by each layer that sets it, lowest first.
    ``global_knobs`` is the global layer, whose knobs skip the stages they do not apply to instead of failing."""
    values: dict[str, Any] = {}
    provenance: dict[str, Source] = {}
    for knob in STAGE_KNOBS:
        values[knob] = StageDeployConfig.model_fields[knob].get_default(call_default_factory=True)
        provenance[knob] = "default"
        for layer_values, layer_sources in layers:
            if knob not in layer_values:
                continue
            if not _knob_applies(stage, knob):
                if layer_values is global_knobs:  # a global flag sets it on the stages it applies to
                    continue
                _refuse_knob(stage, knob, layer_sources[knob])
            values[knob], provenance[knob] = layer_values[knob], layer_sources[knob]
    return values, provenance


def _knob_applies(stage: StageDeployConfig, knob: str) -> bool:
    """Whether ``knob`` applies to ``stage``'s type (most knobs apply to every stage)."""
    types = STAGE_TYPES_OF_KNOB.get(knob)
    return types is None or stage.stage_type in types


def _refuse_knob(stage: StageDeployConfig, knob: str, source: Source) -> NoReturn:
    """A knob set for a stage it does not apply to is an error, naming where it was set and, for an llm stage,
    where vLLM takes it instead."""
    types = STAGE_TYPES_OF_KNOB[knob]
    why = ""
    if stage.stage_type in LLM_STAGE_TYPES:
        batching = knob in ("request_batch_max_wait_ms", "execution_mode")
        why = " (an llm stage leaves batching to vLLM)" if batching else " (set vLLM's in engine_args)"
    raise ValueError(
        f"stage {stage.stage_id} ({stage.stage_type}): {_knob_name(knob, source)} "
        f"({source}) applies to {' and '.join(types)} stages only{why}; remove it"
    )


def _default_executor_backend(stage: StageDeployConfig, values: Mapping[str, Any]) -> str:
    """The executor backend when no layer set one: Ray where replicas, a Ray cluster or vLLM's engine need it."""
    use_ray = values["num_replicas"] > 1 or values["ray_address"] is not None
    use_ray |= stage.stage_type in LLM_STAGE_TYPES  # vLLM's engine runs in an actor of its own
    return "ray" if use_ray else "inline"


def _check_lora_stages(stages: list[StageDeployConfig], global_knobs: Mapping[str, Any], source: Source) -> None:
    """A LoRA knob given globally must reach a stage: a split pipeline has none that serves adapters."""
    given = [_knob_name(k, source) for k in LORA_KNOBS if k in global_knobs]
    if given and not any(s.stage_type in ADAPTING_STAGE_TYPES for s in stages):
        raise ValueError(
            f"{', '.join(given)} ({source}): LoRA adapters are served by {' and '.join(ADAPTING_STAGE_TYPES)} stages "
            "only, and this deploy splits the pipeline into stages (diffusers loads an adapter into the whole "
            "pipeline at once); serve the model as one diffusion stage for LoRA"
        )


def engine_torch_threads(stage_configs: list[StageDeployConfig]) -> dict[int, int]:
    """Torch threads of each stage's engine threads, by stage id (docs/performance.md): a Ray replica runs its
    ``num_cpus``; the inline stages share this process, so they split its cores evenly (at least one each) and
    their OpenMP teams together never hold more threads than there are cores."""
    inline = sum(s.distributed_executor_backend == "inline" for s in stage_configs)
    share = max(1, len(os.sched_getaffinity(0)) // max(1, inline))
    return {s.stage_id: s.num_cpus if s.distributed_executor_backend == "ray" else share for s in stage_configs}


def knob_as_written(stage: StageDeployConfig, knob: str) -> str:
    """A resolved stage's ``knob`` as the resolver's errors name it: as it was written, its value and its layer
    (``--quantization 'fp8' (cli)``), for the checks made when the stage loads."""
    return _writer({knob: getattr(stage, knob)}, {knob: stage.provenance.get(knob, "default")})(knob)


def _writer(values: Mapping[str, Any], provenance: Mapping[str, Source]) -> Callable[..., str]:
    """How an error names a knob: as it was written, with its value and its layer."""

    def written(knob: str, verb: str = "") -> str:
        return f"{_knob_name(knob, provenance[knob])} {verb}{values[knob]!r} ({provenance[knob]})"

    return written


def check_model(stage_configs: list[StageDeployConfig], model: ModelSource) -> None:
    """Stage configs resolved without ``model`` (``OmniBase.from_stage_configs``) checked against it, as
    `resolve_stage_configs` checks the knobs the model decides: a ``.gguf`` file needs ``quantization: gguf``,
    which resolving with ``model`` sets."""
    for stage in stage_configs:
        if stage.stage_type in STAGE_TYPES_OF_KNOB["quantization"]:
            values = {k: getattr(stage, k) for k in STAGE_KNOBS}
            provenance = {k: stage.provenance.get(k, "default") for k in STAGE_KNOBS}
            try:
                check_quantization(stage.stage_id, values, _writer(values, provenance), model, stage.lora_enabled)
            except ValueError as exc:
                hint = " (resolve_stage_configs(..., model=...) sets it)" if model.is_gguf else ""
                raise ValueError(f"{exc}{hint}") from None


def check_model_folder(stage_configs: list[StageDeployConfig], folder: str) -> None:
    """Stage configs checked against the diffusers folder every stage loads, once it exists: a repo id or a single
    file has none while the knobs resolve (`_local_folder`), so what the parallel knobs ask of the model (a
    ``_cp_plan``, heads the degree divides, guidance) is checked here, before any weights load, and so is a folder
    that loads with its own code (a custom pipeline or component class), which needs ``trust_remote_code``."""
    for stage in stage_configs:
        values = {k: getattr(stage, k) for k in STAGE_KNOBS}
        provenance = {k: stage.provenance.get(k, "default") for k in STAGE_KNOBS}
        check_parallel(stage.stage_id, values, _writer(values, provenance), folder)
        if stage.stage_type in STAGE_TYPES_OF_KNOB["trust_remote_code"] and not stage.trust_remote_code:
            _check_untrusted_code(stage.stage_id, _writer(values, provenance), folder)


def _model_code(folder: str) -> list[str]:
    """The model's own code that the diffusers folder's ``model_index.json`` names, which diffusers runs only with
    ``trust_remote_code``: a pipeline class given as ``[module, class]`` (in ``module.py`` beside it) and a
    component whose library is a file of its subfolder (``transformer/my_model.py``)."""
    with open(os.path.join(folder, "model_index.json"), encoding="utf-8") as file:
        index = json.load(file)
    found = []
    if isinstance(index.get("_class_name"), list):
        module, cls = index["_class_name"]
        found.append(f"the pipeline class {cls} in {module}.py")
    for name, entry in index.items():
        library = entry[0] if isinstance(entry, list) and len(entry) == 2 and not name.startswith("_") else None
        if isinstance(library, str) and os.path.isfile(os.path.join(folder, name, f"{library}.py")):
            found.append(f"the {name} class {entry[1]} in {name}/{library}.py")
    return found


def _check_untrusted_code(stage_id: int, written: Callable[..., str], folder: str) -> None:
    """A folder that needs its own code to load is refused before anything loads, naming that code and the flag
    that trusts it (diffusers' own error names only its Python keyword, after the stage has started)."""
    if code := _model_code(folder):
        raise ValueError(
            f"stage {stage_id}: the model {folder} loads with its own code, which runs only when you trust it: "
            f"{'; '.join(code)}. Read it, then give --trust-remote-code (vllm serve), trust_remote_code=True "
            f"(Omni) or trust_remote_code: true (a deploy YAML's stage); {written('trust_remote_code', 'is ')}"
        )


def _local_folder(model: ModelSource | None) -> str | None:
    """The local diffusers folder whose configs ``model`` loads with, if there is one before anything downloads."""
    if model is None:
        return None
    if model.kind == "folder":
        return model.model
    return model.model_config if model.model_config_kind == "folder" else None


def _resolve_quantization(
    stage_id: int, values: dict[str, Any], provenance: dict[str, Source], model: ModelSource | None
) -> None:
    """A ``.gguf`` model file sets ``quantization: gguf`` (provenance ``model``) where no layer set it; then the
    quantization knobs are checked against the model and the other knobs (`check_quantization`)."""
    if is_gguf(model) and provenance["quantization"] == "default":
        values["quantization"], provenance["quantization"] = "gguf", GGUF_SOURCE
    lora = values["enable_lora"] or bool(values["lora_modules"])
    check_quantization(stage_id, values, _writer(values, provenance), model, lora)


def _check_preemption(
    stage_id: int, values: Mapping[str, Any], provenance: Mapping[str, Source], written: Callable[..., str]
) -> None:
    """``max_preempted_state_mb`` bounds what preemption keeps, which only step mode under the priority policy does."""
    if provenance["max_preempted_state_mb"] == "default":
        return
    for knob, needed in (("execution_mode", "step"), ("scheduling_policy", "priority")):
        if values[knob] != needed:
            raise ValueError(
                f"stage {stage_id}: {written('max_preempted_state_mb')} bounds the state of preempted requests, "
                f"which only execution_mode 'step' with scheduling_policy 'priority' preempts, but "
                f"{written(knob, 'is ')}: set {knob} to {needed!r} or remove max_preempted_state_mb"
            )


def _check_combination(stage_id: int, values: Mapping[str, Any], provenance: Mapping[str, Source]) -> None:
    """Knobs that are valid alone but not together, named as each was written."""

    written = _writer(values, provenance)
    _check_preemption(stage_id, values, provenance, written)
    if values["max_batch_pixels"] is not None and values["max_num_seqs"] == 1:
        raise ValueError(
            f"stage {stage_id}: {written('max_batch_pixels')} limits batches of several requests, but "
            f"{written('max_num_seqs', 'is ')}: a request is never split, so raise max_num_seqs or remove it"
        )
    if values["compile_sizes"] and values["compile"] == "none":
        raise ValueError(
            f"stage {stage_id}: {written('compile_sizes')} are compiled at warm-up, but {written('compile', 'is ')}: "
            "set compile to 'regional' or 'full', or remove compile_sizes"
        )
    _check_cache(stage_id, values, written)
    if values["cpu_offload"] != "none":
        if values["distributed_executor_backend"] == "ray" and values["num_gpus"] == 0:
            raise ValueError(
                f"stage {stage_id}: {written('cpu_offload')} moves weights to a GPU while they run, but "
                f"{written('num_gpus')} gives each replica none: give it a GPU or set cpu_offload to 'none'"
            )
        if values["cpu_offload"] == "sequential" and values["devices"] is not None:
            raise ValueError(
                f"stage {stage_id}: {written('cpu_offload')} runs every submodule on one GPU, so "
                f"{written('devices')} cannot place the stage: remove devices (the first visible GPU is used) or "
                "use cpu_offload 'model'"
            )
    backend = written("distributed_executor_backend", "is ")
    if values["distributed_executor_backend"] == "inline":
        if values["num_replicas"] > 1:
            raise ValueError(
                f"stage {stage_id}: {written('num_replicas')} needs Ray, but {backend}: "
                "set distributed_executor_backend to 'ray' (or leave it unset), or num_replicas to 1"
            )
        # num_gpus is an inline stage's device count too (upstream's --num-gpus), checked by check_parallel
        given = [written(k) for k in RAY_ONLY_KNOBS if provenance[k] != "default" and k != "num_gpus"]
        if given:
            raise ValueError(
                f"stage {stage_id}: {', '.join(given)} applies to distributed_executor_backend 'ray' only, "
                f"but {backend}: set it to 'ray' or remove the Ray setting"
            )
    elif importlib.util.find_spec("ray") is None:
        if provenance["distributed_executor_backend"] != "default":
            asked = written("distributed_executor_backend")
        else:
            asked = written("num_replicas" if values["num_replicas"] > 1 else "ray_address")
        raise ValueError(f"stage {stage_id}: {asked} needs Ray, which is not installed: pip install 'vllm-omni[ray]'")
    elif values["devices"] is not None:
        raise ValueError(
            f"stage {stage_id}: {written('devices')} picks CUDA devices of this process, but {backend}: "
            "Ray gives each replica num_gpus devices of its own, so leave devices unset"
        )


def _check_cache(stage_id: int, values: Mapping[str, Any], written: Callable[..., str]) -> None:
    """The step cache's knobs: a ``cache_config`` its backend takes, and no LoRA beside it."""
    if values["cache_backend"] == "none":
        if values["cache_config"] is not None:
            raise ValueError(
                f"stage {stage_id}: {written('cache_config')} configures a step cache, but "
                f"{written('cache_backend', 'is ')}: set cache_backend or remove cache_config"
            )
        return
    if values["cache_backend"] in REFUSED_BACKENDS:
        raise ValueError(
            f"stage {stage_id}: {written('cache_backend')}: diffusers' FasterCache hooks need the negative and "
            "positive rows of classifier-free guidance in one denoiser call, which no pipeline served here makes "
            f"(Flux and Wan make two calls, and the hooks fail on them); use {_either(PER_REQUEST_BACKENDS)}"
        )
    try:
        cache_hook_config(values["cache_backend"], parse_cache_config(values["cache_config"]) or {})
    except ValueError as exc:
        raise ValueError(f"stage {stage_id}: {exc} (with {written('cache_backend')})") from None
    if values["cache_backend"] in WHOLE_CALL_BACKENDS:
        if values["max_num_seqs"] > 1:
            raise ValueError(
                f"stage {stage_id}: {written('cache_backend')} decides for a whole pipeline call (one residual check "
                f"over all its rows), so a request's image would depend on the requests batched with it, and "
                f"{written('max_num_seqs', 'is ')}: set max_num_seqs to 1, or use {_either(PER_REQUEST_BACKENDS)}, "
                "which decide per request"
            )
        if values["execution_mode"] == "step":
            raise ValueError(
                f"stage {stage_id}: {written('cache_backend')} keeps its cache context for one pipeline call, which "
                f"{written('execution_mode', 'is ')} does not make (requests join and leave at steps): use "
                f"execution_mode 'request', or {_either(PER_REQUEST_BACKENDS)}"
            )
    if values["enable_lora"] or values["lora_modules"]:
        lora = written("lora_modules" if values["lora_modules"] else "enable_lora")
        why = (
            f"has not been checked beside {lora} (PEFT's adapter layers)"
            if values["cache_backend"] in WHOLE_CALL_BACKENDS
            else "runs each request's rows in a denoiser call of its own, "
            f"and {lora} applies adapters per row of the whole batch's call"
        )
        raise ValueError(f"stage {stage_id}: {written('cache_backend')} {why}: use one of them")
