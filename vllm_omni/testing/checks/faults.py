"""Fault and timing control for tests: an engine whose batches finish when the test says so."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def hold_batches(scheduler, then_break: bool = False) -> Callable[[], None]:
    """Make ``scheduler``'s engine run its batches but resolve none of their requests until the returned function
    is called, so that the test, not the speed of the machine, decides when a running request ends. With
    ``then_break`` the engine loop dies right after the first batch it finishes (a simulated scheduler bug);
    without, releasing also restores the scheduler."""
    finish, released = scheduler.finish, threading.Event()

    def finish_when_released(batch, outputs):
        released.wait()
        finish(batch, outputs)
        if then_break:
            raise RuntimeError("simulated scheduler bug")

    def release() -> None:
        if not then_break:
            scheduler.finish = finish
        released.set()

    scheduler.finish = finish_when_released
    return release


def run_together(omni, requests: list[tuple[str, Any]], tag: str) -> list:
    """Run ``requests`` (prompt, params) on stage 0's first replica of ``omni`` as queued at one instant: they are
    added while its engine thread is held in an engine call, so the batches they form are the policy's alone."""
    engine = omni.engine.stages[0].replicas[0].engine
    queued = threading.Event()
    held = engine.scheduler.call(queued.wait)  # pending calls run before any batch is formed
    try:
        futures = [omni.engine.add_request(f"{tag}-{i}", prompt, p) for i, (prompt, p) in enumerate(requests)]
    finally:
        queued.set()
    held.result(timeout=600)
    return [f.result(timeout=600) for f in futures]
