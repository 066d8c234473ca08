"""The OpenAI-compatible HTTP server on uvicorn: serve until SIGTERM/SIGINT, drain, and give the exit code.

The app is built in `app.py`; each API has its own folder (`images/`, `videos/`, `chat/`, each with its
`api_router.py`), and the operator's routes are in `admin/` (`models.py`, `health.py`, ...).
"""

from __future__ import annotations

import signal

import uvicorn

from vllm_omni.config import StageDeployConfig
from vllm_omni.config.model_source import ModelSource
from vllm_omni.config.serving import ServingConfig
from vllm_omni.entrypoints.openai.app import build_app
from vllm_omni.entrypoints.openai.server_state import ServerState
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        self.state.draining = True  # /health and new requests answer 503 while running requests finish
        if sig == signal.SIGTERM:
            # An orderly stop: drain and exit 0 (uvicorn would re-raise the signal after draining).
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def run_server(source: ModelSource, stage_configs: list[StageDeployConfig], serving: ServingConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    failure: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        failure.append(exc)
        server.should_exit = True

    app = build_app(source, stage_configs, serving, on_fatal)
    config = uvicorn.Config(
        app,
        # uvicorn annotates host as str; None (vLLM's default) goes to asyncio's create_server: every interface
        host=serving.host,  # type: ignore[arg-type]
        port=serving.port,
        log_level=serving.uvicorn_log_level,
        access_log=serving.access_log,
        ssl_keyfile=serving.ssl_keyfile,
        ssl_certfile=serving.ssl_certfile,
        root_path=serving.root_path,
        # uvicorn annotates it as int; it is a timeout that asyncio.wait_for takes as any number of seconds
        timeout_graceful_shutdown=serving.shutdown_timeout_s,  # type: ignore[arg-type]
    )
    server = _Server(config, app.state.server)
    logger.info(
        "Serving %s as %s on %s:%d", source.model, serving.served_model_names, serving.host or "0.0.0.0", serving.port
    )
    server.run()
    return 1 if failure else 0
