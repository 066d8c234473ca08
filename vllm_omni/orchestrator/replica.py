"""A replica: one stage engine (batch scheduler + role + runner) and the thread that steps it, and `Replica`, the
interface that the stage routes through.

`EngineReplica` is the whole of an ``inline`` stage, and what each Ray replica actor holds (`ray_replicas.py`,
whose `RayReplica` handle is the other `Replica`).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from prometheus_client.metrics_core import Metric

from vllm_omni.codec.card import SpeechCard
from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.control import failed
from vllm_omni.diffusion.engine.core import EngineCore
from vllm_omni.diffusion.engine.modes import make_engine
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.features.weights import pipeline_components
from vllm_omni.diffusion.pipeline.extensions import parse_size
from vllm_omni.errors import RequestFailedError
from vllm_omni.logger import init_logger
from vllm_omni.orchestrator import profiler  # noqa: F401 - its handlers of start_profile and stop_profile (EngineCore.call)
from vllm_omni.outputs import Preview
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

logger = init_logger(__name__)


@dataclass(frozen=True)
class ReplicaInfo:
    """What the stage and the servers need to know of a replica: its model's card and where it runs."""

    index: int
    card: ModelCard | None
    """What admission needs of the model it loaded (the stage admits requests from it, without a call); ``None``
    for an llm replica, which admits everything."""
    device: str
    pid: int
    node_id: str | None = None
    """The Ray node it runs on; ``None`` inline."""
    components: tuple[str, ...] = ()
    """The torch components its pipeline holds (what ``update_weights`` may name); none for an llm replica."""


def warm_up_params(
    card: ModelCard | SpeechCard, compile_sizes: tuple[str, ...] = ()
) -> list[OmniDiffusionSamplingParams]:
    """One step at the model's default size (or the fewest its scheduler takes, `ModelCard.min_steps`; a single frame
    for video models, its default length for audio models, a grey input image for a model that needs one): it
    initialises every component, so the first real request does not pay for that. Then the same at each of
    ``compile_sizes`` (sizes of pictures: none for an audio model), so that a compiled denoiser has compiled them.
    A speech model: a few frames of codes, through its talker and codec."""
    if isinstance(card, SpeechCard):
        return [OmniDiffusionSamplingParams(seed=0, max_new_tokens=4 * card.codes_per_frame)]
    sizes: list[tuple[int | None, int | None, int | None]] = [(None, None, 1 if card.output == "video" else None)]
    sizes += [parse_size(size) for size in compile_sizes if card.output != "audio"]
    warm_ups = []
    for width, height, frames in sizes:
        image = None
        if "text" not in card.tasks:
            default_height, default_width = card.default_size or (8 * card.size_multiple,) * 2
            image = Image.new("RGB", (width or default_width, height or default_height), (128, 128, 128))
        warm_ups.append(
            OmniDiffusionSamplingParams(
                num_inference_steps=card.min_steps,
                seed=0,
                height=height,
                width=width,
                num_frames=frames,
                image=None if image is None else [image],
            )
        )
    return warm_ups


class ReplicaLostError(RuntimeError):
    """The replica's process died (or became unreachable) while it held the request."""


