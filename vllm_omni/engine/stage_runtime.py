"""`StageRuntime`: one stage's replicas, the routing of its requests among them, and the re-run of a
request whose replica was lost.

Routing lives here rather than in `AsyncOmniEngine` because it is per stage: each stage balances
over its own replicas.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.request import OmniDiffusionSamplingParams, RequestAbortedError, StageUnavailableError
from vllm_omni.engine.replica import Admission, EngineReplica, ReplicaInfo, ReplicaLostError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics

logger = init_logger(__name__)


@dataclass
class _Routed:
    """A request the stage holds until its future is settled."""

    request_id: str
    prompt: str
    admission: Admission
    payload: Any
    """The previous stage's output for it (split pipelines), passed on to the replica as it is."""
    future: Future
    replica: int | None = None
    """The replica running it; ``None`` between a lost replica and the re-run."""
    retried: bool = False
    aborted: bool = False


@dataclass(frozen=True)
class StageHealth:
    """What ``/health`` reports of a stage."""

    stage_id: int
    num_replicas: int
    alive: list[int]
    """Indices of the replicas that take requests now."""

    @property
    def status(self) -> str:
        """``ok`` (every replica alive), ``degraded`` (some) or ``down`` (none)."""
        if len(self.alive) == self.num_replicas:
            return "ok"
        return "degraded" if self.alive else "down"


