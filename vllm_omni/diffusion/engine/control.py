"""The control verbs of an engine (``sleep``, ``update_weights``, ``load_lora``, ``start_profile``, ...): `HANDLERS`,
the one table `EngineCore.call` looks a verb up in, filled by the module of each feature with `handler`.

A handler takes the `EngineCore` first, then the verb's arguments, and answers a `Future` (the work it queues on
the engine's thread with ``core.scheduler.call``, or an answer already known: `done`); it may raise at once for
arguments it refuses. The feature modules import this one, never `core` (which imports them, so that the
table is full once the engine exists; the process profiler's handlers are `orchestrator/profiler.py`'s, registered when
the replica module imports it). A verb travels the same way at every layer: ``OmniEngine`` (its policy across
stages) → ``StageRuntime.call`` → ``Replica.call`` → (Ray: the actor's ``engine_call``) → ``EngineCore.call``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

HANDLERS: dict[str, Callable[..., Future]] = {}
"""Each control verb's handler, by name."""


def handler(name: str) -> Callable[[Callable[..., Future]], Callable[..., Future]]:
    """Register the decorated function as the handler of verb ``name`` (once: a second one is a ValueError)."""

    def register(fn: Callable[..., Future]) -> Callable[..., Future]:
        if name in HANDLERS:
            raise ValueError(f"control verb {name!r} has a handler already: {HANDLERS[name].__module__}")
        HANDLERS[name] = fn
        return fn

    return register


def done(value: Any) -> Future:
    """A future that holds ``value`` already."""
    future: Future = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future:
    """A future failed with ``error`` already."""
    future: Future = Future()
    future.set_exception(error)
    return future
