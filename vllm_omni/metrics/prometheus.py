"""Every ``vllm_omni:*`` metric, defined once. Served by ``GET /metrics``; see docs/serving.md.

Server metrics live in this process's default registry. Engine metrics live in a registry per
replica (`EngineMetrics`), because a replica may run in another process (a Ray actor); the
server's `replica_metrics` collector gathers every live replica's at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from vllm_omni.metrics.tracing import RequestTrace
    from vllm_omni.outputs import OmniRequestOutput
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *_SECONDS_BUCKETS)


class EngineMetrics:
    """The metrics one engine replica records, in its own registry, each labelled with its stage and replica."""

    def __init__(self, stage: int, replica: int, task: str):
        self.registry = CollectorRegistry(auto_describe=False)
        ids = {"stage": str(stage), "replica": str(replica)}
        labels = ids | {"task": task}
        # Declared in this order, which is the order a scrape lists them in.
        self.batch_num_requests, self.queue_time, self.batch_execution_time = self._batch_histograms(labels)
        self._component_seconds = self._component_histogram(labels)
        self._labels = labels
        self._components: dict[str, Histogram] = {}
        self.oom_batch_splits, self.cache_skipped_steps, self.audio_seconds, self.num_preemptions = (
            self._event_counters(ids)
        )
        (
            self.num_requests_running,
            self.num_requests_waiting,
            self.lora_adapters_resident,
            self.engine_sleeping,
            self.preempted_state_bytes,
        ) = self._state_gauges(ids)

    def _batch_histograms(self, labels: dict[str, str]) -> tuple[Histogram, Histogram, Histogram]:
        """What the scheduler's batches hold and how long they and their requests take: the size of each executed
        batch, a request's wait before it ran, and each batch's wall time."""

        def histogram(name: str, documentation: str, buckets: tuple) -> Histogram:
            return Histogram(name, documentation, list(labels), buckets=buckets, registry=self.registry).labels(
                **labels
            )

        batch_num_requests = histogram(
            "vllm_omni:batch_num_requests",
            "Requests in each executed batch (one observation per pipeline call; in step mode per denoiser forward).",
            _BATCH_BUCKETS,
        )
        queue_time = histogram(
            "vllm_omni:request_queue_time_seconds",
            "Time a request waited from arrival until the engine started on it.",
            _SECONDS_BUCKETS,
        )
        batch_execution_time = histogram(
            "vllm_omni:batch_execution_time_seconds",
            "Wall time of each executed diffusion batch (one pipeline call or denoiser step).",
            _SECONDS_BUCKETS,
        )
        return batch_num_requests, queue_time, batch_execution_time

    def _component_histogram(self, labels: dict[str, str]) -> Histogram:
        """Where a pipeline call's time goes, by component; unlabelled by component here, since the components are
        only known as they report (`component`)."""
        return Histogram(
            "vllm_omni:component_seconds",
            "Time of each pipeline component (component_timings): one observation per call of a text encoder, "
            "vae_decode, vae_encode, preview or postprocess, per denoise_step over a batch, and per request for its "
            "denoise loop (see docs/observability.md).",
            [*labels, "component"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )

    def _event_counters(self, ids: dict[str, str]) -> tuple[Counter, Counter, Counter, Counter]:
        """What the replica counts: batches split after running out of memory, computations the step cache
        skipped, the seconds of audio it made, and preemptions."""
        oom_batch_splits = Counter(
            "vllm_omni:oom_batch_splits",
            "Batches that ran out of device memory and were split in halves and retried.",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        cache_skipped_steps = Counter(
            "vllm_omni:cache_skipped_steps",
            "Block computations the step cache (cache_backend) skipped: a module under diffusers' cache hooks that "
            "returned a cached or predicted output instead of running, counted per request and denoiser call.",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        audio_seconds = Counter(
            "vllm_omni:audio_seconds",
            "Seconds of audio an audio model made: each output's num_outputs_per_prompt waveforms, samples over the "
            "sample rate (its metrics.audio_seconds; the warm-up's included).",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        num_preemptions = Counter(  # vLLM's name
            "vllm_omni:num_preemptions",
            "Running requests that left the batch at a step boundary for a request of better priority (step mode, "
            "scheduling_policy priority); each keeps its state and resumes at the step it left.",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        return oom_batch_splits, cache_skipped_steps, audio_seconds, num_preemptions

    def _state_gauges(self, ids: dict[str, str]) -> tuple[Gauge, Gauge, Gauge, Gauge, Gauge]:
        """The replica's state now: requests running and waiting, LoRA adapters loaded, whether it sleeps, and what
        its preempted requests keep."""
        num_requests_running = Gauge(
            "vllm_omni:num_requests_running", "Requests in the batch now running.", list(ids), registry=self.registry
        ).labels(**ids)
        num_requests_waiting = Gauge(
            "vllm_omni:num_requests_waiting", "Requests waiting to be scheduled.", list(ids), registry=self.registry
        ).labels(**ids)
        lora_adapters_resident = Gauge(
            "vllm_omni:lora_adapters_resident",
            "LoRA adapters loaded in the replica now (at most max_loras).",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        engine_sleeping = Gauge(
            "vllm_omni:engine_sleeping",
            "1 while the replica sleeps (sleep, at any level; requests wait for wake_up), else 0.",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        preempted_state_bytes = Gauge(
            "vllm_omni:preempted_state_bytes",
            "Bytes of the state the preempted requests keep now (step mode, scheduling_policy priority; at most "
            "max_preempted_state_mb).",
            list(ids),
            registry=self.registry,
        ).labels(**ids)
        return (
            num_requests_running,
            num_requests_waiting,
            lora_adapters_resident,
            engine_sleeping,
            preempted_state_bytes,
        )

    def component(self, name: str, seconds: float) -> None:
        """One observation of component ``name`` in ``vllm_omni:component_seconds``."""
        child = self._components.get(name)
        if child is None:  # once per component: labels() takes a lock and builds the key every time
            child = self._components[name] = self._component_seconds.labels(**self._labels, component=name)
        child.observe(seconds)

    def collect(self) -> list[Metric]:
        """This replica's metric families (picklable, so a Ray actor can return them)."""
        return list(self.registry.collect())


