"""Ray replicas: each replica of a stage is a Ray actor holding an `EngineReplica`, placed by a placement group.

Imported only for ``distributed_executor_backend: ray``; Ray is the optional extra
``pip install 'vllm-omni[ray]'``. Ray restarts a replica whose process dies (the actor reloads
the model); `RayReplica` watches for that so the stage routes around a replica while it is down.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import ray
from prometheus_client.metrics_core import Metric
from ray.exceptions import GetTimeoutError, RayActorError

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine.control import done
from vllm_omni.diffusion.features.previews import previews_until
from vllm_omni.errors import RequestFailedError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.orchestrator.ray_cluster import start_actors  # first: it sets Ray's environment, then imports Ray
from vllm_omni.orchestrator.ray_updates import CatchUp
from vllm_omni.orchestrator.replica import EngineReplica, ReplicaInfo, ReplicaLostError
from vllm_omni.outputs import Preview, StageOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

logger = init_logger(__name__)

CALL_TIMEOUT_S = 10.0
"""Longest wait for a short call to a replica (progress, metrics, health)."""
WATCH_INTERVAL_S = 0.5
"""How often a restarting replica is asked whether it is back."""


class _ReplicaActor:
    """The Ray actor: one `EngineReplica` in its own process. Results cross back by value; a request's own
    failure is returned, not raised, so the driver can tell it from the actor dying."""

    def __init__(self, model: str, stage_config: StageDeployConfig, replica: int, torch_threads: int | None):
        # This process is ours alone: the forkserver its ranks fork from (a stage of several ranks) imports their
        # stack once, instead of each rank importing it.
        multiprocessing.set_forkserver_preload(["vllm_omni.diffusion.parallel.ranks"])
        od_config = OmniDiffusionConfig.from_stage(model, stage_config, replica, torch_threads)
        self.replica = EngineReplica(od_config, node_id=ray.get_runtime_context().get_node_id())
        self.shutting_down = False

    async def info(self) -> ReplicaInfo:
        if not self.replica.is_alive:
            raise RuntimeError(f"the engine of replica {self.replica.info.index} died: {self.replica.error!r}")
        return self.replica.info

    async def watch(self) -> str:
        """Answers once the engine stops (shut down, or its loop died); fails at once if the process dies. It
        waits on the engine's thread, so an idle replica does no work."""
        await asyncio.wrap_future(self.replica.stopped)
        return "shut down" if self.shutting_down else f"its engine loop died: {self.replica.error!r}"

    async def generate(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload=None,
        by_reference=False,
        on_preview: Callable[[Preview], None] | None = None,
    ):
        """``payload``: the previous stage's output (Ray resolved it if it came as an object reference).
        ``by_reference``: leave this stage's output in the object store and return its reference, for a next
        stage that is on Ray too, so it never passes through the driver."""
        try:
            output = await asyncio.wrap_future(self.replica.submit(request_id, prompt, params, payload, on_preview))
            if by_reference and isinstance(output, StageOutput):
                output = replace(output, payload=ray.put(output.payload))
            return output
        except RequestFailedError as exc:
            if not self.replica.is_alive:  # the engine loop died, not the request: the stage re-runs it elsewhere
                return ReplicaLostError(f"replica {self.replica.info.index}: {exc.reason}")
            return exc

    async def generate_with_previews(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload=None,
        by_reference=False,
    ):
        """`generate` as a stream (a Ray streaming generator): the request's previews, each as it is made, then
        what `generate` returns."""
        loop = asyncio.get_running_loop()
        previews: asyncio.Queue[Preview] = asyncio.Queue()

        def on_preview(preview: Preview) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(previews.put_nowait, preview)

        output = asyncio.ensure_future(self.generate(request_id, prompt, params, payload, by_reference, on_preview))
        async for preview in previews_until(output, previews):
            yield preview
        yield output.result()

    async def warm_up(self) -> str | None:
        """Warm the engine up; returns why it failed, if it did."""
        try:
            await asyncio.to_thread(self.replica.warm_up)
        except RequestFailedError as exc:
            return exc.reason
        return None

    async def abort(self, request_id: str) -> bool:
        return self.replica.abort(request_id)

    async def progress(self, request_id: str) -> tuple[str, float] | None:
        return self.replica.progress(request_id)

    async def catch_up(self, calls: list, version: int) -> None:
        """A restarted replica makes again the calls its driver kept (`CatchUp`), in order, before it serves."""
        for method, *args in calls:
            args = [await arg if isinstance(arg, ray.ObjectRef) else arg for arg in args]
            await asyncio.wrap_future(self.replica.call(method, *args))
        self.replica.engine.weights_version = version

    async def engine_call(self, method: str, *args):
        """Control verb ``method`` of the `EngineReplica` (``load_lora``, ``sleep``, ``update_weights``, ...;
        `EngineCore.call`): its result, or its error returned (not raised) as `generate` does. An ``ObjectRef``
        argument arrives resolved: tensors come from the object store."""
        try:
            return await asyncio.wrap_future(self.replica.call(method, *args))
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            return exc

    async def collect_metrics(self) -> list[Metric]:
        return self.replica.collect_metrics()

    async def shutdown(self) -> None:
        self.shutting_down = True
        await asyncio.to_thread(self.replica.shutdown)


