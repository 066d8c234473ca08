"""`ServingConfig`: the HTTP server's settings and the request limits an operator can set."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from vllm_omni.config.profiler import ProfilerSetting

QualityLevel = Literal["low", "medium", "high"]
"""The Images API's ``quality`` levels that choose a step count (`ServingConfig.quality_steps`)."""


class ServingConfig(BaseModel):
    """Settings of ``vllm serve MODEL --omni``; each field is also a flag (see docs/serving.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    host: str | None = None
    """Address to bind (``None``: all interfaces)."""

    port: int = Field(default=8000, ge=0, le=65535)
    """Port to listen on."""

    served_model_names: list[str] = Field(default_factory=list, min_length=1)
    """Names the model answers to in ``model``; the first is the one ``/v1/models`` reports first."""

    api_keys: list[str] = Field(default_factory=list)
    """When not empty, every ``/v1/*`` route requires ``Authorization: Bearer <one of the keys>``."""

    allowed_origins: list[str] = Field(default_factory=list)
    """CORS allowed origins (empty: no CORS headers)."""

    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    """CORS allowed methods."""

    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    """CORS allowed headers."""

    allow_credentials: bool = False
    """CORS: allow credentials."""

    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Log level of uvicorn."""

    access_log: bool = True
    """Log one line per HTTP request."""

    ssl_keyfile: str | None = None
    """TLS key file (with ``ssl_certfile``: serve HTTPS)."""

    ssl_certfile: str | None = None
    """TLS certificate file."""

    root_path: str = ""
    """ASGI root path when the server sits behind a path-rewriting proxy."""

    disable_playground: bool = False
    """Do not serve the playground page at ``/`` and ``/playground`` (they answer 404)."""

    otlp_traces_endpoint: str | None = None
    """vLLM's flag: send each completed request's trace (its phases and pipeline components) to this OpenTelemetry
    collector, e.g. ``http://localhost:4317`` ([observability](observability.md#traces))."""

    strict_fields: bool = False
    """Refuse (400) a request field the served model would not use, instead of accepting it with a ``Warning``
    header."""

    max_waiting_requests: int = Field(default=64, ge=0)
    """Requests that may wait for a batch; one more is answered 429 at once instead of queueing."""

    max_request_body_bytes: int = Field(default=1024 * 1024, ge=1)
    """Largest request body; a larger one is answered 413 before it is read."""

    max_image_pixels: int = Field(default=2048 * 2048, ge=1)
    """Largest ``width × height`` a request may ask for."""

    max_input_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    """Largest input image file (``/v1/images/edits``, a video's ``input_reference``), in bytes."""

    max_input_image_pixels: int = Field(default=4096 * 4096, ge=1)
    """Largest ``width × height`` of an input image, read from its header before it is decoded."""

    allowed_media_domains: list[str] | None = None
    """vLLM's flag: the hosts an input image URL (``image_url``, ``image_reference``) may be fetched from, compared
    exactly; a host listed here may resolve to a private address. Unset: any host whose addresses are all public."""

    allowed_local_media_path: str = ""
    """vLLM's flag: a folder whose files a request may name as ``file://`` URLs (empty: none)."""

    max_inference_steps: int = Field(default=200, ge=1, le=1000)
    """Most ``num_inference_steps`` a request may ask for."""

    quality_steps: dict[QualityLevel, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    """Denoising steps of the Images API's ``quality`` levels (low, medium, high), replacing the default mapping
    (a quarter, half, all of the model's default steps) for the levels given."""

    max_prompt_length: int = Field(default=4000, ge=1)
    """Longest ``prompt`` (and ``negative_prompt``), in characters."""

    max_video_frames: int = Field(default=161, ge=1)
    """Most frames a video request may ask for (``num_frames``, or ``seconds`` × fps)."""

    video_ttl_s: float = Field(default=3600.0, gt=0)
    """How long a finished video job (and its MP4) is kept."""

    video_store_max_bytes: int = Field(default=1024**3, ge=0)
    """Memory budget for finished MP4s; the oldest finished jobs are dropped first when it is exceeded."""

    image_url_ttl_s: float = Field(default=3600.0, gt=0)
    """How long an image returned as ``url`` stays downloadable."""

    image_store_max_bytes: int = Field(default=512 * 1024 * 1024, ge=0)
    """Memory budget for ``url`` images; the oldest are dropped first when it is exceeded."""

    shutdown_timeout_s: float = Field(default=30.0, ge=0)
    """On SIGTERM, how long running requests may take to finish before they are cancelled."""

    profiler_config: ProfilerSetting = None
    """vLLM's ``ProfilerConfig`` (``--profiler-config``): with ``profiler`` ``torch``, ``POST /start_profile`` and
    ``POST /stop_profile`` record a torch profile of every engine process into ``torch_profiler_dir``."""

    @field_validator("allowed_local_media_path")
    @classmethod
    def _a_folder(cls, path: str) -> str:
        if path and not Path(path).is_dir():
            raise ValueError(f"{path} is not a folder")
        return path

    @field_validator("quality_steps")
    @classmethod
    def _quality_steps_within_the_limit(cls, steps: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        limit = info.data.get("max_inference_steps")  # declared before quality_steps: validated first
        over = [f"{level}={n}" for level, n in steps.items() if limit is not None and n > limit]
        if over:
            raise ValueError(f"steps above --max-inference-steps {limit}: {', '.join(over)}")
        return steps
