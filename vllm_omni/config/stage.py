"""Typed deploy configuration: one `StageDeployConfig` per stage, grouped in a `DeployConfig`.

A stage config is frozen: once the resolver has built it, nothing downstream can
change a knob (in particular ``max_num_seqs``) behind the user's back.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_omni.config.cache import CacheBackendName, parse_cache_config
from vllm_omni.config.llm import LLM_KNOBS, LlmMode, check_engine_args, check_sampling
from vllm_omni.config.lora import LoRAModulePath
from vllm_omni.config.stage_types import STAGE_TYPES, StageEngine, check_stage_graph

Source = Literal["default", "deploy_yaml", "cli", "python", "stage_override", "legacy_alias"]
"""Where a resolved knob value came from (see docs/configuration.md)."""

DType = Literal["auto", "float32", "float16", "bfloat16"]

ExecutionMode = Literal["request", "step"]
"""How a stage batches: whole requests, or requests joining and leaving at denoising steps."""

Backend = Literal["inline", "ray"]
"""Where a stage's replicas run: ``inline`` (one engine on a thread of this process) or ``ray`` (one Ray actor each)."""

StageType = Literal["diffusion", "encode", "denoise", "decode", "llm"]
"""What a stage runs: the whole pipeline, or one part of a split one (docs/stages.md)."""

CpuOffload = Literal["none", "model", "sequential"]
"""diffusers' CPU offload: none, whole components (``model``) or submodules (``sequential``) moved to the GPU to run."""

CompileMode = Literal["none", "regional", "full"]
"""torch.compile of the denoiser: none, its repeated blocks (diffusers' ``compile_repeated_blocks``), or whole."""

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""Ray placement-group strategies: how replicas spread over the cluster's nodes."""

RAY_ONLY_KNOBS = ("ray_address", "num_cpus", "num_gpus", "placement_strategy")
"""Knobs that mean something only with ``distributed_executor_backend: ray``."""

DENOISING_ONLY_KNOBS = ("execution_mode", "compile", "compile_sizes", "cache_backend", "cache_config")
"""Knobs of the stages that hold the denoiser (`StageTypeSpec.denoises`)."""

LORA_KNOBS = ("enable_lora", "lora_modules", "max_loras", "max_lora_rank")
"""Knobs of the stages that hold a component adapters apply to (`StageTypeSpec.adapts`)."""

PIPELINE_KNOBS = (
    "request_batch_max_wait_ms",
    "devices",
    "dtype",
    "max_batch_pixels",
    "vae_tiling",
    "vae_slicing",
    "cpu_offload",
)
"""Knobs of the stages that run a diffusers pipeline (``runs: diffusers``); an llm stage sets its engine's through
``engine_args``, and vLLM forms its batches itself."""


def _denoises(stage_type: str) -> bool:
    spec = STAGE_TYPES.get(stage_type)
    return spec is not None and spec.denoises


def _adapts(stage_type: str) -> bool:
    spec = STAGE_TYPES.get(stage_type)
    return spec is not None and spec.adapts


def _runs(stage_type: str) -> StageEngine | None:
    spec = STAGE_TYPES.get(stage_type)
    return None if spec is None else spec.runs