class RayReplica:
    """Driver-side handle of one replica actor: a `Replica` whose methods are Ray calls."""

    def __init__(self, actor, info: ReplicaInfo, stage_config: StageDeployConfig, by_reference: bool = False):
        self._actor = actor
        self._by_reference = by_reference
        self.info = info
        self._stage = stage_config
        self._alive = True
        self._down_since = 0.0
        self._lock = threading.Lock()
        self._sleeping = False
        """Whether the actor sleeps, as its last sleep or wake-up answered (a restarted actor is awake)."""
        self._held = 0
        """Requests submitted to it whose result has not come back."""
        self._catch_up = CatchUp(self, self._engine_call)
        self._stopping = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name=f"vllm-omni-watch-{stage_config.stage_id}-{info.index}", daemon=True
        )
        self._watcher.start()

    @property
    def is_alive(self) -> bool:
        return self._alive

    def _mark_down(self, why: str) -> None:
        self._alive, self._down_since = False, time.monotonic()
        logger.warning("stage %d replica %d is down (%s); Ray restarts it", self._stage.stage_id, self.info.index, why)
        metrics.replica_restarts.labels(str(self._stage.stage_id), str(self.info.index)).inc()

    def _watch(self) -> None:
        """Keep one ``watch`` call in flight for the actor's life: Ray fails it the moment the process dies, so
        the replica is marked down at once; then wait until the restarted actor answers and has warmed up, as
        at start-up, before it takes requests again. Only this thread marks the replica down or up."""
        while not self._stopping.is_set():
            try:
                why, process_died = ray.get(self._actor.watch.remote()), False
            except RayActorError as exc:
                why, process_died = type(exc).__name__, True
            if self._stopping.is_set():
                return
            self._mark_down(why)
            if not process_died:
                ray.kill(self._actor, no_restart=False)  # a process whose engine died is of no use: restart it
            while not self._stopping.wait(WATCH_INTERVAL_S):
                try:
                    self.info = self._read_info(ray.get(self._actor.info.remote(), timeout=CALL_TIMEOUT_S))
                    self._catch_up.restore(self._actor, self._stage.stage_id)
                    self.warm_up()
                except (RayActorError, GetTimeoutError):
                    continue
                except RequestFailedError as exc:  # it serves anyway: a request that fails there fails alone
                    logger.warning(
                        "stage %d replica %d: warm-up failed: %s", self._stage.stage_id, self.info.index, exc
                    )
                except Exception:  # noqa: BLE001 - it came back with a dead engine: the outer loop restarts it
                    break
                logger.info(
                    "stage %d replica %d is back after %.1f s (pid %d, warmed up)",
                    self._stage.stage_id,
                    self.info.index,
                    time.monotonic() - self._down_since,
                    self.info.pid,
                )
                self._alive, self._sleeping = True, False
                break

    def _read_info(self, info: Any) -> ReplicaInfo:
        """The replica's info as its actor answers it (an actor that cannot send our types overrides this)."""
        return info

    def _generate_args(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams, payload: Any) -> tuple:
        """What the actor's ``generate`` takes for a request."""
        return request_id, prompt, params, payload, self._by_reference

    def _read_partial(self, item: Any) -> Any:
        """What ``on_preview`` takes of an item of a streamed request (a preview), or ``None`` for its result."""
        return item if isinstance(item, Preview) else None

    def _read_result(self, request_id: str, result: Any) -> Any:
        """A request's output or error as its actor returns it (an actor that cannot send our types overrides
        this)."""
        return result

    def warm_up(self) -> None:
        failed = ray.get(self._actor.warm_up.remote())
        if failed is not None:
            raise RequestFailedError(f"warmup-{self._stage.stage_id}-{self.info.index}", failed)

    def _call(self, method: str, *args):
        return ray.get(getattr(self._actor, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def submit(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload=None,
        on_preview: Callable[[Preview], None] | None = None,
    ) -> Future:
        """``payload`` (a split pipeline's previous stage output) travels through Ray's object store: as a
        reference the previous Ray stage left there, or put there by Ray when it is large. A request with
        ``on_preview`` streams its previews back (`_ReplicaActor.generate_with_previews`), read by a thread of its
        own that hands them over in order, then settles the future."""
        future: Future = Future()
        with self._lock:
            self._held += 1
        args = self._generate_args(request_id, prompt, params, payload)
        if on_preview is None:
            ref = self._actor.generate.remote(*args)
            # The callback keeps ``ref`` alive until the result is in.
            ref.future().add_done_callback(lambda done, ref=ref: self._settle(request_id, future, done.result))
            return future
        stream = self._actor.generate_with_previews.options(num_returns="streaming").remote(*args)

        def read() -> Any:
            for ref in stream:
                item = ray.get(ref)
                partial = self._read_partial(item)
                if partial is None:
                    return item
                on_preview(partial)
            raise RuntimeError("the replica's stream ended without the request's output")

        threading.Thread(
            target=self._settle, args=(request_id, future, read), name=f"vllm-omni-previews-{request_id}", daemon=True
        ).start()
        return future

    def _settle(self, request_id: str, future: Future, result_of: Callable[[], Any]) -> None:
        try:
            result = self._read_result(request_id, result_of())
        except RayActorError as exc:
            result = ReplicaLostError(f"replica {self.info.index} was lost: {exc}")
        except Exception as exc:  # noqa: BLE001 - an error of the actor method itself fails only this request
            result = RequestFailedError(request_id, f"replica {self.info.index}: {exc}")
        with self._lock:
            self._held -= 1
        (future.set_exception if isinstance(result, BaseException) else future.set_result)(result)

    def abort(self, request_id: str) -> bool:
        """Sent without waiting (the caller may be an event loop): the stage only asks for requests this replica
        holds, and Ray runs the abort after the ``generate`` call that brought the request."""
        self._actor.abort.remote(request_id)
        return True

    def _engine_call(self, method: str, *args) -> Future:
        future: Future = Future()

        def settle(done: Future) -> None:
            try:
                result = done.result()
            except RayActorError as exc:
                future.set_exception(ReplicaLostError(f"replica {self.info.index} was lost: {exc}"))
            else:
                (future.set_exception if isinstance(result, BaseException) else future.set_result)(result)

        ref = self._actor.engine_call.remote(method, *args)
        ref.future().add_done_callback(lambda done, ref=ref: settle(done))
        return future

    def call(self, method: str, *args) -> Future:
        """`Replica.call`: the actor's ``engine_call``, through the policy of its verb in `_VERBS` if it has one."""
        verb = self._VERBS.get(method)
        return self._engine_call(method, *args) if verb is None else verb(self, *args)

    # What a Ray replica does around a control verb, all of it here (`_VERBS`): what it keeps for a restart
    # (`CatchUp`), and whether it sleeps, noted from the answers so that ``is_sleeping`` makes no call.

    def _is_sleeping(self) -> Future:
        """As the actor's last sleep or wake-up answered, without a call (``/health`` reads it)."""
        return done(self._sleeping)

    def _sleep(self, level: int) -> Future:
        return self._noting_sleep(self._engine_call("sleep", level), lambda _: True)

    def _wake_up(self, tags: list[str] | None = None) -> Future:
        return self._noting_sleep(self._engine_call("wake_up", tags), lambda awake: not awake)

    def _noting_sleep(self, inner: Future, sleeping: Callable[[Any], bool]) -> Future:
        """``inner``'s outcome, settled once `is_sleeping` says what it left."""
        future: Future = Future()

        def settle(done: Future) -> None:
            if done.exception() is not None:
                future.set_exception(done.exception())
                return
            self._sleeping = sleeping(done.result())
            future.set_result(done.result())

        inner.add_done_callback(settle)
        return future

    def _load_lora(self, name: str, path: str, tensors: Any = None) -> Future:
        """``tensors`` come through the object store, and load again when the replica restarts (`CatchUp`)."""
        return (
            self._engine_call("load_lora", name, path)
            if tensors is None
            else self._catch_up.load_lora(name, path, tensors)
        )

    def _unload_lora(self, name: str) -> Future:
        self._catch_up.forget_lora(name)
        return self._engine_call("unload_lora", name)

    def _update_weights(self, weights: Any, component: str) -> Future:
        """Through the object store, kept for a restart (`CatchUp`): a replica that is down applies them when back."""
        return self._catch_up.update_weights(weights, component)

    def _update_weights_from_distributed(self, names_dtypes_shapes: list, component: str, src: int) -> Future:
        self._catch_up.received(component)  # not kept: a restarted replica has the model folder's component
        return self._engine_call("update_weights_from_distributed", names_dtypes_shapes, component, src)

    _VERBS: dict[str, Callable[..., Future]] = {
        "is_sleeping": _is_sleeping,
        "sleep": _sleep,
        "wake_up": _wake_up,
        "load_lora": _load_lora,
        "unload_lora": _unload_lora,
        "update_weights": _update_weights,
        "update_weights_from_distributed": _update_weights_from_distributed,
    }
    """The verbs a Ray replica does more for than send them (the others go to the actor as they are)."""

    def progress(self, request_id: str) -> tuple[str, float] | None:
        try:
            return self._call("progress", request_id)
        except (RayActorError, GetTimeoutError):
            return None

    @property
    def num_waiting(self) -> int:
        """Counted here, without a call: the requests it holds beyond the ``max_num_seqs`` it runs at once, or all of
        them while it sleeps (the actor's own count, which also knows of a partly filled batch, is its
        ``num_requests_waiting`` metric)."""
        with self._lock:
            return self._held if self._sleeping else max(0, self._held - self._stage.max_num_seqs)

    def collect_metrics(self) -> list[Metric]:
        try:
            return self._call("collect_metrics")
        except (RayActorError, GetTimeoutError):
            return []

    def shutdown(self) -> None:
        """Stop the actor's engine, then the actor. A replica that is down (Ray restarts it) is killed at once: it
        holds no request, and a ``shutdown`` call would wait for the restarted actor to load its model first."""
        self._stopping.set()
        if self._alive:
            try:
                ray.get(self._actor.shutdown.remote(), timeout=CALL_TIMEOUT_S * 6)
            except (RayActorError, GetTimeoutError) as exc:
                logger.warning(
                    "stage %d replica %d did not stop cleanly: %s", self._stage.stage_id, self.info.index, exc
                )
        ray.kill(self._actor, no_restart=True)
        self._watcher.join()


def start_replicas(
    model: str, stage: StageDeployConfig, by_reference: bool, torch_threads: int | None
) -> tuple[list[RayReplica], Callable[[], None]]:
    """Place and start the stage's replicas; returns them and a function that releases what they hold.
    ``by_reference``: the next stage runs on Ray too, so outputs stay in the object store (`_ReplicaActor.generate`).
    ``torch_threads``: of each replica's engine thread (its ``num_cpus``)."""
    actors, infos, release = start_actors(stage, _ReplicaActor, lambda index: (model, stage, index, torch_threads))
    log_started(stage.stage_id, infos)
    replicas = [RayReplica(actor, info, stage, by_reference) for actor, info in zip(actors, infos, strict=True)]
    return replicas, release


def log_started(stage_id: int, infos: list[ReplicaInfo]) -> None:
    for info in infos:
        logger.info(
            "stage %d replica %d: pid %d on node %s, %s", stage_id, info.index, info.pid, info.node_id, info.device
        )