class ReplicaMetricsCollector:
    """Serves the engine metrics of every live replica from the default registry, one family per name.

    One instance (`replica_metrics`) is registered; each engine adds a source that lists its replicas'
    families and removes it when it shuts down.
    """

    def __init__(self):
        self._sources: list[Callable[[], Iterable[list[Metric]]]] = []
        self._lock = threading.Lock()
        REGISTRY.register(self)

    def describe(self) -> list[Metric]:
        return []  # the families come and go with the engines: nothing to check at registration

    def add(self, source: Callable[[], Iterable[list[Metric]]]) -> None:
        with self._lock:
            self._sources.append(source)

    def discard(self, source: Callable[[], Iterable[list[Metric]]]) -> None:
        with self._lock:
            if source in self._sources:
                self._sources.remove(source)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            sources = list(self._sources)
        merged: dict[str, Metric] = {}
        for source in sources:
            for families in source():
                for family in families:
                    if family.name not in merged:
                        merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name].samples.extend(family.samples)
        return merged.values()


replica_metrics = ReplicaMetricsCollector()


stage_max_num_seqs = Gauge(
    "vllm_omni:stage_max_num_seqs",
    "Resolved max_num_seqs of each stage (per replica), labelled with the layer it came from.",
    ["stage", "source"],
)
stage_knob_info = Gauge(
    "vllm_omni:stage_knob_info",
    "1 for every knob that applies to a stage, labelled with its resolved value and the layer it came from "
    "(the start-up line's provenance).",
    ["stage", "knob", "value", "source"],
)
stage_replicas = Gauge(
    "vllm_omni:stage_replicas",
    "Replicas of each stage by state: alive (taking requests) or down (dead or restarting).",
    ["stage", "state"],
)
replica_restarts = Counter(
    "vllm_omni:replica_restarts",
    "Times a replica was lost (its process died) and came back.",
    ["stage", "replica"],
)
request_retries = Counter(
    "vllm_omni:request_retries",
    "Requests re-run on another replica because the replica running them was lost.",
    ["stage"],
)
video_requests = Counter(
    "vllm_omni:video_generation_requests",
    "Video generation jobs by outcome: completed, invalid, overloaded, unavailable, failed, cancelled.",
    ["outcome"],
)
lora_requests = Counter(
    "vllm_omni:lora_requests",
    "Requests accepted by the engine per LoRA adapter they apply ('base' for none; a stack counts each adapter).",
    ["adapter"],
)
image_requests = Counter(
    "vllm_omni:image_generation_requests",
    "Image generation requests by outcome: completed, invalid, overloaded, unavailable, failed, aborted "
    "(requests refused for a missing or wrong API key are not counted).",
    ["outcome"],
)
audio_requests = Counter(
    "vllm_omni:audio_generation_requests",
    "Audio generation requests (POST /v1/audio/generate) by outcome: completed, invalid, overloaded, unavailable, "
    "failed, aborted (requests refused for a missing or wrong API key are not counted).",
    ["outcome"],
)
speech_requests = Counter(
    "vllm_omni:speech_generation_requests",
    "Speech requests (POST /v1/audio/speech) by outcome: completed, invalid, overloaded, unavailable, failed, aborted "
    "(requests refused for a missing or wrong API key are not counted).",
    ["outcome"],
)
ignored_fields = Counter(
    "vllm_omni:ignored_fields",
    "Request fields the served model would not use, accepted with a Warning header and dropped, by API (images, "
    "videos, audio, speech) and field (without --strict-fields; with it they are refused).",
    ["api", "field"],
)

request_phase_seconds = Histogram(
    "vllm_omni:request_phase_seconds",
    "Where a completed request's time went on the server, by API (images, videos, audio, speech) and phase: parse, "
    "validation, completion, handoff, queue, execution, encoding, response (see docs/serving.md).",
    ["api", "phase"],
    buckets=_PHASE_BUCKETS,
)

