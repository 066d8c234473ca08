"""What the routes share: the configuration, the stores, the `AsyncOmni` once loaded, and readiness."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_omni.config import LoRAModulePath, StageDeployConfig
from vllm_omni.config.model_source import ModelSource, ModelSourceError
from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.openai.images.image_store import ImageStore
from vllm_omni.entrypoints.openai.videos.video_jobs import VideoJobs
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.metrics.tracing import RequestTrace, RequestTracer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = init_logger(__name__)


@dataclass
class ServerState:
    source: ModelSource
    """The model as given (``/v1/models`` reports it as the ``root``)."""
    stage_configs: list[StageDeployConfig]
    serving: ServingConfig
    store: ImageStore
    videos: VideoJobs
    on_fatal: Callable[[BaseException], None]
    omni: AsyncOmni | None = None
    prompt_tokenizer: PreTrainedTokenizerBase | None = None
    """The tokenizer that counts an image request's prompt in its ``usage`` (`load_prompt_tokenizer`; loaded with
    an image model, none for a video model or a folder without a tokenizer)."""
    tracer: RequestTracer | None = None
    """Where each completed request's span goes (``--otlp-traces-endpoint``); ``None``: no traces."""
    ready: bool = False
    draining: bool = False
    loaded_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(
        cls,
        source: ModelSource | str,
        stage_configs: list[StageDeployConfig],
        serving: ServingConfig,
        on_fatal: Callable[[BaseException], None],
    ) -> ServerState:
        return cls(
            source=source if isinstance(source, ModelSource) else ModelSource(source),
            stage_configs=stage_configs,
            serving=serving,
            store=ImageStore(serving.image_url_ttl_s, serving.image_store_max_bytes),
            videos=VideoJobs(serving.video_ttl_s, serving.video_store_max_bytes),
            on_fatal=on_fatal,
            tracer=None
            if serving.otlp_traces_endpoint is None
            else RequestTracer(
                serving.otlp_traces_endpoint, serving.served_model_names[0], [s.stage_id for s in stage_configs]
            ),
        )

    @property
    def loaded_omni(self) -> AsyncOmni:
        """`omni`, where a route reads it: once the model has loaded (the route checked readiness, or holds what a
        loaded model made)."""
        assert self.omni is not None, "the model has loaded"
        return self.omni

    def trace(self, headers) -> RequestTrace | None:
        """A request's trace, under the caller's ``traceparent`` (``None`` without ``--otlp-traces-endpoint``)."""
        return None if self.tracer is None else self.tracer.start(headers)

    def lora_adapters(self) -> dict[str, LoRAModulePath]:
        """The LoRA adapters requests may select, by name (those of the configuration while the model loads)."""
        if self.omni is not None:
            return {m.name: m for m in self.omni.lora_adapters}
        return {m.name: m for stage in self.stage_configs for m in stage.lora_modules}

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.omni is None or not self.ready:
            return "the model is loading"
        down = [h.stage_id for h in self.omni.health() if h.status == "down"]
        if down:
            return f"no replica of stage {', '.join(map(str, down))} is alive; see the server log"
        return None


def load_prompt_tokenizer(omni: AsyncOmni) -> PreTrainedTokenizerBase | None:
    """The tokenizer that counts a prompt's tokens: of the served folder's tokenizers (``tokenizer``,
    ``tokenizer_2``, ..., each of the class its ``model_index.json`` names: `AsyncOmni.model_index`), the one with
    the longest ``model_max_length``, the first on a tie: T5 for Flux and SD3, UMT5 for Wan, Qwen2 for Qwen-Image,
    the first CLIP for SD and SDXL. ``None`` if it has none."""
    tokenizers = []
    for name, component in sorted(omni.model_index().items()):
        if name.startswith("tokenizer") and isinstance(component, list) and None not in component:
            library, class_name = component
            tokenizer_class = getattr(importlib.import_module(library), class_name)
            tokenizers.append(tokenizer_class.from_pretrained(os.path.join(omni.model, name)))
    return max(tokenizers, key=lambda tokenizer: tokenizer.model_max_length, default=None)


async def load_and_warm_up(state: ServerState) -> None:
    """Load the model (off the event loop), warm it up, then mark the server ready; a failure is fatal."""
    try:
        omni = await asyncio.to_thread(
            AsyncOmni.from_stage_configs,
            state.source,
            state.stage_configs,
            state.serving.strict_fields,
            state.serving.profiler_config,
        )
        state.omni = omni
        if omni.output_kind in ("image", "audio"):  # the APIs that count a prompt's tokens with it
            state.prompt_tokenizer = await asyncio.to_thread(load_prompt_tokenizer, omni)
        for stage in state.stage_configs:
            metrics.stage_max_num_seqs.labels(str(stage.stage_id), stage.provenance["max_num_seqs"]).set(
                stage.max_num_seqs
            )
            for knob, (value, source) in stage.applied_knobs().items():
                metrics.stage_knob_info.labels(str(stage.stage_id), knob, _label(value), source).set(1)
        started = time.perf_counter()
        await omni.warm_up()
        state.ready = True
        logger.info("Warm-up done in %.2f s; ready to serve %s", time.perf_counter() - started, state.source.model)
    except ModelSourceError as exc:  # the message says it all: no traceback
        logger.error("Could not load %s: %s", state.source.model, exc)
        state.on_fatal(exc)
    except Exception as exc:  # noqa: BLE001 - the server cannot serve without its model
        logger.exception("Could not load and warm up %s", state.source.model)
        state.on_fatal(exc)


def _label(value: object) -> str:
    """A knob's value as a label: strings as they are, everything else as JSON (``true``, ``null``, ``[1, 2]``)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)
