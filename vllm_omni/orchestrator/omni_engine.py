"""`OmniEngine`: owns the stage runtimes and, in this process, every request in flight: which stage and replica
hold it, its route through the stage graph, its re-run after a lost replica, abort and progress.

A deploy is one ``diffusion`` stage, or a split pipeline ``encode → denoise → decode``, optionally after an ``llm``
stage that rewrites the prompt (docs/stages.md). Each stage has its own runtime, replicas, scheduler and batch key;
a request enters the next stage when the previous one hands on its output (by reference when both run in this
process), and an llm stage's output becomes the prompt of the stages after it.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.codec.card import SpeechCard
from vllm_omni.config import LoRAModulePath, StageDeployConfig, engine_torch_threads
from vllm_omni.config.resolver import knob_as_written
from vllm_omni.config.stage_types import check_stage_graph
from vllm_omni.diffusion.engine.roles import check_splittable
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.features.sleep import check_level, check_tags
from vllm_omni.diffusion.lora.tensors import LoraTensors
from vllm_omni.errors import RequestAbortedError, SamplingParamsError, StageUnavailableError, UnknownLoraError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.orchestrator.replica import ReplicaLostError
from vllm_omni.orchestrator.speech_handoff import SpeechHandoff
from vllm_omni.orchestrator.stage_runtime import StageHealth, StageRuntime, wait
from vllm_omni.orchestrator.weight_updates import WeightUpdates
from vllm_omni.outputs import AudioChunk, OmniRequestOutput, Preview, StageMetrics, across_stages
from vllm_omni.sampling_params import MAX_SEED, AdmittedParams, LoraSelection, OmniDiffusionSamplingParams

logger = init_logger(__name__)


@dataclass(eq=False)
class _Flight:
    """A request on its way through the stages."""

    request_id: str
    prompt: str
    admitted: AdmittedParams
    revised_prompt: str | None = None
    """The prompt an llm stage wrote for it: the prompt of every stage after that one."""
    future: Future = field(default_factory=Future)
    stage: int = 0
    """Index (in request order) of the stage that holds it."""
    replica: int | None = None
    """The replica of that stage running it; ``None`` between stages, and between a lost replica and the re-run."""
    retried: bool = False
    """Whether it was re-run at this stage already (once per stage)."""
    aborted: bool = False
    stage_metrics: list[StageMetrics] = field(default_factory=list)
    on_preview: Callable[[Preview | AudioChunk], None] | None = None
    """Where its partial images go (from the stage that holds the denoiser)."""
    previews: int = 0
    """Previews handed on so far: a re-run on another replica makes them again, and they are not repeated."""
    arrived: float = field(default_factory=time.monotonic)
    """When the engine took it: the start of its end-to-end latency (`metrics.observe_priority`)."""


class OmniEngine:
    """Engine behind `Omni` and `AsyncOmni`; thread-safe, returns one future per request."""

    def __init__(self, model: str, stage_configs: list[StageDeployConfig], strict_fields: bool = False):
        order = check_stage_graph(stage_configs)
        check_splittable(model, order)
        self.stage_configs = stage_configs
        self.stages: list[StageRuntime] = []
        """The stage runtimes in the order a request passes them."""
        torch_threads = engine_torch_threads(order)
        try:
            by_id = {stage.stage_id: stage for stage in order}
            for stage_config, next_stage in zip(order, order[1:] + [None], strict=True):
                threads = torch_threads[stage_config.stage_id]
                input_stage = by_id[stage_config.inputs[0]] if stage_config.inputs else None
                self.stages.append(StageRuntime(model, stage_config, next_stage, threads, input_stage))
        except BaseException:
            self.shutdown()
            raise
        codec = next((i for i, stage in enumerate(self.stages) if stage.speech is not None), None)
        self._speech = None
        if codec is not None:
            speech = self.stages[codec].speech
            assert speech is not None, "found by it"
            self._speech = SpeechHandoff(self.stages[codec], speech)
        """A speech deploy's streams, from its talker (the stage before the codec stage) to its codec."""
        self._talker = None if codec is None else codec - 1
        self._denoiser = next(i for i, s in enumerate(order) if s.admits)
        """The stage that completes a request's parameters from the model's card: the one that holds the denoiser
        (it fills in the model's defaults and reports progress), or a speech model's codec stage."""
        self._prompt_writers = [s.writes_prompt for s in order]
        """Which stages write the prompt of the stages after them (llm); a request may skip them (enhance_prompt)."""
        self._lora_stage = next((s for s in self.stages if s.stage_config.lora_enabled), None)
        """The stage that serves LoRA adapters (a diffusion stage), if LoRA is enabled."""
        self.loras: dict[str, LoRAModulePath] = {
            m.name: m for m in (self._lora_stage.stage_config.lora_modules if self._lora_stage else ())
        }
        """The adapters requests may select, by name: ``--lora-modules`` and those loaded since."""
        self._loading: set[str] = set()
        """Adapter names being loaded now (a second load of one is refused)."""
        self.weights = WeightUpdates(self.stages)
        """Weight updates from a trainer, to every replica of the stages that hold a component."""
        metrics.replica_metrics.add(self._replica_metrics)
        self._flights: dict[str, _Flight | None] = {}
        self._lock = threading.Lock()
        self._sleep_lock = threading.Lock()
        self.strict_fields = strict_fields
        """Whether a field the model would not use is refused (`SamplingParamsError`) rather than dropped."""

    def admit(self, params: OmniDiffusionSamplingParams) -> AdmittedParams:
        """``params`` completed by the stage that holds the denoiser (a seed drawn if none is given, so a re-run on
        another replica makes the same image), then each stage's batch key for them (raises `SamplingParamsError`
        for parameters the model cannot take, and under ``strict_fields`` for the first field it would not use)."""
        if params.seed is None:
            params = params.model_copy(update={"seed": secrets.randbelow(MAX_SEED)})
        if params.enhance_prompt and not any(self._prompt_writers):
            raise SamplingParamsError(
                "enhance_prompt",
                "enhance_prompt is true, but this server has no llm stage to enhance prompts with (docs/stages.md); "
                "leave enhance_prompt unset or false",
            )
        if params.priority != 0:
            self._check_priority(params)
        if params.lora:
            params = params.model_copy(update={"lora": self._adapters(params.lora)})
        first = self.stages[self._denoiser].admit(params)
        if first.ignored and self.strict_fields:
            raise SamplingParamsError(first.ignored[0].param, first.ignored[0].reason)
        keys = [first.key if i == self._denoiser else s.admit(first.params).key for i, s in enumerate(self.stages)]
        return AdmittedParams(first.params, tuple(keys), first.ignored)

    def _check_priority(self, params: OmniDiffusionSamplingParams) -> None:
        """A priority other than 0 needs ``scheduling_policy`` ``priority`` on every stage the request passes; else
        it is refused as vLLM refused it, naming the field and the flag."""
        for index, stage in enumerate(self.stages):
            skipped = self._prompt_writers[index] and params.enhance_prompt is False
            if stage.stage_config.scheduling_policy == "fcfs" and not skipped:
                raise SamplingParamsError(
                    "priority",
                    f"Got priority {params.priority} but Priority scheduling is not enabled: stage "
                    f"{stage.stage_id} runs {knob_as_written(stage.stage_config, 'scheduling_policy')}; start the "
                    "server with --scheduling-policy priority (Omni: scheduling_policy='priority'), or leave "
                    "priority at 0",
                )

    def _adapters(self, lora: tuple[LoraSelection, ...]) -> tuple[LoraSelection, ...]:
        """A request's adapters, each with the path this engine serves it from."""
        if self._lora_stage is None:
            raise SamplingParamsError(
                "lora", "this server serves no LoRA adapters: start it with --lora-modules (or --enable-lora)"
            )
        max_loras = self._lora_stage.stage_config.max_loras
        if len(lora) > max_loras:
            raise SamplingParamsError("lora", f"lora stacks {len(lora)} adapters; at most --max-loras {max_loras}")
        resolved = []
        for i, selection in enumerate(lora):
            if selection.path is not None:
                raise SamplingParamsError("lora", f"lora[{i}].path is set by the engine; give name and scale only")
            module = self.loras.get(selection.name)
            if module is None:
                raise UnknownLoraError(selection.name, list(self.loras))
            resolved.append(selection.model_copy(update={"path": module.path}))
        return tuple(resolved)

    def load_lora(self, name: str, path: str, tensors: LoraTensors | None = None) -> None:
        """Serve adapter ``name`` from ``path`` from now on: every replica loads it (between batches) and checks it
        first. Raises `LoraLoadError` naming the file, or ValueError when the name is taken or LoRA is off.
        ``tensors``: an adapter given as tensors (``path``: its source tag), put once into a Ray stage's object
        store."""
        if self._lora_stage is None:
            raise ValueError("this server serves no LoRA adapters: start it with --enable-lora to load them")
        tensors = None if tensors is None else self._lora_stage.shared(tensors)
        with self._lock:
            if name in self.loras or name in self._loading:
                raise ValueError(f"The LoRA adapter '{name}' has already been loaded")
            self._loading.add(name)
        try:
            # A Ray replica that is down keeps an adapter given as tensors for when it is back (ReplicaLostError).
            answers = self._lora_stage.call("load_lora", name, path, tensors, down_too=tensors is not None)
            errors = [answer.future.exception() for answer in answers]
            failed = next((e for e in errors if e is not None and not isinstance(e, ReplicaLostError)), None)
            if failed is not None:
                for answer, error in zip(answers, errors, strict=True):
                    if error is None or isinstance(error, ReplicaLostError):
                        self._lora_stage.replicas[answer.replica].call("unload_lora", name).exception()
                raise failed
            with self._lock:
                self.loras[name] = LoRAModulePath(name=name, path=path)
        finally:
            with self._lock:
                self._loading.discard(name)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (`UnknownLoraError` if it is not served). Requests already accepted with it
        still run with it; each replica evicts it now, or next when requests in flight use it."""
        with self._lock:
            if name not in self.loras:
                raise UnknownLoraError(name, list(self.loras))
            del self.loras[name]
        assert self._lora_stage is not None, "adapters are served by the stage with LoRA"
        for answer in self._lora_stage.call("unload_lora", name):
            error = answer.future.exception()
            if error is not None and not isinstance(error, ReplicaLostError):  # a lost replica has nothing to evict
                logger.warning("evicting LoRA adapter %r failed: %s: %s", name, type(error).__name__, error)

    def add_request(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams | AdmittedParams,
        on_preview: Callable[[Preview | AudioChunk], None] | None = None,
    ) -> Future:
        """Queue a request (raises `SamplingParamsError` for parameters the model cannot take); ``params`` admitted
        already are not completed again. ``on_preview`` takes its ``partial_images`` previews, each once and in
        order, before the future resolves, on a thread of the engine's."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        with self._lock:
            if request_id in self._flights:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._flights[request_id] = None  # reserved while it is admitted
        try:
            admitted = params if isinstance(params, AdmittedParams) else self.admit(params)
        except BaseException:
            with self._lock:
                del self._flights[request_id]
            raise
        flight = _Flight(request_id, prompt, admitted, on_preview=on_preview)
        with self._lock:
            self._flights[request_id] = flight
        for adapter in [s.name for s in admitted.params.lora] or ["base"]:
            metrics.lora_requests.labels(adapter).inc()
        # A caller that cancels the future (asyncio cancellation) aborts the request, wherever it is.
        flight.future.add_done_callback(lambda done: done.cancelled() and self.abort(request_id))
        self._enter(flight, 0, None)
        return flight.future

    def _finish(self, flight: _Flight, output=None, error: BaseException | None = None) -> None:
        with self._lock:
            self._flights.pop(flight.request_id, None)
        if self._speech is not None and error is not None:
            self._speech.discard(flight.request_id)
        if flight.future.done():  # cancelled by its caller
            return
        if error is not None:
            flight.future.set_exception(error)
        else:
            output.ignored_fields = list(flight.admitted.ignored)
            metrics.observe_priority(
                flight.admitted.params.priority, output.metrics.queue_ms / 1000.0, time.monotonic() - flight.arrived
            )
            flight.future.set_result(output)

    def _enter(self, flight: _Flight, index: int, payload: Any) -> None:
        """Hand ``flight`` to stage ``index`` with the previous stage's ``payload``; past an llm stage the request
        opted out of (``enhance_prompt=False``)."""
        if self._prompt_writers[index] and flight.admitted.params.enhance_prompt is False:
            self._enter(flight, index + 1, payload)
            return
        with self._lock:
            flight.stage, flight.retried = index, False
        if index == self._talker:
            assert self._speech is not None, "a talker has a codec stage"
            on_done = functools.partial(self._spoken, flight)
            self._speech.open(flight.request_id, flight.prompt, flight.admitted.params, flight.on_preview, on_done)
            payload = self._speech.talker_input(flight.prompt, flight.admitted.params)
        self._dispatch(flight, payload)

    def _spoken(self, flight: _Flight, output: OmniRequestOutput | None, error: BaseException | None) -> None:
        """A speech request's stream is over (`SpeechHandoff`): its whole waveform, or why it failed."""
        if error is not None or output is None:
            self._finish(flight, error=error or RequestAbortedError(flight.request_id))
            return
        assert output.metrics is not None, "a stream's output has metrics"
        output.metrics.stages = flight.stage_metrics
        output.revised_prompt = None
        self._finish(flight, output)

    def _dispatch(self, flight: _Flight, payload: Any, lost: int | None = None) -> None:
        """Send ``flight`` to a replica of its stage (other than the ``lost`` one)."""
        stage = self.stages[flight.stage]
        key = flight.admitted.keys[flight.stage]
        with self._lock:
            index = None if flight.aborted else stage.route(key, lost)
            flight.replica, aborted = index, flight.aborted
        if aborted:
            self._finish(flight, error=RequestAbortedError(flight.request_id))
            return
        if index is None:
            why = "no replica is alive" if lost is None else f"replica {lost} was lost and no other is alive"
            self._finish(flight, error=StageUnavailableError(stage.stage_id, why, flight.request_id))
            return
        on_preview = None
        if flight.stage == self._talker:
            assert self._speech is not None, "a talker has a codec stage"
            on_preview = functools.partial(self._speech.tokens, flight.request_id)
            if lost is not None:
                self._speech.rerun(flight.request_id)
        elif flight.on_preview is not None and flight.stage == self._denoiser:
            on_preview = functools.partial(self._preview, flight)
        try:
            inner = stage.replicas[index].submit(
                flight.request_id, flight.revised_prompt or flight.prompt, flight.admitted.params, payload, on_preview
            )
        except BaseException as exc:  # noqa: BLE001 - the request fails; the caller's future says why
            self._settle(flight, payload, index, exc)
            return
        if flight.aborted:  # aborted while it was being submitted, before the replica knew it
            stage.replicas[index].abort(flight.request_id)
        inner.add_done_callback(lambda done: self._settle(flight, payload, index, done.exception(), done))

    def _preview(self, flight: _Flight, preview: Preview) -> None:
        with self._lock:
            if preview.index < flight.previews:
                return
            flight.previews = preview.index + 1
        assert flight.on_preview is not None, "a flight with one is previewed"
        flight.on_preview(preview)

    def _settle(
        self, flight: _Flight, payload: Any, index: int, error: BaseException | None, done: Future | None = None
    ) -> None:
        stage = self.stages[flight.stage]
        stage.release(index, flight.admitted.keys[flight.stage])
        with self._lock:
            flight.replica = None
            retry = isinstance(error, ReplicaLostError) and not flight.retried and not flight.aborted
            flight.retried |= retry
        if retry:
            metrics.request_retries.labels(str(stage.stage_id)).inc()
            logger.warning("request %s: %s; re-running it on another replica (same seed)", flight.request_id, error)
            self._dispatch(flight, payload, lost=index)
        elif isinstance(error, ReplicaLostError):
            lost_again = StageUnavailableError(stage.stage_id, f"{error} (after a retry)", flight.request_id)
            self._finish(flight, error=RequestAbortedError(flight.request_id) if flight.aborted else lost_again)
        elif error is not None:
            self._finish(flight, error=error)
        else:
            assert done is not None, "a call that did not fail is done"
            self._advance(flight, done.result())

    def _advance(self, flight: _Flight, output) -> None:
        """The stage that held ``flight`` is done with it: on to the next stage, or finish with its output."""
        if len(self.stages) == 1:
            self._finish(flight, output)
            return
        config = self.stages[flight.stage].stage_config
        flight.stage_metrics.append(StageMetrics.of(config.stage_id, config.stage_type, output.metrics))
        if flight.stage == self._talker:
            assert self._speech is not None, "a talker has a codec stage"
            self._speech.close(flight.request_id, output)  # its last chunk; the stream finishes the request
            return
        if flight.stage + 1 < len(self.stages):
            payload = output.payload
            if self._prompt_writers[flight.stage]:
                flight.revised_prompt, payload = payload, None  # the next stage takes the request itself
            self._enter(flight, flight.stage + 1, payload)
            return
        output.metrics = across_stages(flight.stage_metrics, self.stages[self._denoiser].stage_id)
        output.prompt, output.revised_prompt = flight.prompt, flight.revised_prompt  # the stages ran on the revised
        self._finish(flight, output)

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(state, fraction of denoising steps done)`` of a request in flight; state is waiting or running."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None:
                return None
            stage, replica = flight.stage, flight.replica
        if stage != self._denoiser or replica is None:
            return ("waiting", 0.0) if stage <= self._denoiser else ("running", 1.0)
        return self.stages[stage].replicas[replica].progress(request_id)

    @property
    def speech_card(self) -> SpeechCard | None:
        """A speech model's card, as its codec stage read it; ``None`` for a diffusion model."""
        return None if self._speech is None else self._speech.card

    @property
    def model_card(self) -> ModelCard:
        """The model's card, as the stage that holds the denoiser read it (a speech model has `speech_card`)."""
        card = self.stages[self._denoiser].info.card
        assert card is not None, "the stage that denoises has a card"
        return card

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if it is not in flight."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None:
                return False
            flight.aborted = True
            stage, replica = flight.stage, flight.replica
        if replica is not None:  # else it is between replicas or stages, where the flag stops it
            self.stages[stage].replicas[replica].abort(request_id)
        elif stage == self._talker:  # its talker is done: its last windows are decoding
            assert self._speech is not None, "a talker has a codec stage"
            self._speech.abort(request_id)
        return True

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch, over all stages (`StageRuntime.num_waiting`)."""
        return sum(stage.num_waiting for stage in self.stages)

    @property
    def is_alive(self) -> bool:
        """Whether every stage has a live replica."""
        return all(stage.is_alive for stage in self.stages)

    def health(self) -> list[StageHealth]:
        return [stage.health() for stage in self.stages]

    def sleep(self, level: int = 1) -> None:
        """Put every replica of every diffusers stage to sleep at ``level`` (diffusion/features/sleep.py), stage by
        stage; returns once all sleep, their running batches finished. Requests that arrive meanwhile wait."""
        for stage in self.stages:
            config = stage.stage_config
            check_level(level, config.cpu_offload, config.quantization, config.load_format)
        with self._sleep_lock:  # one sleep or wake-up at a time, so that every stage ends in the same state
            for stage in self._sleepers:
                wait(stage.call("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the memory of ``tags`` (``None``: all) on every replica; returns once all serve again (or, for a
        partial ``tags``, have woken those)."""
        tags = check_tags(tags)
        with self._sleep_lock:
            for stage in self._sleepers:
                wait(stage.call("wake_up", tags))

    @property
    def is_sleeping(self) -> bool:
        """Whether every live replica of every diffusers stage sleeps."""
        return all(stage.health().status == "sleeping" for stage in self._sleepers)

    @property
    def _sleepers(self) -> list[StageRuntime]:
        """The stages whose replicas sleep and wake (`StageRuntime.sleeps`: an llm stage serves on)."""
        return [stage for stage in self.stages if stage.sleeps]

    def _replica_metrics(self) -> list:
        return [families for stage in self.stages for families in stage.collect_metrics()]

    def shutdown(self) -> None:
        metrics.replica_metrics.discard(self._replica_metrics)
        for stage in self.stages:
            stage.shutdown()


AsyncOmniEngine = OmniEngine
"""The name the design contract (shared/design/ARCHITECTURE.md) gives this engine; it is not async itself."""
