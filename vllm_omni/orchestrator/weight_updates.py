"""`WeightUpdates`: new weights from a trainer, to every replica of every stage whose pipeline holds the component
(`OmniEngine.weights`; docs/rl.md, "Weight updates").

Each replica applies an update on its engine's thread once its requests in progress have finished, before it
starts another (the ``update_weights`` verb, diffusion/features/weights.py), so a call returns once every replica serves
the new weights: a request admitted after it runs on them, a batch already running finishes on the old ones. Updates
are sent one at a time, so every replica applies them in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from vllm_omni.diffusion.features.weights import Weights, as_weights, parse_dtype
from vllm_omni.errors import WeightUpdateError
from vllm_omni.orchestrator.stage_runtime import Answer, StageRuntime, wait


class WeightUpdates:
    """The weight updates of one engine's stages."""

    def __init__(self, stages: list[StageRuntime]):
        self.stages = stages
        self._lock = threading.Lock()

    def holders(self, component: str) -> list[StageRuntime]:
        """The stages that hold ``component``, in request order (every replica of each takes the update); or
        `WeightUpdateError` naming the components the stages hold (an llm stage holds none)."""
        found = [stage for stage in self.stages if component in stage.info.components]
        if not found:
            held = ", ".join(sorted({c for stage in self.stages for c in stage.info.components}))
            raise WeightUpdateError(None, f"no stage holds a component {component!r}; the stages hold: {held}")
        return found

    def update_weights(self, weights: Weights, component: str = "transformer") -> None:
        """Apply ``weights`` (name as in ``component``'s ``state_dict()`` → tensor) on every replica that holds
        ``component``; returns once all serve them. Raises `WeightUpdateError` (nothing applied) for an unknown name
        or a wrong shape. A Ray stage's replicas read one copy from the object store (put once per stage), and one
        that is down takes them when it is back."""
        weights = as_weights(weights)
        with self._lock:
            stages = self.holders(component)
            shared = [stage.shared(weights) for stage in stages]
            wait(
                [
                    a
                    for s, w in zip(stages, shared, strict=True)
                    for a in s.call("update_weights", w, component, down_too=True)
                ]
            )

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
        holders = [(s, i, r) for s in self.holders(component) for i, r in enumerate(s.replicas)]
        if rank_offset < 0 or rank_offset + len(holders) > world_size:
            raise ValueError(
                f"{len(holders)} replicas hold {component}: ranks {rank_offset}..{rank_offset + len(holders) - 1} do "
                f"not fit in world_size {world_size}"
            )
        args = (master_address, master_port)
        wait(
            [
                Answer(s.stage_id, i, r.call("init_weight_update_group", *args, rank_offset + k, world_size, backend))
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
            verb = "update_weights_from_distributed"
            wait([a for s in self.holders(component) for a in s.call(verb, specs, component, src, down_too=True)])
