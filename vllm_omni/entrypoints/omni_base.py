"""`OmniBase`: the one place where user keywords arrive and become resolved stage configs."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_omni.config import (
    STAGE_KNOBS,
    STAGE_TYPES,
    DeployConfig,
    ExecutionMode,
    LoRAModulePath,
    StageDeployConfig,
    legacy,
    resolve_stage_configs,
)
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.profiler import profiler_config as checked_profiler_config
from vllm_omni.config.resolver import check_model, check_model_folder
from vllm_omni.diffusion.lora.tensors import LoraTensors
from vllm_omni.diffusion.pipeline.runner import read_model_index
from vllm_omni.logger import init_logger
from vllm_omni.model_sources.files import local_model_folder
from vllm_omni.orchestrator.engine_profiler import EngineProfiler
from vllm_omni.orchestrator.omni_engine import OmniEngine
from vllm_omni.sampling_params import AdmittedParams, OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.codec.card import SpeechCard
    from vllm_omni.diffusion.families.model_card import ModelCard
    from vllm_omni.orchestrator.stage_runtime import StageHealth

logger = init_logger(__name__)

LoraSource = str | os.PathLike[str] | Mapping[str, Any]
"""What ``add_lora`` takes: an adapter's path, or its tensors (name → tensor)."""