class StageRuntime:
    """One stage: ``num_replicas`` engines (inline: one on a thread here; ray: one actor each).

    A request goes to the live replica with the fewest outstanding requests; on a tie, to one that
    already holds requests with the same batch key, so they can share a batch. A request whose replica
    is lost is re-run once on another live replica with the same sampling parameters (seed included).
    """

    def __init__(self, model: str, stage_config: StageDeployConfig, next_stage: StageDeployConfig | None = None):
        """``next_stage``: the stage that takes this one's outputs (split pipelines); between two Ray stages
        outputs stay in Ray's object store."""
        self.stage_config = stage_config
        self.stage_id = stage_config.stage_id
        logger.info("Starting %s", stage_config.describe())
        self._release_backend = None
        if stage_config.distributed_executor_backend == "ray":
            from vllm_omni.engine.ray_replicas import start_replicas

            by_reference = next_stage is not None and next_stage.distributed_executor_backend == "ray"
            self.replicas, self._release_backend = start_replicas(model, stage_config, by_reference)
        else:
            self.replicas = [EngineReplica(OmniDiffusionConfig.from_stage(model, stage_config))]
        self.info: ReplicaInfo = self.replicas[0].info
        self._lock = threading.Lock()
        self._load = [0] * len(self.replicas)
        self._keys = [Counter() for _ in self.replicas]
        self._routed: dict[str, _Routed] = {}
        # Calls that go to every replica at once (metrics at each scrape, shutdown).
        self._fan_out = ThreadPoolExecutor(len(self.replicas), thread_name_prefix=f"vllm-omni-stage-{self.stage_id}")
        stage = str(self.stage_id)
        metrics.stage_replicas.labels(stage, "alive").set_function(lambda: len(self.health().alive))
        metrics.stage_replicas.labels(stage, "down").set_function(lambda: len(self.replicas) - len(self.health().alive))

    def health(self) -> StageHealth:
        alive = [i for i, replica in enumerate(self.replicas) if replica.is_alive]
        return StageHealth(self.stage_id, len(self.replicas), alive)

    @property
    def is_alive(self) -> bool:
        """Whether at least one replica takes requests."""
        return any(replica.is_alive for replica in self.replicas)

    def admit(self, params: OmniDiffusionSamplingParams) -> Admission:
        """``params`` completed with the model's defaults by a live replica (raises `SamplingParamsError`)."""
        for replica in self.replicas:
            if replica.is_alive:
                try:
                    return replica.admit(params)
                except ReplicaLostError:
                    continue
        raise StageUnavailableError(self.stage_id, "no replica is alive")

    def submit(self, request_id: str, prompt: str, admission: Admission, payload: Any = None) -> Future:
        """Route an admitted request (with the previous stage's ``payload``); the future resolves to its
        `OmniRequestOutput`, or a `StageOutput` from a stage that is not the last."""
        routed = _Routed(request_id, prompt, admission, payload, Future())
        with self._lock:
            self._routed[request_id] = routed
        self._dispatch(routed)
        return routed.future

    def _dispatch(self, routed: _Routed, lost: int | None = None) -> None:
        key = routed.admission.key
        with self._lock:
            live = [i for i, replica in enumerate(self.replicas) if replica.is_alive and i != lost]
            if routed.aborted or not live:
                del self._routed[routed.request_id]
            else:
                index = min(live, key=lambda i: (self._load[i], self._keys[i][key] == 0, i))
                self._load[index] += 1
                self._keys[index][key] += 1
                routed.replica = index
        if routed.aborted:
            routed.future.set_exception(RequestAbortedError(routed.request_id))
            return
        if not live:
            message = "no replica is alive" if lost is None else f"replica {lost} was lost and no other is alive"
            routed.future.set_exception(StageUnavailableError(self.stage_id, message, routed.request_id))
            return
        try:
            inner = self.replicas[index].submit(
                routed.request_id, routed.prompt, routed.admission.params, routed.payload
            )
        except BaseException as exc:
            self._settle(routed, index, exc)
            return
        inner.add_done_callback(lambda done: self._settle(routed, index, done.exception(), done))

    def _settle(self, routed: _Routed, index: int, exc: BaseException | None, done: Future | None = None) -> None:
        with self._lock:
            self._load[index] -= 1
            keys = self._keys[index]
            keys[routed.admission.key] -= 1
            if not keys[routed.admission.key]:
                del keys[routed.admission.key]
            routed.replica = None
            retry = isinstance(exc, ReplicaLostError) and not routed.retried and not routed.aborted
            if not retry:
                del self._routed[routed.request_id]
        if retry:
            routed.retried = True
            metrics.request_retries.labels(str(self.stage_id)).inc()
            logger.warning("request %s: %s; re-running it on another replica (same seed)", routed.request_id, exc)
            self._dispatch(routed, lost=index)
        elif isinstance(exc, ReplicaLostError):
            lost_again = StageUnavailableError(self.stage_id, f"{exc} (after a retry)", routed.request_id)
            routed.future.set_exception(RequestAbortedError(routed.request_id) if routed.aborted else lost_again)
        elif exc is not None:
            routed.future.set_exception(exc)
        else:
            routed.future.set_result(done.result())

    def abort(self, request_id: str) -> bool:
        """Abort a request at the replica that holds it; False if the stage does not hold it."""
        with self._lock:
            routed = self._routed.get(request_id)
            if routed is None:
                return False
            routed.aborted = True
            index = routed.replica
        return index is None or self.replicas[index].abort(request_id)

    def progress(self, request_id: str) -> tuple[str, float] | None:
        """``(waiting|running, fraction of denoising steps done)``, asked of the replica that holds the request."""
        routed = self._routed.get(request_id)
        index = None if routed is None else routed.replica
        return None if index is None else self.replicas[index].progress(request_id)

    def collect_metrics(self) -> list[list]:
        """Every live replica's metric families (asked of all replicas at once)."""
        live = [replica for replica in self.replicas if replica.is_alive]
        return list(self._fan_out.map(lambda replica: replica.collect_metrics(), live))

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch, over the live replicas."""
        return sum(replica.num_waiting for replica in self.replicas if replica.is_alive)

    def shutdown(self) -> None:
        """Stop taking requests, fail the waiting ones, let the running ones finish (all replicas at once)."""
        list(self._fan_out.map(lambda replica: replica.shutdown(), self.replicas))
        self._fan_out.shutdown()
        if self._release_backend is not None:
            self._release_backend()
        for state in ("alive", "down"):  # the gauges' callbacks hold this runtime
            metrics.stage_replicas.remove(str(self.stage_id), state)
