"""Where a request's time goes inside the pipeline: per-component timings (``component_timings``;
docs/observability.md).

The components are the pipeline's own modules, timed where they run, so the same hooks serve a whole pipeline
call (request mode), the stepper (step mode) and every stage of a split pipeline:

- each text encoder (``text_encoder``, ``text_encoder_2``, ..., ``image_encoder``) and each audio pipeline's
  conditioner (``projection_model``, ``duration_embedder``, ``condition_encoder``): its ``forward``;
- ``vae_decode`` / ``vae_encode``: the VAE's ``decode`` / ``encode`` (an audio VAE's too: Stable Audio's Oobleck);
- ``vocoder``: an audio pipeline's vocoder (AudioLDM 2's), its ``forward``, after the VAE's decode;
- ``postprocess``: the image or video processor turning decoded pixels into the output type;
- ``preview``: making a partial image (a VAE call inside it counts as the preview's);
- ``denoise_step``: one denoising step over a batch (its denoiser forwards and scheduler update), and
  ``denoise``: a request's denoising loop (its steps).

An engine opens a `ComponentTimer.recording` around the work it does for some requests; a component that runs on
that thread meanwhile adds its time to each of those requests (``DiffusionRequest.timings``) and is observed once
in ``vllm_omni:component_seconds``. Sections nest outermost-first: a VAE call inside a preview is the preview's.
On CUDA the time is measured with CUDA events, resolved once they have completed (at the latest when the request's
output is built), never with the wall clock around asynchronous kernels.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from vllm_omni.diffusion.pipeline.components import CONDITIONERS, DENOISERS, OUTPUT_PROCESSORS
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.logger import init_logger

if TYPE_CHECKING:
    from vllm_omni.config import OmniDiffusionConfig

logger = init_logger(__name__)

_SECTIONS = ("text_encoder", "image_encoder", *CONDITIONERS, "vocoder")
"""The components timed by their ``forward``, each under its name (``text_encoder_2`` too: a prefix)."""
_ORDER = ("image_encoder", "vae_encode", "denoise", "denoise_step", "preview", "vae_decode", "vocoder", "postprocess")
"""The order a record lists its components in, after the text encoders: the order they run in."""
_HOOKED = "_vllm_omni_timed"
"""The attribute that marks a component as hooked (image variants share their components with the pipeline)."""


@dataclass
class ComponentTimes:
    """One request's component times: seconds and calls per component, summed over the work it took part in."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, component: str, seconds: float) -> None:
        self.seconds[component] = self.seconds.get(component, 0.0) + seconds
        self.calls[component] = self.calls.get(component, 0) + 1

    def milliseconds(self) -> dict[str, float]:
        """What `RequestMetrics.components` reports: each component's total, ``denoise_step`` the mean step."""
        order = sorted(self.seconds, key=lambda name: (_ORDER.index(name) + 1 if name in _ORDER else 0, name))
        ms = {name: round(self.seconds[name] * 1000.0, 3) for name in order}
        if "denoise_step" in ms:
            ms["denoise_step"] = round(ms["denoise_step"] / self.calls["denoise_step"], 3)
        return ms


class Timed(Protocol):
    """What is timed: a request (`DiffusionRequest`) with its times."""

    request_id: str
    timings: ComponentTimes


class _Span:
    """A component's run between two clock readings, and whose times it adds to."""

    __slots__ = ("component", "end", "observed", "start", "times")

    def __init__(self, component: str, start, end, times: list[ComponentTimes], observed: bool):
        self.component, self.start, self.end, self.times, self.observed = component, start, end, times, observed


class _Scope:
    """What one thread is recording: its timer, the requests its work is for, and a pipeline call's loop marks."""

    def __init__(self, timer: ComponentTimer, requests: Sequence[Timed]):
        self.timer = timer
        self.times = [request.timings for request in requests]
        self.depth = 0
        """Sections open: only the outermost one records."""
        self.in_call = False
        """Inside a whole pipeline call (request mode), where the denoiser's forwards and the step callback mark the
        denoising steps."""
        self.loop_start = self.step_start = self.loop_end = None


_local = threading.local()


def _scope() -> _Scope | None:
    return getattr(_local, "scope", None)