class OmniBase:
    """Resolve the configuration (defaults < deploy YAML < keywords < stage overrides), then start the engine.

    ``model`` is a diffusers folder, a Hugging Face repo id (fetched through the hub cache with ``revision``,
    ``download_dir`` and ``hf_token``, as vLLM's flags of those names) or a single-file checkpoint (configs from
    ``model_config``); see `ModelSource`. With ``codec_model``, ``model`` is the talker of a speech model (an LLM
    folder or repo id, on vLLM's engine) and ``codec_model`` its codec (`vllm_omni.config.speech.speech_deploy`).
    ``engine_kwargs`` are further stage knobs given globally (``dtype``,
    ``devices``, ...).
    A request field the model would not use (a ``negative_prompt`` without the guidance that reads it, a
    ``guidance_scale`` without a guidance embedding, ...) is dropped with a ``UserWarning`` and a log line, and
    listed in its output's ``ignored_fields``; ``strict_fields=True`` refuses it with `SamplingParamsError` instead.
    The deprecated batch-size keyword of `vllm_omni.config.legacy` is accepted with a
    ``FutureWarning`` and acts as ``max_num_seqs``. ``profiler_config`` (vLLM's ``ProfilerConfig``, or its fields
    as a dict) with ``profiler='torch'`` lets `start_profile` / `stop_profile` record torch profiles, as vLLM's
    ``LLM(profiler_config=...)``.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        revision: str | None = None,
        download_dir: str | None = None,
        hf_token: str | bool | None = None,
        model_config: str | None = None,
        deploy_config: str | os.PathLike[str] | DeployConfig | None = None,
        codec_model: str | os.PathLike[str] | None = None,
        max_num_seqs: int | None = None,
        request_batch_max_wait_ms: float | None = None,
        execution_mode: ExecutionMode | None = None,
        stage_overrides: Mapping[int | str, Mapping[str, Any]] | None = None,
        strict_fields: bool = False,
        profiler_config: Any = None,
        **engine_kwargs: Any,
    ):
        profiler_config = checked_profiler_config(profiler_config)
        max_num_seqs, from_alias = legacy.pop_python_alias(engine_kwargs, max_num_seqs)
        unknown = sorted(set(engine_kwargs) - set(STAGE_KNOBS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"stage knobs are: {', '.join(STAGE_KNOBS)}"
            )
        given = dict(
            max_num_seqs=max_num_seqs,
            request_batch_max_wait_ms=request_batch_max_wait_ms,
            execution_mode=execution_mode,
            **engine_kwargs,
        )
        try:
            source = ModelSource(
                os.fspath(model),
                revision=revision,
                download_dir=download_dir,
                hf_token=hf_token,
                model_config=model_config,
            )
        except ValueError as exc:  # the knobs' errors come first
            source, bad_source = None, exc
        stage_configs = resolve_stage_configs(
            deploy_config,
            global_knobs={k: v for k, v in given.items() if v is not None},
            global_source="python",
            global_alias_knobs={"max_num_seqs"} if from_alias else set(),
            stage_overrides=stage_overrides,
            model=source,
            codec_model=None if codec_model is None else os.fspath(codec_model),
        )
        if source is None:
            raise bad_source
        self._start(source, stage_configs, strict_fields, profiler_config)

    @classmethod
    def from_stage_configs(
        cls,
        model: str | os.PathLike[str] | ModelSource,
        stage_configs: list[StageDeployConfig],
        strict_fields: bool = False,
        profiler_config: Any = None,
    ):
        """Start from stage configs that are resolved already (the CLI resolves its flags before loading)."""
        self = cls.__new__(cls)
        source = model if isinstance(model, ModelSource) else ModelSource(os.fspath(model))
        self._start(source, stage_configs, strict_fields, checked_profiler_config(profiler_config))
        return self

    def _start(
        self, source: ModelSource, stage_configs: list[StageDeployConfig], strict_fields: bool, profiler_config: Any
    ) -> None:
        check_model(stage_configs, source)  # configs resolved without the model (from_stage_configs)
        self.model_source = source
        if any(STAGE_TYPES[stage.stage_type].runs == "diffusers" for stage in stage_configs):
            trusted = any(stage.trust_remote_code for stage in stage_configs)
            self.model = local_model_folder(source, [stage.stage_type for stage in stage_configs], trusted)
            """The diffusers folder every stage loads (the snapshot or converted folder for a repo id or a file)."""
            check_model_folder(stage_configs, self.model)
        else:  # a speech model: each stage loads its own model (vLLM and the codec fetch a repo id themselves)
            self.model = source.model
        self.stage_configs = stage_configs
        self.engine = OmniEngine(self.model, stage_configs, strict_fields)
        self.profiler = EngineProfiler(self.engine.stages, profiler_config)
        """`start_profile` / `stop_profile` of every engine process."""

    # What a server asks of the engine; it never reaches into ``engine`` itself.

    def admit(self, params: OmniDiffusionSamplingParams) -> AdmittedParams:
        """``params`` completed once, as the request will run (the model's defaults filled in, a seed drawn), with
        each stage's batch key. Pass the result to ``generate`` so that it is not completed again. The fields the
        model would not use are dropped and listed in its ``ignored``, without a warning (its caller reports them).
        Raises `SamplingParamsError` for parameters the model cannot take (and with ``strict_fields`` for a field
        it would not use), `StageUnavailableError` when a stage has no live replica to ask."""
        return self.engine.admit(params)

    def _admitted(self, request_id: str, params: OmniDiffusionSamplingParams | AdmittedParams) -> AdmittedParams:
        """``params`` of a ``generate`` call's request ``request_id``, admitted unless `admit` did already; each
        field the model would not use is warned of here, once per request: one log line and a ``UserWarning``
        pointing at the caller of ``generate``."""
        if isinstance(params, AdmittedParams):
            return params
        admitted = self.engine.admit(params)
        if admitted.ignored:
            fields = "; ".join(f"{field.param} ignored: {field.reason}" for field in admitted.ignored)
            logger.warning("request %s: %s", request_id, fields)
            warnings.warn(f"request {request_id}: {fields}", UserWarning, stacklevel=3)
        return admitted

    def health(self) -> list[StageHealth]:
        """Each stage's replicas, alive and in all, in request order."""
        return self.engine.health()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch, over all stages."""
        return self.engine.num_waiting

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(state, fraction of denoising steps done)`` of a request in flight (state: waiting or running), or
        ``None`` if it is not in flight."""
        return self.engine.progress(request_id)

    @property
    def model_card(self) -> ModelCard:
        """What the served model takes (its tasks, sizes, defaults), as the stage that holds the denoiser read it."""
        return self.engine.model_card

    @property
    def speech_card(self) -> SpeechCard | None:
        """What a speech model takes and makes (its voices, its rate), as its codec stage read it; ``None`` for a
        diffusion model, whose card is `model_card`."""
        return self.engine.speech_card

    @property
    def output_kind(self) -> str:
        """What the served model makes: ``image``, ``video`` or ``audio`` (its `model_card`'s), or ``speech``."""
        return "speech" if self.speech_card is not None else self.model_card.output

    def model_index(self) -> dict[str, Any]:
        """The served folder's ``model_index.json`` (its pipeline class, and each component's ``[library, class]``),
        for a caller that loads a component itself (the HTTP server's tokenizer that counts a prompt's tokens); empty
        for a speech model, which is no diffusers folder."""
        if self.speech_card is not None:
            return {}
        return read_model_index(self.model)

    @property
    def lora_adapters(self) -> list[LoRAModulePath]:
        """The LoRA adapters requests may select (``lora``): those of ``lora_modules`` and those added since (one
        added as tensors is listed with its source tag, ``tensors://NAME/ID``, as its path)."""
        return list(self.engine.loras.values())

    @staticmethod
    def _lora_source(name: str, source: LoraSource, peft_config: Any) -> tuple[str, LoraTensors | None]:
        """``add_lora``'s adapter: its path, or the source tag and checked tensors of one given as tensors."""
        if isinstance(source, (str, os.PathLike)):
            if peft_config is not None:
                raise ValueError("peft_config goes with an adapter given as tensors; a file's adapter has its own")
            return os.fspath(source), None
        return LoraTensors.source(name), LoraTensors.of(source, peft_config)

    def shutdown(self) -> None:
        """Stop the engine: waiting requests fail, the running batch finishes. A profile still recording is written
        first."""
        if self.profiler.active:
            logger.info("Wrote the profiles still recording: %s", self.profiler.stop())
        self.engine.shutdown()
