"""Fault and timing control for tests: an engine whose batches finish when the test says so."""

from __future__ import annotations

import threading
from collections.abc import Callable


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