class ComponentTimer:
    """One engine's component timings: its clock, the spans not yet resolved, and its histogram."""

    def __init__(
        self, device: torch.device, observe: Callable[[str, float], None], *, enabled: bool = True, log: bool = False
    ):
        """``observe(component, seconds)``: one histogram observation; ``enabled``: ``component_timings`` (off, a
        recording records nothing); ``log``: ``log_pipeline_timings`` (`log_batch` logs a line)."""
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.observe = observe
        self.log = log
        self._pending: list[_Span] = []
        self._lock = threading.Lock()

    def now(self):
        """A clock reading: a recorded CUDA event on CUDA, else ``perf_counter``."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def recording(self, requests: Sequence[Timed]) -> Iterator[None]:
        """Components run on this thread meanwhile count for ``requests``."""
        if not self.enabled:
            yield
            return
        outer = _scope()
        _local.scope = _Scope(self, requests)
        try:
            yield
        finally:
            _local.scope = outer
            self.flush(block=False)

    def span(self, component: str, start, end, times: list[ComponentTimes], observed: bool = True) -> None:
        """``component`` ran from ``start`` to ``end`` (clock readings) for ``times``; ``observed``: one histogram
        observation (``denoise`` is observed per request, by `finish`)."""
        span = _Span(component, start, end, times, observed)
        if not self.cuda:
            self._resolve(span)
            return
        with self._lock:
            self._pending.append(span)

    def flush(self, block: bool) -> None:
        """Resolve the CUDA spans that have completed (``block``: all of them, waiting for the device)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if block:  # threads beside the loop (step mode's encode and decode workers) record spans too
            for span in pending:
                span.end.synchronize()
        waiting = []
        for span in pending:
            if block or span.end.query():
                self._resolve(span)
            else:
                waiting.append(span)
        if waiting:
            with self._lock:
                self._pending[:0] = waiting

    def _resolve(self, span: _Span) -> None:
        seconds = span.start.elapsed_time(span.end) / 1000.0 if self.cuda else span.end - span.start
        for times in span.times:
            times.add(span.component, seconds)
        if span.observed:
            self.observe(span.component, seconds)

    def finish(self, request: Timed) -> dict[str, float] | None:
        """The request's component times in milliseconds, once its work is done (observing its ``denoise``);
        ``None`` when nothing was timed."""
        self.flush(block=self.cuda)
        times = request.timings
        if "denoise" in times.seconds:
            self.observe("denoise", times.seconds["denoise"])
        return times.milliseconds() or None

    def log_batch(self, stage: int, requests: Sequence[Timed]) -> None:
        """With ``log_pipeline_timings``: one line naming each component's time for ``requests`` (their mean)."""
        if not (self.enabled and self.log and requests):
            return
        self.flush(block=True)
        totals: dict[str, float] = {}
        for request in requests:
            for name, ms in request.timings.milliseconds().items():
                totals[name] = totals.get(name, 0.0) + ms / len(requests)
        steps = requests[0].timings.calls.get("denoise_step")
        parts = [
            f"{name} {ms:.1f} ms" + (f" ({steps} steps)" if name == "denoise" else "") for name, ms in totals.items()
        ]
        ids = ", ".join(request.request_id for request in requests)
        logger.info("Pipeline timings of stage %d, %d request(s) (%s): %s", stage, len(requests), ids, ", ".join(parts))


@contextlib.contextmanager
def section(component: str, requests: Sequence[Timed] | None = None) -> Iterator[None]:
    """``component`` runs inside: its time counts for ``requests`` (``None``: the recording's), unless a section
    is open already on this thread (the outermost one records)."""
    scope = _scope()
    if scope is None:
        yield
        return
    scope.depth += 1
    start = scope.timer.now() if scope.depth == 1 else None
    try:
        yield
    finally:
        scope.depth -= 1
        if start is not None:
            times = scope.times if requests is None else [request.timings for request in requests]
            scope.timer.span(component, start, scope.timer.now(), times)


@contextlib.contextmanager
def step(requests: Sequence[Timed]) -> Iterator[None]:
    """One denoising step of ``requests`` (step mode and the split ``denoise`` stage): it adds to their
    ``denoise_step`` and ``denoise``."""
    scope = _scope()
    if scope is None:
        yield
        return
    start = scope.timer.now()
    yield
    end, times = scope.timer.now(), [request.timings for request in requests]
    scope.timer.span("denoise_step", start, end, times)
    scope.timer.span("denoise", start, end, times, observed=False)


