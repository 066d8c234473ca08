"""The Ray cluster of the Ray stages: joined or started once per process, and each stage's replica actors placed
in a placement group of their own (`start_actors`), whatever the actor class (diffusion or llm replicas)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Ray's failure-signal handler also takes SIGTERM, which the server uses to drain: with it the process
# aborted (exit -6) once drained. It must be off before Ray is imported (Ray reads this at import).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
# Ray starts its workers at nice 15, below the server; a replica does the serving work, and on a busy machine a
# niced replica got a few percent of a core. Read by the raylets of a cluster this process starts.
os.environ.setdefault("RAY_worker_niceness", "0")
try:
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # the resolver checks this first; here for a broken install
    raise ImportError(f"distributed_executor_backend 'ray' needs Ray: pip install 'vllm-omni[ray]' ({exc})") from exc

from vllm_omni.config import StageDeployConfig

if TYPE_CHECKING:
    from ray.actor import ActorClass

PLACEMENT_TIMEOUT_S = 120.0
"""How long the stage waits for Ray to reserve every replica's resources."""

_started_ray = threading.Lock()
_ray_users = 0
"""Stages using a Ray cluster that this process started itself (it is stopped when the last one ends)."""


def _connect(address: str | None) -> bool:
    """Join ``address``, or start a local cluster; returns whether this process started it."""
    if ray.is_initialized():
        return False
    if address is None:  # "local": never a cluster that RAY_ADDRESS or an earlier `ray start` left behind
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
        return True
    ray.init(address=address, logging_level=logging.WARNING)
    return False


def start_actors(
    stage: StageDeployConfig, actor_class: type, args_of: Callable[[int], tuple], runtime_env: dict | None = None
) -> tuple[list, list, Callable[[], None]]:
    """Reserve the stage's replicas in a placement group and start one ``actor_class(*args_of(index))`` in each
    (in ``runtime_env``); returns the actors, what each one's ``info`` answered, and a function that releases
    what they hold. Ray restarts an actor whose process dies (``max_restarts``)."""
    global _ray_users
    with _started_ray:
        started = _connect(stage.ray_address)
        _ray_users += started
    num_gpus = stage.num_gpus
    if num_gpus is None:
        num_gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    bundle = {"CPU": stage.num_cpus} | ({"GPU": num_gpus} if num_gpus else {})
    group = placement_group([bundle] * stage.num_replicas, strategy=stage.placement_strategy)

    def release() -> None:
        global _ray_users
        remove_placement_group(group)
        with _started_ray:
            _ray_users -= started
            if started and _ray_users == 0:
                ray.shutdown()

    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except GetTimeoutError:
        release()
        raise RuntimeError(
            f"stage {stage.stage_id}: Ray could not reserve {stage.num_replicas} replica(s) of {bundle} each with "
            f"placement_strategy {stage.placement_strategy!r} in {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
            f"{ray.cluster_resources()}. Lower num_replicas, num_cpus or num_gpus, choose another "
            "placement_strategy, or add nodes"
        ) from None
    remote_class: ActorClass[Any] = ray.remote(actor_class)
    actors = [
        remote_class.options(
            num_cpus=stage.num_cpus,
            num_gpus=num_gpus,
            max_restarts=-1,
            max_task_retries=0,  # the stage re-runs a lost request itself, on another replica
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
            runtime_env=runtime_env,
        ).remote(*args_of(index))
        for index in range(stage.num_replicas)
    ]
    try:
        infos = ray.get([actor.info.remote() for actor in actors])  # a replica that cannot load raises here
    except BaseException:
        for actor in actors:
            # ray types what .remote() starts as its ActorProxy (ActorHandle | type); it is the handle
            ray.kill(actor, no_restart=True)  # type: ignore[arg-type]
        release()
        raise
    return actors, infos, release