@runtime_checkable
class Replica(Protocol):
    """One replica of a stage, in this process (`EngineReplica`) or in a Ray actor (`RayReplica`). Every method
    means the same on both; a call that cannot reach a lost replica answers "not here". Requests are admitted by
    the stage, from the model card in ``info``, never by a replica."""

    info: ReplicaInfo
    """Its model's kind and where it runs (refreshed when a Ray replica restarts)."""

    @property
    def is_alive(self) -> bool:
        """Whether it takes requests now."""

    def submit(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> Future:
        """Queue an admitted request; the future resolves to its output (or fails with `RequestFailedError`, or
        `ReplicaLostError` when the replica was lost while it held the request). ``on_preview`` takes its partial
        images, in order and before the future resolves, on a thread of the replica's."""

    def abort(self, request_id: str) -> bool:
        """Abort a request it holds (its slot is freed); False if it does not hold it."""

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(waiting|running, fraction of denoising steps done)``, or ``None`` if it does not hold the request."""

    @property
    def num_waiting(self) -> int:
        """Requests it holds that its batch scheduler has not started: waiting for a batch (or, in step mode, for a
        place in the running batch); 0 when it cannot be reached."""

    def warm_up(self) -> None:
        """Run one small request through it alone and wait (raises `RequestFailedError` if it fails). A replica of
        a split stage needs the other stages, so it returns at once: it warms up with the first request that passes
        the whole pipeline (the server's warm-up)."""

    def collect_metrics(self) -> list[Metric]:
        """Its engine's metric families."""

    def call(self, method: str, *args) -> Future:
        """Control verb ``method`` with ``args`` (`EngineCore.call`: ``sleep``, ``wake_up``, ``is_sleeping``,
        ``load_lora``, ``unload_lora``, ``update_weights``, ``init_weight_update_group``,
        ``update_weights_from_distributed``, ``start_profile``, ``stop_profile``); the future holds its answer, or
        fails with its error, or with `ReplicaLostError` when the replica cannot be reached. A Ray replica answers
        ``is_sleeping`` from what its last ``sleep`` or ``wake_up`` answered, without a call; it sends weights and
        adapters given as tensors through the object store (as an ``ObjectRef``) and keeps them for a restart
        (`CatchUp`). ``start_profile`` (``config``: vLLM's ``ProfilerConfig``, ``prefix``) starts the torch
        profiler of its process, its trace named after this replica: for a Ray replica, alone in its actor's
        process (inline replicas share the server's process, whose profile `EngineProfiler` starts)."""

    def shutdown(self) -> None:
        """Stop taking requests, fail the waiting ones, let the running ones finish."""


class EngineReplica:
    """One engine in this process, loaded and stepped by its own thread until `shutdown`.

    That thread does all of the engine's torch work: it loads the model, and runs every encode, forward, decode
    and conversion to images. With libgomp each thread that runs torch ops gets its own OpenMP team, and once a
    process holds more OpenMP threads than cores every forward slows down (~1.8× on a 2-core CPU;
    docs/performance.md), so no other thread of the process may run torch ops. ``torch_threads`` of the config
    sizes that thread's team."""

    def __init__(self, od_config: OmniDiffusionConfig, node_id: str | None = None):
        self._name = f"stage {od_config.stage.stage_id} replica {od_config.replica}"
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self.stopped: Future[None] = Future()
        """Done once the engine's thread has ended (shut down, its loop died, or its load failed)."""
        loaded: Future[EngineCore] = Future()
        self._thread = threading.Thread(
            target=self._run,
            args=(od_config, loaded),
            name=f"vllm-omni-stage-{od_config.stage.stage_id}-{od_config.replica}",
            daemon=True,
        )
        self._thread.start()
        self.engine = loaded.result()  # raises what failed the load
        runner = self.engine.runner
        self.info = ReplicaInfo(
            index=od_config.replica,
            card=runner.card,
            device=str(runner.device),
            pid=os.getpid(),
            node_id=node_id,
            components=pipeline_components(runner.pipeline),
        )

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _run(self, od_config: OmniDiffusionConfig, loaded: Future) -> None:
        """The engine's thread: load, then step until shut down."""
        try:
            self._load_and_step(od_config, loaded)
        finally:
            self.stopped.set_result(None)

    def _load_and_step(self, od_config: OmniDiffusionConfig, loaded: Future) -> None:
        if od_config.torch_threads is not None:
            torch.set_num_threads(od_config.torch_threads)  # this thread's OpenMP team, before its first op
        try:
            engine = make_engine(od_config)
        except BaseException as exc:  # noqa: BLE001 - raised by __init__, in the caller's thread
            loaded.set_exception(exc)
            return
        loaded.set_result(engine)
        try:
            while not self._stopping.is_set() or engine.has_unfinished:
                engine.step()
        except BaseException as exc:  # noqa: BLE001 - reported to every request in flight below
            self.error = exc
            logger.exception("%s: engine loop died", self._name)
            engine.close(f"the engine loop of {self._name} died: {exc!r}", include_running=True)

    def submit(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload: Any = None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> Future:
        if not self.is_alive:
            raise RequestFailedError(request_id, f"{self._name} is not running (error: {self.error!r})")
        return self.engine.add_request(request_id, prompt, params, payload, on_preview)

    def warm_up(self) -> None:
        """`Replica.warm_up`, with `warm_up_params`."""
        if self.engine.role.split:
            return
        assert self.info.card is not None, "a diffusers replica has a card"
        for warm_up in warm_up_params(self.info.card, self.engine.od_config.stage.compile_sizes):
            params = self.engine.admission.admit(warm_up).params
            self.submit(f"warmup-{uuid.uuid4().hex}", "warm-up", params).result()

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def progress(self, request_id: str) -> tuple[str, float] | None:
        found = self.engine.scheduler.state(request_id)
        return None if found is None else (found[0], found[1].progress)

    def call(self, method: str, *args) -> Future:
        """`EngineCore.call`; a replica whose engine stopped serves nothing, and answers `ReplicaLostError`."""
        if self.is_alive:
            return self.engine.call(method, *args)
        return failed(ReplicaLostError(f"{self._name} is not running (error: {self.error!r})"))

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    def collect_metrics(self) -> list[Metric]:
        return self.engine.metrics.collect()

    def shutdown(self) -> None:
        self._stopping.set()
        self.engine.close()
        self._thread.join()
        self.engine.shutdown()
