"""OpenTelemetry traces of requests (``--otlp-traces-endpoint``, vLLM's flag; docs/observability.md).

Each completed request becomes one server span, a child of the caller's span when the request carries a W3C
``traceparent``. Its phases (`PhaseTimer`: parse, validation, completion, queue, execution, handoff, encoding,
response) are child spans laid back to back in the order they ran, and the execution span carries one event per
pipeline component (`RequestMetrics.components`) with its milliseconds. The attributes name the model, the size,
the steps, the batch size, the replica and the stages. Spans go to the endpoint through vLLM's OTLP exporter
(gRPC, or HTTP with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``) from a batch processor's thread, off
the event loop. The tracer is the server's own, not the process's global one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_omni.config.vllm_device import set_device_hint

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from vllm_omni.outputs import RequestMetrics
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams


@dataclass
class RequestTrace:
    """What one request's span needs beside its phases: the tracer, the caller's context, and what the engine
    reported (`record`)."""

    tracer: RequestTracer
    parent: Context | None
    request_id: str | None = None
    metrics: RequestMetrics | None = None
    params: OmniDiffusionSamplingParams | None = None

    def record(self, request_id: str, metrics: RequestMetrics, params: OmniDiffusionSamplingParams) -> None:
        self.request_id, self.metrics, self.params = request_id, metrics, params


class RequestTracer:
    """The server's tracer: an OTLP exporter to ``endpoint`` behind a batch span processor."""

    def __init__(self, endpoint: str, model: str, stage_ids: list[int]):
        set_device_hint()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from vllm.tracing.otel import get_span_exporter

        resource = Resource.create({"service.name": "vllm-omni", "vllm.process_id": str(os.getpid())})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(get_span_exporter(endpoint)))
        self.tracer = self.provider.get_tracer("vllm_omni")
        self.model = model
        self.stage_ids = stage_ids

    def start(self, headers: Mapping[str, str]) -> RequestTrace:
        """A request's trace, under the caller's span when ``headers`` carry a ``traceparent``."""
        set_device_hint()
        from vllm.tracing import extract_trace_context

        return RequestTrace(self, extract_trace_context(headers))

    def export(self, trace: RequestTrace, api: str, start_ns: int, phases: list[tuple[str, int, int]]) -> None:
        """One request's span from ``start_ns`` until now, with its ``phases`` (name, start, end in ns)."""
        set_device_hint()
        from opentelemetry.trace import SpanKind, set_span_in_context
        from vllm.tracing import SpanAttributes

        attributes: dict[str, Any] = {SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model, "vllm_omni.api": api}
        if trace.request_id is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_ID] = trace.request_id
        attributes.update(_attributes(trace.params, trace.metrics, self.stage_ids))
        span = self.tracer.start_span(
            f"vllm_omni.{api}", context=trace.parent, kind=SpanKind.SERVER, attributes=attributes, start_time=start_ns
        )
        inside = set_span_in_context(span)
        components = (trace.metrics.components if trace.metrics is not None else None) or {}
        for phase, start, end in phases:
            child = self.tracer.start_span(phase, context=inside, start_time=start)
            if phase == "execution":
                for name, ms in components.items():
                    child.add_event(name, {"vllm_omni.component": name, "vllm_omni.duration_ms": ms}, timestamp=end)
            child.end(end_time=end)
        span.end(end_time=time.time_ns())

    def shutdown(self) -> None:
        """Export the spans still queued, then stop."""
        self.provider.shutdown()


def _attributes(
    params: OmniDiffusionSamplingParams | None, metrics: RequestMetrics | None, stage_ids: list[int]
) -> dict[str, Any]:
    """The attributes of what the request asked for and how it ran."""
    attributes: dict[str, Any] = {}
    if params is not None:
        asked = {
            "width": params.width,
            "height": params.height,
            "num_frames": params.num_frames,
            "num_inference_steps": params.num_inference_steps,
            "num_outputs_per_prompt": params.num_outputs_per_prompt,
        }
        attributes.update({f"vllm_omni.{k}": v for k, v in asked.items() if v is not None})
    if metrics is not None:
        attributes.update(
            {
                "vllm_omni.batch_size": float(metrics.batch_size),
                "vllm_omni.replica": metrics.replica,
                "vllm_omni.queue_ms": float(metrics.queue_ms),
                "vllm_omni.exec_ms": float(metrics.exec_ms),
                "vllm_omni.stages": [s.stage_id for s in metrics.stages] if metrics.stages else stage_ids,
            }
        )
    return attributes
