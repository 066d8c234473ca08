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

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine_core import EngineCore
from vllm_omni.diffusion.engines import make_engine
from vllm_omni.diffusion.lora_tensors import LoraTensors
from vllm_omni.diffusion.model_card import ModelCard
from vllm_omni.diffusion.runner import parse_size
from vllm_omni.diffusion.weights import pipeline_components
from vllm_omni.engine.profiler import PROCESS_PROFILER, trace_name
from vllm_omni.errors import RequestFailedError
from vllm_omni.logger import init_logger
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


def warm_up_params(card: ModelCard, compile_sizes: tuple[str, ...] = ()) -> list[OmniDiffusionSamplingParams]:
    """One step at the model's default size (or the fewest its scheduler takes, `ModelCard.min_steps`; a single frame
    for video models, a grey input image for a model that needs one): it initialises every component, so the first
    real request does not pay for that. Then the same at each of ``compile_sizes``, so that a compiled denoiser has
    compiled them."""
    sizes = [(None, None, 1 if card.is_video else None)] + [parse_size(size) for size in compile_sizes]
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

    def load_lora(self, name: str, path: str, tensors: LoraTensors | None = None) -> Future:
        """Load a LoRA adapter between batches or steps (`EngineCore.load_lora`); the future fails with
        `LoraLoadError` naming the file. ``tensors``: an adapter given as tensors (``path`` is its source tag), which
        a Ray replica receives through the object store (as an ``ObjectRef``) and loads again when it restarts."""

    def unload_lora(self, name: str) -> Future:
        """Evict a LoRA adapter unless a request in flight uses it (`EngineCore.unload_lora`)."""

    def update_weights(self, weights: Any, component: str) -> Future:
        """Apply new weights (a dict of name → tensor; for a Ray replica also its ``ObjectRef``) to ``component``
        once the requests in progress have finished, before any other starts (`EngineCore.update_weights`); the
        future holds `WeightsApplied`, or fails with `WeightUpdateError` (nothing applied) or `ReplicaLostError`."""

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, backend: str | None = None
    ) -> Future:
        """Join a trainer's `WeightUpdateGroup` as ``rank``; the future resolves once every member has joined."""

    def update_weights_from_distributed(self, names_dtypes_shapes: list, component: str, src: int) -> Future:
        """`update_weights` with the tensors broadcast by rank ``src`` of its weight group."""

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

    def sleep(self, level: int) -> Future:
        """Sleep at ``level`` once the requests in progress have finished (`EngineCore.sleep`): requests it is given
        meanwhile wait; the future resolves once it sleeps."""

    def wake_up(self, tags: list[str] | None = None) -> Future:
        """Wake the memory of ``tags`` (`EngineCore.wake_up`); the future holds whether it serves again."""

    @property
    def is_sleeping(self) -> bool:
        """Whether it sleeps (takes requests, starts none)."""

    def start_profile(self, config: Any, prefix: str | None = None) -> Future:
        """Start the torch profiler of its process (engine/profiler.py; ``config``: vLLM's ``ProfilerConfig``),
        its trace named after this replica: for a Ray replica, alone in its actor's process (inline replicas share
        the server's process, whose profile `EngineProfiler` starts). The future resolves once it records."""

    def stop_profile(self) -> Future:
        """Stop `start_profile`'s profiler; the future holds the trace file once it is written."""

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

    def load_lora(self, name: str, path: str, tensors: LoraTensors | None = None) -> Future:
        return self.engine.load_lora(name, path, tensors)

    def unload_lora(self, name: str) -> Future:
        return self.engine.unload_lora(name)

    def update_weights(self, weights: Any, component: str) -> Future:
        if self.is_alive:
            return self.engine.update_weights(weights, component)
        lost: Future = Future()  # it serves nothing: there is nothing to update
        lost.set_exception(ReplicaLostError(f"{self._name} is not running (error: {self.error!r})"))
        return lost

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int, backend: str | None = None
    ) -> Future:
        """Joins on a thread of its own: the engine keeps serving, and the caller waits on the future."""
        future: Future = Future()

        def join() -> None:
            try:
                self.engine.init_weight_update_group(master_address, master_port, rank, world_size, backend)
            except BaseException as exc:  # noqa: BLE001 - the caller's future says why
                future.set_exception(exc)
            else:
                future.set_result(None)

        threading.Thread(target=join, name=f"vllm-omni-weight-group-{self.info.index}", daemon=True).start()
        return future

    def update_weights_from_distributed(self, names_dtypes_shapes: list, component: str, src: int) -> Future:
        return self.engine.update_weights_from_distributed(names_dtypes_shapes, component, src)

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    def collect_metrics(self) -> list[Metric]:
        return self.engine.metrics.collect()

    def sleep(self, level: int) -> Future:
        return self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> Future:
        return self.engine.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def start_profile(self, config: Any, prefix: str | None = None) -> Future:
        role = f"stage{self.engine.od_config.stage.stage_id}-replica{self.info.index}"
        return PROCESS_PROFILER.start(config, trace_name(role, prefix))

    def stop_profile(self) -> Future:
        return PROCESS_PROFILER.stop()

    def shutdown(self) -> None:
        self._stopping.set()
        self.engine.close()
        self._thread.join()
        self.engine.shutdown()