@contextlib.contextmanager
def pipeline_call() -> Iterator[None]:
    """A whole pipeline call (request mode): its denoising loop runs from the denoiser's first forward to the end of
    its last step (`step_end`, from the step callback; without one, the last forward)."""
    scope = _scope()
    if scope is None:
        yield
        return
    scope.in_call = True
    try:
        yield
    finally:
        scope.in_call = False
        if scope.loop_start is not None:
            scope.timer.span("denoise", scope.loop_start, scope.loop_end, scope.times, observed=False)
        scope.loop_start = scope.step_start = scope.loop_end = None


def step_end() -> None:
    """The pipeline's step callback: the step that began with the denoiser's first forward since the last one has
    ended."""
    scope = _scope()
    if scope is None or not scope.in_call or scope.step_start is None:
        return
    scope.loop_end = scope.timer.now()
    scope.timer.span("denoise_step", scope.step_start, scope.loop_end, scope.times)
    scope.step_start = None


@torch.compiler.disable  # a compiled denoiser runs it eagerly, outside its graph
def _denoiser_pre_forward(module, args) -> None:
    scope = _scope()
    if scope is not None and scope.in_call and scope.depth == 0 and scope.step_start is None:
        scope.step_start = scope.timer.now()
        if scope.loop_start is None:
            scope.loop_start = scope.step_start


@torch.compiler.disable
def _denoiser_forward(module, args, output) -> None:
    scope = _scope()
    if scope is not None and scope.in_call and scope.depth == 0 and scope.loop_start is not None:
        scope.loop_end = scope.timer.now()  # the loop's end when the pipeline has no step callback


def _enter_section(module, args) -> None:
    scope = _scope()
    if scope is not None:
        scope.depth += 1
        if scope.depth == 1:
            module._vllm_omni_start = scope.timer.now()


def _exit_section(component: str, module, args, output) -> None:
    scope = _scope()
    if scope is not None:
        scope.depth -= 1
        if scope.depth == 0 and getattr(module, "_vllm_omni_start", None) is not None:
            scope.timer.span(component, module._vllm_omni_start, scope.timer.now(), scope.times)
            module._vllm_omni_start = None


def _timed_method(component: str, method: Callable) -> Callable:
    @functools.wraps(method)
    def timed(*args, **kwargs) -> Any:
        with section(component):
            return method(*args, **kwargs)

    return timed


def install(pipeline) -> None:
    """Hook the pipeline's components so that they are timed inside a `ComponentTimer.recording` (a no-op
    outside one). Idempotent: an image variant shares its components with the pipeline it came from."""
    for name, component in pipeline.components.items():
        if not isinstance(component, torch.nn.Module) or getattr(component, _HOOKED, False):
            continue
        setattr(component, _HOOKED, True)
        if name in DENOISERS:
            component.register_forward_pre_hook(_denoiser_pre_forward)
            component.register_forward_hook(_denoiser_forward, always_call=True)
        elif name.startswith(_SECTIONS):
            component.register_forward_pre_hook(torch.compiler.disable(_enter_section))
            exit_hook = torch.compiler.disable(functools.partial(_exit_section, name))
            component.register_forward_hook(exit_hook, always_call=True)
        elif name == "vae":
            for method in ("decode", "encode"):
                if hasattr(component, method):
                    setattr(component, method, _timed_method(f"vae_{method}", getattr(component, method)))
    for attribute, method in OUTPUT_PROCESSORS:
        processor = getattr(pipeline, attribute, None)
        if processor is not None and not getattr(processor, _HOOKED, False) and hasattr(processor, method):
            setattr(processor, _HOOKED, True)
            setattr(processor, method, _timed_method("postprocess", getattr(processor, method)))


class TimingsExtension(Extension):
    """Component timings as an extension (`vllm_omni.diffusion.pipeline.extensions`): the hooks installed on each
    pipeline when it loads (``component_timings``), a request-mode call's denoising loop (`pipeline_call`, whose step
    hook `step_end` ends each step) and a step-mode step (`step`). Outside a `ComponentTimer.recording` (timings
    off) they record nothing."""

    name = "timings"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.enabled = od_config.stage.component_timings
        """Whether the pipeline's components are hooked for `ComponentTimer` (``component_timings``)."""

    def on_load(self, pipeline: Any, variant: bool) -> None:
        if self.enabled:  # a variant's processors are its own; its modules are hooked already
            install(pipeline)

    @contextlib.contextmanager
    def around_call(self, call: object) -> Iterator[Callable[[], None]]:
        with pipeline_call():
            yield step_end

    def around_step(self, requests: Sequence[Timed]) -> contextlib.AbstractContextManager[None]:
        return step(requests)