PRIORITY_CLASS_BOUND = 10
"""The ``priority`` label is the request's priority clipped to ``[-10, 10]``: at most 21 series per histogram, however
many values clients send (``"10"`` holds every priority from 10 up, ``"-10"`` every one from -10 down)."""

request_queue_time_by_priority = Histogram(
    "vllm_omni:request_queue_time_by_priority_seconds",
    "Time a completed request waited for the engines, summed over its stages (its queue_ms), by priority class "
    "(the request's priority clipped to [-10, 10]).",
    ["priority"],
    buckets=_SECONDS_BUCKETS,
)
e2e_request_latency = Histogram(
    "vllm_omni:e2e_request_latency_seconds",
    "Time from the engine taking a request until its output was ready, one observation per completed request, by "
    "priority class (the request's priority clipped to [-10, 10]).",
    ["priority"],
    buckets=_SECONDS_BUCKETS,
)

time_to_first_audio = Histogram(
    "vllm_omni:time_to_first_audio_seconds",
    "Speech: time from the engine taking a request until its first audio chunk was decoded.",
    buckets=_SECONDS_BUCKETS,
)
speech_real_time_factor = Histogram(
    "vllm_omni:speech_real_time_factor",
    "Speech: each completed stream's wall time over the seconds of audio it made (below 1: faster than real time).",
    buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 8, 16, 64),
)
speech_underrun_gap = Histogram(
    "vllm_omni:speech_underrun_gap_seconds",
    "Speech: the seconds of silence a listener playing each completed stream in real time from its first chunk "
    "would have heard, waiting for later chunks (upstream's total_gap).",
    buckets=(0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


def priority_class(priority: int) -> str:
    """The ``priority`` label of a request's priority (`PRIORITY_CLASS_BOUND`)."""
    return str(max(-PRIORITY_CLASS_BOUND, min(PRIORITY_CLASS_BOUND, priority)))


def observe_priority(priority: int, queue_s: float, e2e_s: float) -> None:
    """One completed request in the histograms by priority class."""
    label = priority_class(priority)
    request_queue_time_by_priority.labels(label).observe(queue_s)
    e2e_request_latency.labels(label).observe(e2e_s)


class PhaseTimer:
    """One request's phases, timed back to back with ``time.perf_counter`` and observed together in
    ``vllm_omni:request_phase_seconds`` once the request has completed (`observe`); with a ``trace`` (the server's
    ``--otlp-traces-endpoint``), exported as its span too."""

    __slots__ = ("_first", "_last", "_wall_ns", "segments", "trace")

    def __init__(self, trace: RequestTrace | None = None):
        self._first = self._last = time.perf_counter()
        self._wall_ns = time.time_ns()
        self.segments: list[tuple[str, float, float]] = []
        """Each phase as it ran: its name, start and end (``perf_counter``), in order."""
        self.trace = trace

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase (a phase marked twice sums)."""
        phases: dict[str, float] = {}
        for phase, start, end in self.segments:
            phases[phase] = phases.get(phase, 0.0) + end - start
        return phases

    def mark(self, phase: str) -> None:
        """``phase`` ran from the previous mark (or the timer's start) until now."""
        now = time.perf_counter()
        self.segments.append((phase, self._last, now))
        self._last = now

    def mark_engine(self, output: OmniRequestOutput, params: OmniDiffusionSamplingParams) -> None:
        """The request went through the engine since the previous mark: the queue and execution times its
        ``output`` reports (`RequestMetrics`), the rest (submitting it, handing its output back to this thread,
        between the stages of a split pipeline) as ``handoff``, laid out in that order."""
        now, metrics = time.perf_counter(), output.metrics
        assert metrics is not None, "a finished output has its metrics"
        queue_s, execution_s = metrics.queue_ms / 1000.0, metrics.exec_ms / 1000.0
        handoff_s = max(0.0, now - self._last - queue_s - execution_s)
        start = self._last
        for phase, seconds in (("queue", queue_s), ("execution", execution_s), ("handoff", handoff_s)):
            self.segments.append((phase, start, start + seconds))
            start += seconds
        self._last = now
        if self.trace is not None:
            self.trace.record(output.request_id, metrics, params)

    def observe(self, api: str) -> None:
        for phase, seconds in self.phases.items():
            child = _phase_children.get((api, phase))
            if child is None:  # once per (api, phase): labels() takes a lock and builds the key every time
                child = _phase_children[api, phase] = request_phase_seconds.labels(api, phase)
            child.observe(seconds)
        if self.trace is not None:
            ns = [(phase, self._ns(start), self._ns(end)) for phase, start, end in self.segments]
            self.trace.tracer.export(self.trace, api, self._wall_ns, ns)

    def _ns(self, perf: float) -> int:
        """A ``perf_counter`` reading as wall-clock nanoseconds."""
        return self._wall_ns + int((perf - self._first) * 1e9)


_phase_children: dict[tuple[str, str], Histogram] = {}
