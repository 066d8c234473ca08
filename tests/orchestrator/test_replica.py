"""Inline and Ray replicas are both a `Replica`: the same methods, with the same signatures."""

import inspect

import pytest

from vllm_omni.orchestrator.replica import EngineReplica, Replica


def _members(cls) -> dict[str, object]:
    return {name: getattr(cls, name) for name in dir(cls) if not name.startswith("_")}


def test_the_protocol_declares_every_method_the_stage_uses():
    """Requests, liveness, metrics and shutdown; every control verb (sleep, weights, LoRA, profiling) goes through
    ``call`` (`EngineCore.call`), so a new verb adds no member."""
    declared = {name for name in vars(Replica) if not name.startswith("_")} | set(Replica.__annotations__)
    assert declared == {
        *("info", "is_alive", "submit", "abort", "progress", "num_waiting", "warm_up", "collect_metrics", "call"),
        "shutdown",
    }
    assert len(declared) <= 10


@pytest.mark.parametrize("backend", ["inline", "ray"])
def test_each_replica_kind_has_every_method_of_the_protocol_with_its_signature(backend):
    if backend == "ray":
        pytest.importorskip("ray")
        from vllm_omni.orchestrator.ray_replicas import RayReplica as cls
    else:
        cls = EngineReplica
    members = _members(cls)
    for name, declared in vars(Replica).items():
        if name.startswith("_"):
            continue
        assert name in members, f"{cls.__name__} lacks {name}"
        if isinstance(declared, property):
            assert isinstance(members[name], property), f"{cls.__name__}.{name} is not a property"
            continue
        want = list(inspect.signature(declared).parameters)
        assert list(inspect.signature(members[name]).parameters) == want, f"{cls.__name__}.{name}"
