"""The one control channel (docs/architecture.md, "Control verbs"): a verb is a handler in `HANDLERS`, reached
through ``OmniEngine`` → ``StageRuntime.call`` → ``Replica.call`` → ``EngineCore.call``, never a method per layer."""

import ast
import logging
import pathlib
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

import vllm_omni
from vllm_omni.diffusion.engine.control import HANDLERS, done, failed, handler
from vllm_omni.diffusion.engine.core import EngineCore
from vllm_omni.orchestrator.replica import Replica, ReplicaLostError
from vllm_omni.orchestrator.stage_runtime import Answer, StageRuntime, wait

PACKAGE = pathlib.Path(vllm_omni.__file__).parent

VERBS = {
    "sleep": "vllm_omni.diffusion.features.sleep",
    "wake_up": "vllm_omni.diffusion.features.sleep",
    "is_sleeping": "vllm_omni.diffusion.features.sleep",
    "update_weights": "vllm_omni.diffusion.features.weights",
    "init_weight_update_group": "vllm_omni.diffusion.features.weights",
    "update_weights_from_distributed": "vllm_omni.diffusion.features.weights",
    "load_lora": "vllm_omni.diffusion.lora.adapters",
    "unload_lora": "vllm_omni.diffusion.lora.adapters",
    "start_profile": "vllm_omni.orchestrator.profiler",
    "stop_profile": "vllm_omni.orchestrator.profiler",
}


def test_every_verb_has_one_handler_in_the_module_of_its_feature():
    assert {name: fn.__module__ for name, fn in HANDLERS.items() if name in VERBS} == VERBS


def test_an_unknown_method_is_a_value_error_naming_it_and_the_known_ones():
    core = EngineCore.__new__(EngineCore)  # no model: the lookup fails before a handler runs
    with pytest.raises(ValueError, match=r"unknown control method 'snooze'") as error:
        core.call("snooze", 1)
    assert all(verb in str(error.value) for verb in VERBS)


def test_call_hands_the_core_and_the_arguments_to_the_handler():
    core = EngineCore.__new__(EngineCore)
    try:
        handler("test-echo")(lambda got, *args: done((got, args)))
        assert core.call("test-echo", 1, "two").result() == (core, (1, "two"))
        with pytest.raises(ValueError, match="has a handler already"):
            handler("test-echo")(lambda got: done(None))
    finally:
        HANDLERS.pop("test-echo", None)


def test_is_sleeping_is_answered_at_once_from_the_scheduler():
    core = EngineCore.__new__(EngineCore)
    core.scheduler = SimpleNamespace(paused=True)
    answer = core.call("is_sleeping")
    assert answer.done() and answer.result() is True


def test_the_replica_protocol_has_at_most_ten_members():
    members = {name for name in vars(Replica) if not name.startswith("_")} | set(Replica.__annotations__)
    assert "call" in members and len(members) <= 10


def _definitions(name: str) -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


@pytest.mark.parametrize(
    "verb, most",
    # The mechanism or handler, the engine's policy, Omni, AsyncOmni and the HTTP route where there is one.
    [("sleep", 6), ("wake_up", 6), ("is_sleeping", 5), ("update_weights", 5), ("load_lora", 3)],
)
def test_a_verb_is_defined_once_per_layer_that_does_something_with_it(verb, most):
    assert len(_definitions(verb)) <= most, _definitions(verb)


class _Replica:
    def __init__(self, alive: bool, answer: Future):
        self.is_alive, self.answer, self.calls = alive, answer, []

    def call(self, method, *args):
        self.calls.append((method, *args))
        return self.answer


def _stage(*replicas) -> StageRuntime:
    stage = StageRuntime.__new__(StageRuntime)  # no model: only its replicas
    stage.stage_id, stage.replicas = 3, list(replicas)
    return stage


def test_a_stage_calls_its_live_replicas_or_with_down_too_all_of_them():
    live, down = _Replica(True, done("ok")), _Replica(False, failed(ReplicaLostError("down")))
    stage = _stage(live, down)
    assert [(a.stage_id, a.replica) for a in stage.call("sleep", 1)] == [(3, 0)]
    assert live.calls == [("sleep", 1)] and down.calls == []
    assert [(a.stage_id, a.replica) for a in stage.call("update_weights", {}, "vae", down_too=True)] == [(3, 0), (3, 1)]
    assert down.calls == [("update_weights", {}, "vae")]


def test_wait_logs_a_lost_replica_and_raises_the_first_other_error_once_all_answered(caplog):
    late: Future = Future()
    answers = [
        Answer(0, 0, failed(ReplicaLostError("gone"))),
        Answer(0, 1, failed(ValueError("first"))),
        Answer(1, 0, failed(ValueError("second"))),
        Answer(1, 1, late),
    ]
    late.set_result(2)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="first"):
        wait(answers)
    assert "stage 0 replica 0: gone" in caplog.text
    assert wait([Answer(0, 0, done(1)), Answer(0, 1, failed(ReplicaLostError("gone"))), Answer(1, 0, late)]) == [1, 2]


def test_an_llm_replica_refuses_the_lora_verbs():
    pytest.importorskip("ray")
    from vllm_omni.orchestrator.llm_replicas import LlmReplica

    replica = LlmReplica.__new__(LlmReplica)  # no actor: the refusal makes no call
    replica._stage = SimpleNamespace(stage_id=0)
    for args in (("load_lora", "a", "/path", None), ("unload_lora", "a")):
        with pytest.raises(ValueError, match="^llm stage 0 serves no LoRA adapters$"):
            replica.call(*args).result()
