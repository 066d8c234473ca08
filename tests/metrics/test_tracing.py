"""``--otlp-traces-endpoint``: each completed request's span, as a real OTLP receiver in this process gets it (the
way vLLM's tracing tests receive theirs), under the caller's ``traceparent``."""

import threading
from concurrent import futures

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from vllm_omni.testing.processes.server import free_port, in_process_server

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self):
        self.spans = []
        self.changed = threading.Condition()

    def Export(self, request, context):  # noqa: N802 - the service's method name
        with self.changed:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, name: str):
        with self.changed:
            assert self.changed.wait_for(lambda: any(s.name == name for s in self.spans), timeout=120)
            return list(self.spans)


@pytest.fixture
def receiver():
    receiver, port = Receiver(), free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(None)


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


def _attributes(span_or_event) -> dict:
    return {a.key: _value(a.value) for a in span_or_event.attributes}


def test_a_request_becomes_a_span_under_its_traceparent_with_phases_and_components(tiny_flux, receiver, monkeypatch):
    receiver, endpoint = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export soon (the test waits for the span, not a time)
    with in_process_server(tiny_flux, serving={"otlp_traces_endpoint": endpoint}) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        response = client.images.generate(
            model="tiny",
            prompt="a fox",
            size="32x32",
            extra_body={"num_inference_steps": 3},
            extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
        assert len(response.data) == 1
        spans = receiver.wait_for("vllm_omni.images")
    request = next(s for s in spans if s.name == "vllm_omni.images")
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    assert request.kind == request.SPAN_KIND_SERVER
    attributes = _attributes(request)
    assert attributes["gen_ai.response.model"] == "tiny" and attributes["gen_ai.request.id"].startswith("img-")
    assert (attributes["vllm_omni.width"], attributes["vllm_omni.height"]) == (32, 32)
    assert attributes["vllm_omni.num_inference_steps"] == 3
    assert attributes["vllm_omni.batch_size"] == 1.0 and attributes["vllm_omni.replica"] == 0
    assert attributes["vllm_omni.stages"] == [0]

    children = sorted((s for s in spans if s.parent_span_id == request.span_id), key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in children] == [
        "parse",
        "validation",
        "completion",
        "queue",
        "execution",
        "handoff",
        "encoding",
        "response",
    ]
    for before, after in zip(children, children[1:], strict=False):  # back to back, inside the request's span
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    assert request.start_time_unix_nano <= children[0].start_time_unix_nano
    assert children[-1].end_time_unix_nano <= request.end_time_unix_nano
    execution = children[4]
    events = {event.name: _attributes(event)["vllm_omni.duration_ms"] for event in execution.events}
    assert list(events) == ["text_encoder", "text_encoder_2", "denoise", "denoise_step", "vae_decode", "postprocess"]
    assert all(ms > 0 for ms in events.values())
    assert sum(v for k, v in events.items() if k != "denoise_step") * 1e6 <= (
        execution.end_time_unix_nano - execution.start_time_unix_nano
    )


def test_without_the_flag_no_tracer_is_built():
    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.entrypoints.openai.server_state import ServerState

    state = ServerState.create("unused", [], ServingConfig(served_model_names=["m"]), on_fatal=print)
    assert state.tracer is None and state.trace({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) is None
