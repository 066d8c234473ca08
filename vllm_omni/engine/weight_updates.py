"""`WeightUpdates`: new weights from a trainer, to every replica of every stage whose pipeline holds the component
(`OmniEngine.weights`; docs/rl.md, "Weight updates").

Each replica applies an update on its engine's thread once its requests in progress have finished, before it
starts another (`EngineCore.update_weights`), so a call returns once every replica serves the new weights: a
request admitted after it runs on them, a batch already running finishes on the old ones. Updates are sent one at
a time, so every replica applies them in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from vllm_omni.diffusion.weights import Weights, as_weights, parse_dtype
from vllm_omni.engine.replica import Replica, ReplicaLostError
from vllm_omni.engine.stage_runtime import StageRuntime
from vllm_omni.errors import WeightUpdateError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class WeightUpdates:
    """The weight updates of one engine's stages."""

    def __init__(self, stages: list[StageRuntime]):
        self.stages = stages
        self._lock = threading.Lock()

    def holders(self, component: str) -> list[tuple[StageRuntime, int, Replica]]:
        """Every replica of the stages that hold ``component``, as (stage, index, replica), in request order; or
        `WeightUpdateError` naming the components the stages hold (an llm stage holds none)."""
        found = [(s, i, r) for s in self.stages if component in s.info.components for i, r in enumerate(s.replicas)]
        if not found:
            held = ", ".join(sorted({c for stage in self.stages for c in stage.info.components}))
            raise WeightUpdateError(None, f"no stage holds a component {component!r}; the stages hold: {held}")
        return found

    def update_weights(self, weights: Weights, component: str = "transformer") -> None:
        """Apply ``weights`` (name as in ``component``'s ``state_dict()`` → tensor) on every replica that holds
        ``component``; returns once all serve them. Raises `WeightUpdateError` (nothing applied) for an unknown name
        or a wrong shape. A Ray stage's replicas read one copy from the object store."""
        weights = as_weights(weights)
        with self._lock:
            holders = self.holders(component)
            stages = {stage.stage_id: stage for stage, _, _ in holders}
            shared = {stage_id: stage.shared(weights) for stage_id, stage in stages.items()}  # once per stage
            _wait([(s, i, r.update_weights(shared[s.stage_id], component)) for s, i, r in holders])

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        component: str = "transformer",
        backend: str | None = None,
    ) -> int:
        """Every replica that holds ``component`` joins the trainer's `WeightUpdateGroup` as ``rank_offset + i``
        (``i`` counts them in request order, then replica index); returns once all have joined, with how many did.
        The trainer joins at the same time with another rank (usually 0)."""
        holders = self.holders(component)
        if rank_offset < 0 or rank_offset + len(holders) > world_size:
            raise ValueError(
                f"{len(holders)} replicas hold {component}: ranks {rank_offset}..{rank_offset + len(holders) - 1} do "
                f"not fit in world_size {world_size}"
            )
        args = (master_address, master_port)
        _wait(
            [
                (s, i, r.init_weight_update_group(*args, rank_offset + k, world_size, backend))
                for k, (s, i, r) in enumerate(holders)
            ]
        )
        return len(holders)

    def update_weights_from_distributed(
        self, names_dtypes_shapes: Iterable[tuple[str, Any, Any]], component: str = "transformer", src: int = 0
    ) -> None:
        """`update_weights` with tensors that rank ``src`` of the group broadcasts, one per ``(name, dtype, shape)``
        in that order; each replica receives them on its engine's thread once it has drained."""
        specs = [
            (str(name), parse_dtype(dtype), tuple(int(n) for n in shape)) for name, dtype, shape in names_dtypes_shapes
        ]
        if not specs:
            raise WeightUpdateError(None, "the update holds no weights")
        with self._lock:
            holders = self.holders(component)
            _wait([(s, i, r.update_weights_from_distributed(specs, component, src)) for s, i, r in holders])


def _wait(calls: list[tuple[StageRuntime, int, Future]]) -> list:
    """Each call's result once all have answered; a replica lost meanwhile is logged (a Ray replica catches up
    when it is back); the first other error is raised."""
    results, failed = [], None
    for stage, index, future in calls:
        error = future.exception()
        if isinstance(error, ReplicaLostError):
            logger.warning("stage %d replica %d: %s", stage.stage_id, index, error)
        elif error is not None:
            failed = failed or error
        else:
            results.append(future.result())
    if failed is not None:
        raise failed
    return results