class StageDeployConfig(BaseModel):
    """Deploy settings of one stage; the field defaults are the built-in defaults (layer 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stage_id: int = Field(default=0, ge=0)
    """Identifier of the stage; ``--stage-overrides`` keys refer to it."""

    stage_type: StageType = "diffusion"
    """``diffusion`` (the whole pipeline), ``encode`` / ``denoise`` / ``decode`` (a split pipeline), or ``llm`` (an
    LLM on vLLM's engine that rewrites the prompt)."""

    inputs: tuple[int, ...] = ()
    """Stage ids whose outputs this stage takes (``denoise`` takes an ``encode`` stage, ``decode`` a ``denoise``;
    a ``diffusion`` or ``encode`` stage may take an ``llm`` stage's text as its prompt)."""

    max_num_seqs: int = Field(default=1, ge=1)
    """Most requests the stage runs together in one batch."""

    request_batch_max_wait_ms: float = Field(default=0.0, ge=0.0)
    """How long an idle stage waits for more compatible requests before it starts a batch that is not full."""

    execution_mode: ExecutionMode = "request"
    """``request``: a batch runs all its steps together; ``step``: requests join and leave at denoising-step
    boundaries (``diffusion`` and ``denoise`` stages only)."""

    num_replicas: int = Field(default=1, ge=1)
    """Engine replicas of this stage, each a whole engine; ``max_num_seqs`` is per replica."""

    distributed_executor_backend: Backend | None = None
    """``inline`` or ``ray``; ``None``: ``ray`` when ``num_replicas > 1`` or ``ray_address`` is set, else ``inline``."""

    ray_address: str | None = None
    """Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); ``None``: start a local one."""

    num_cpus: int = Field(default=1, ge=1)
    """CPUs Ray reserves for each replica; on the CPU the replica runs this many torch threads."""

    num_gpus: float | None = Field(default=None, ge=0)
    """GPUs Ray reserves for each replica; ``None``: 1 when the cluster has GPUs, else 0."""

    placement_strategy: PlacementStrategy = "PACK"
    """How the replicas' placement group spreads over nodes (``SPREAD``: on different nodes where possible)."""

    devices: str | None = None
    """Comma-separated CUDA device indices for the stage (``None``: the first visible device, or the CPU)."""

    dtype: DType = "auto"
    """Weights and activations dtype; ``auto`` is bfloat16 on CUDA (float16 without bf16 support) and float32 on CPU."""

    enable_lora: bool = False
    """Serve LoRA adapters; implied by ``lora_modules``, needed alone only for adapters loaded later
    (``/v1/load_lora_adapter``)."""

    lora_modules: tuple[LoRAModulePath, ...] = ()
    """Adapters served from start-up: ``name=path`` or ``{"name", "path", "base_model_name"}`` entries."""

    max_loras: int = Field(default=4, ge=1)
    """Adapters resident in each replica at once (least recently used evicted), and most in one batch."""

    max_lora_rank: int = Field(default=64, ge=1)
    """Highest adapter rank served; an adapter above it is refused when it loads."""

    max_batch_pixels: int | None = Field(default=None, ge=1)
    """Most ``width × height × frames × n`` one batch (in step mode, one forward) holds, summed over its requests;
    ``None``: no budget. It only makes batches smaller than ``max_num_seqs``; a larger request runs alone."""

    vae_tiling: bool = False
    """Run the VAE over overlapping tiles (diffusers' ``enable_tiling``): large images in less memory."""

    vae_slicing: bool = False
    """Run the VAE on one image of a batch at a time (diffusers' ``enable_slicing``): less peak memory."""

    cpu_offload: CpuOffload = "none"
    """Keep weights in CPU memory and move them to the GPU to run (CUDA only): ``model`` a component at a time,
    ``sequential`` a submodule at a time (least memory, slowest)."""

    compile: CompileMode = "none"
    """torch.compile the denoiser: ``regional`` its repeated blocks (compiles fast, most of the gain), ``full`` the
    whole module (``diffusion`` and ``denoise`` stages only)."""

    compile_sizes: tuple[str, ...] = ()
    """Sizes (``WxH``, or ``WxHxF`` for video) the server compiles during warm-up, before ``/health`` turns 200;
    another size compiles on first use."""

    cache_backend: CacheBackendName = "none"
    """Step caching of the denoiser: diffusers' cache hooks (``first_block``, ``taylorseer``, ``magcache``,
    ``faster_cache``, ``pab``) or cache-dit (``cache_dit``); blocks reuse earlier steps' results, and each request
    keeps its own cache state."""

    cache_config: dict[str, Any] | None = None
    """The backend's settings (its config's fields, e.g. ``{"threshold": 0.2}``); ``None``: its defaults."""

    model: str | None = None
    """``llm`` stages: the LLM's folder or Hugging Face repo id."""

    engine_args: dict[str, Any] | None = None
    """``llm`` stages: vLLM ``EngineArgs`` fields for the stage's engine (``max_num_seqs`` is the stage's knob)."""

    python_executable: str | None = None
    """``llm`` stages: the interpreter of the stage's Ray actors (``.venv-llm-cpu/bin/python`` on a CPU host);
    ``None``: the server's own."""

    mode: LlmMode = "chat"
    """``llm`` stages: ``chat`` (the tokenizer's chat template, with ``system_prompt``) or ``completion``
    (``prompt_template``)."""

    system_prompt: str | None = None
    """``llm`` stages in chat mode: the system message before the user's prompt; ``None``: none."""

    prompt_template: str | None = None
    """``llm`` stages in completion mode: the LLM's input, with ``{prompt}`` where the request's prompt goes;
    ``None``: the prompt alone."""

    sampling: dict[str, Any] | None = None
    """``llm`` stages: vLLM ``SamplingParams`` fields (``temperature``, ``max_tokens``, ...); ``None``: vLLM's
    defaults."""

    provenance: dict[str, Source] = Field(default_factory=dict, repr=False)
    """Which layer supplied each knob; filled in by the resolver (and by the YAML loader for its own keys)."""

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        if isinstance(value, str | dict):
            value = [value]
        return [LoRAModulePath.parse(v) for v in value] if isinstance(value, list | tuple) else value

    @field_validator("lora_modules")
    @classmethod
    def _unique_lora_names(cls, value: tuple[LoRAModulePath, ...]) -> tuple[LoRAModulePath, ...]:
        names = [m.name for m in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"lora_modules names must be unique, repeated: {', '.join(repeated)}")
        return value

    @property
    def lora_enabled(self) -> bool:
        """Whether the stage serves LoRA adapters (``enable_lora``, or adapters given)."""
        return self.enable_lora or bool(self.lora_modules)

    @field_validator("compile_sizes", mode="before")
    @classmethod
    def _parse_compile_sizes(cls, value: Any) -> Any:
        if isinstance(value, str):  # the CLI's comma-separated list
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple):
            bad = [v for v in value if not isinstance(v, str) or not re.fullmatch(r"[1-9]\d*x[1-9]\d*(x[1-9]\d*)?", v)]
            if bad:
                raise ValueError(f"compile_sizes entries are WxH or WxHxF (frames), such as 1024x1024; got {bad}")
        return value

    _parse_cache_config = field_validator("cache_config", mode="before")(parse_cache_config)
    _check_engine_args = field_validator("engine_args", mode="before")(check_engine_args)
    _check_sampling = field_validator("sampling", mode="before")(check_sampling)

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = [p.strip() for p in str(value).split(",")]
        if not parts or not all(p.isdigit() for p in parts):
            raise ValueError(f"devices must be comma-separated CUDA device indices such as '0' or '0,1', got {value!r}")
        return ",".join(parts)

    @property
    def denoises(self) -> bool:
        """Whether this stage holds the denoiser: it fills in the model's defaults, reports progress and takes
        ``execution_mode``."""
        return _denoises(self.stage_type)

    @property
    def capacity(self) -> int:
        """Most requests the stage runs at once, over all its replicas."""
        return self.num_replicas * self.max_num_seqs

    def applied_knobs(self) -> dict[str, tuple[Any, Source]]:
        """Every knob that applies to this stage, with its value and the layer it came from: what the start-up
        line and the ``vllm_omni:stage_knob_info`` gauge report."""
        return {k: (getattr(self, k), self.provenance.get(k, "default")) for k in STAGE_KNOBS if knob_applies(k, self)}

    def describe(self) -> str:
        """The start-up line for this stage: every knob that applies, its value and where it came from,
        then the stage's total capacity."""
        knobs = ", ".join(f"{k}={value!r} ({source})" for k, (value, source) in self.applied_knobs().items())
        inputs = f" <- stage(s) {', '.join(map(str, self.inputs))}" if self.inputs else ""
        return (
            f"stage {self.stage_id} ({self.stage_type}{inputs}): {knobs}; capacity {self.capacity} requests at once "
            f"({self.num_replicas} replica(s) x max_num_seqs {self.max_num_seqs})"
        )


