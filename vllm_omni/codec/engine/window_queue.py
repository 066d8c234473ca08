"""The codec stage's scheduler: the code windows waiting for a decode call, and which ones the next call takes.

A call decodes windows of one shape (frames) at once, up to the stage's ``max_num_seqs``. It takes the most urgent
window, then the next most urgent of its shape: under ``window_order: underrun``, urgency is when the window's stream
runs out of audio played in real time (a stream's first window is due at once, at its arrival); under ``arrival``,
when the window came. The stage's ``scheduling_policy: priority`` puts the request's ``priority`` first.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_omni.codec.pipeline.codecs import CodeWindow
from vllm_omni.errors import RequestAbortedError


@dataclass
class WindowJob:
    """One window of one request, and what the hand-off needs back."""

    request_id: str
    window: CodeWindow
    due: float
    """``time.monotonic()`` at which its stream runs out of audio (underrun order)."""
    priority: int = 0
    arrived: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


class WindowQueue:
    """Thread-safe: the hand-off adds windows from its threads; the replica's thread takes batches."""

    def __init__(self, capacity: int, order: str, by_priority: bool):
        """``capacity``: the most windows a decode call takes (the stage's ``max_num_seqs``)."""
        self.capacity = capacity
        self._order = order
        self._by_priority = by_priority
        self._jobs: list[tuple[tuple, WindowJob]] = []
        self._count = itertools.count()
        self._ready = threading.Condition()
        self._closed = False

    def add(self, job: WindowJob) -> None:
        urgency = job.due if self._order == "underrun" else job.arrived
        key = (job.priority if self._by_priority else 0, urgency, next(self._count))
        with self._ready:
            if self._closed:
                raise RuntimeError("the codec stage is shutting down")
            self._jobs.append((key, job))
            self._ready.notify()

    def take(self) -> list[WindowJob] | None:
        """The next batch (blocks until there is one); ``None`` once closed and empty."""
        with self._ready:
            while not self._jobs and not self._closed:
                self._ready.wait()
            if not self._jobs:
                return None
            self._jobs.sort(key=lambda entry: entry[0])
            frames = len(self._jobs[0][1].window.codes)
            batch = [entry for entry in self._jobs if len(entry[1].window.codes) == frames][: self.capacity]
            taken = {id(entry) for entry in batch}
            self._jobs = [entry for entry in self._jobs if id(entry) not in taken]
            return [job for _, job in batch]

    def abort(self, request_id: str) -> bool:
        """Drop the request's waiting windows (their futures fail `RequestAbortedError`)."""
        with self._ready:
            dropped = [job for _, job in self._jobs if job.request_id == request_id]
            self._jobs = [entry for entry in self._jobs if entry[1].request_id != request_id]
        for job in dropped:
            job.future.set_exception(RequestAbortedError(request_id))
        return bool(dropped)

    def __len__(self) -> int:
        with self._ready:
            return len(self._jobs)

    def close(self) -> None:
        """Take no more windows; those waiting are still decoded."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
