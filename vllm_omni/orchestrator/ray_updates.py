"""What a Ray replica is sent besides requests, through Ray's object store: weight updates and LoRA adapters given as
tensors, put there once for all the replicas of a stage (`shared`); and `CatchUp`, what a replica that Ray restarted
applies again before it serves, since its new process loaded the model folder."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray

from vllm_omni.diffusion.features.weights import WeightsApplied
from vllm_omni.logger import init_logger
from vllm_omni.orchestrator.replica import ReplicaLostError

logger = init_logger(__name__)


def shared(value: Any) -> ray.ObjectRef:
    """``value`` in the object store, once: every actor given the reference reads that one copy (a replica on the
    driver's node without copying it again), rather than one pickle per call."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


def lost(why: str) -> Future:
    """A future failed with `ReplicaLostError`."""
    future: Future = Future()
    future.set_exception(ReplicaLostError(why))
    return future


class CatchUp:
    """What one replica must apply again after a restart, kept by its driver-side handle (`RayReplica`), which
    sends adapters given as tensors and weight updates through here:

    - the adapters given as tensors that are served (a file adapter loads from its path on demand);
    - the weight updates of each component since the last one that replaced all of it (an earlier one changes
      nothing after it), so the object store holds about one copy of a component updated whole;
    - the weights version the replica had reached, which it reports again.

    A replica that is down when one is sent takes it when it is back (the call fails with `ReplicaLostError`). A
    component updated over torch.distributed cannot be sent again (its tensors never came through here): after a
    restart the replica serves the model folder's weights at version 0, with a warning, and has left the trainer's
    group, which the trainer must make again (`init_weight_update_group`).
    """

    def __init__(self, replica, send: Callable[..., Future]):
        """``send(method, *args)``: control verb ``method`` of the replica's engine, as a Ray call."""
        self._replica, self._send = replica, send
        self._lock = threading.Lock()
        self._loras: dict[str, tuple[str, ray.ObjectRef]] = {}
        self._updates: list[tuple[ray.ObjectRef, str]] = []
        self._version = 0
        """Updates sent to the replica (it applies each it is sent, in order; one refused counts none)."""
        self._received: set[str] = set()
        """Components whose tensors came over torch.distributed since they were last replaced whole."""

    def _send_unless_down(self, method: str, *args) -> Future:
        if self._replica.is_alive:
            return self._send(method, *args)
        return lost(f"replica {self._replica.info.index} is down; it catches up when it is back")

    def load_lora(self, name: str, path: str, tensors: Any) -> Future:
        ref = shared(tensors)
        with self._lock:
            self._loras[name] = (path, ref)
        return self._send_unless_down("load_lora", name, path, ref)

    def forget_lora(self, name: str) -> None:
        with self._lock:
            self._loras.pop(name, None)

    def update_weights(self, weights: Any, component: str) -> Future:
        entry = (shared(weights), component)
        with self._lock:
            self._updates.append(entry)
            self._version += 1
        future = self._send_unless_down("update_weights", *entry)
        future.add_done_callback(lambda done: self._applied(entry, done))
        return future

    def _applied(self, entry: tuple, done: Future) -> None:
        """The replica answered ``entry``: refused (nothing applied, so it is not sent again), or applied; one that
        replaced the whole component makes the earlier ones of that component useless."""
        error = done.exception()
        with self._lock:
            if error is not None and not isinstance(error, ReplicaLostError):
                self._updates.remove(entry)
                self._version -= 1
            elif error is None and isinstance(result := done.result(), WeightsApplied) and result.complete:
                at = self._updates.index(entry)
                self._updates = [u for i, u in enumerate(self._updates) if i >= at or u[1] != entry[1]]
                self._received.discard(entry[1])

    def received(self, component: str) -> None:
        """An update of ``component`` came over torch.distributed: it cannot be sent again."""
        with self._lock:
            self._received.add(component)
            self._version += 1

    def restore(self, actor, stage_id: int) -> None:
        """Make the kept calls on the restarted ``actor`` and wait for them (raises what Ray raises)."""
        with self._lock:
            calls: list[tuple[Any, ...]] = [("load_lora", name, path, ref) for name, (path, ref) in self._loras.items()]
            version = self._version
            if self._received:
                logger.warning(
                    "stage %d replica %d restarted with the model folder's %s (updated over torch.distributed, which "
                    "cannot be sent again): weights version 0; make the weight group again and send the weights",
                    stage_id,
                    self._replica.info.index,
                    ", ".join(sorted(self._received)),
                )
                self._updates, self._received, version = [], set(), 0
            calls += [("update_weights", ref, component) for ref, component in self._updates]
            self._version = version
        if calls or version:
            ray.get(actor.catch_up.remote(calls, version))