STAGE_KNOBS: tuple[str, ...] = tuple(
    name for name in StageDeployConfig.model_fields if name not in ("stage_id", "stage_type", "inputs", "provenance")
)
"""The per-stage knobs that the precedence layers (YAML, CLI/Python, stage overrides) may set."""

YAML_STAGE_KEYS: tuple[str, ...] = tuple(n for n in StageDeployConfig.model_fields if n != "provenance")


def knob_applies(knob: str, stage: StageDeployConfig | dict) -> bool:
    """Whether ``knob`` means something for ``stage`` (a config, or resolved values with ``stage_type``)."""
    get = stage.get if isinstance(stage, dict) else lambda name: getattr(stage, name)
    if knob in RAY_ONLY_KNOBS:
        return get("distributed_executor_backend") == "ray"
    if knob in DENOISING_ONLY_KNOBS:
        return _denoises(get("stage_type"))
    if knob in LORA_KNOBS:
        return _adapts(get("stage_type")) and (knob == "enable_lora" or bool(get("lora_modules") or get("enable_lora")))
    if knob in PIPELINE_KNOBS:
        return _runs(get("stage_type")) == "diffusers"
    if knob in LLM_KNOBS:
        return _runs(get("stage_type")) == "vllm"
    return True


class DeployConfig(BaseModel):
    """A whole deploy: the stages of the model, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stages: list[StageDeployConfig] = Field(default_factory=lambda: [StageDeployConfig()])
    """The stages; by default one diffusion stage with id 0."""

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, stages: list[StageDeployConfig]) -> list[StageDeployConfig]:
        if not stages:
            raise ValueError("stages must list at least one stage")
        ids = [s.stage_id for s in stages]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"stage_id values must be unique, repeated: {duplicates}")
        check_stage_graph(stages)
        return stages


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
