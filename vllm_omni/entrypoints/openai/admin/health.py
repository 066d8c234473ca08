"""What an operator's probes read: ``GET /health`` (is every stage up) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_omni.entrypoints.openai.errors import error_response
from vllm_omni.entrypoints.openai.server_state import ServerState


async def health(raw_request: Request) -> Response:
    """200 while every stage has a live replica (``status`` says ``degraded`` when some are down, ``sleeping`` while
    the diffusers stages sleep: alive, taking requests that run once awake), else 503."""
    state: ServerState = raw_request.app.state.server
    reason = state.unavailable_reason()
    if reason is not None:
        return error_response(503, f"Service unavailable: {reason}", code="service_unavailable")
    stages = [
        {"stage_id": h.stage_id, "status": h.status, "num_replicas": h.num_replicas, "alive_replicas": h.alive}
        for h in state.loaded_omni.health()
    ]
    statuses = {s["status"] for s in stages}
    status = "ok" if statuses == {"ok"} else "sleeping" if statuses <= {"ok", "sleeping"} else "degraded"
    return JSONResponse({"status": status, "stages": stages})


async def prometheus_metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def build_health_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    return router
