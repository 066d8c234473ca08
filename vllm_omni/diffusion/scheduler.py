"""Request-level batching policy: which waiting requests run together, and when.

- Capacity is ``od_config.max_num_seqs`` requests per batch.
- Only requests with the same `BatchKey` share a batch. The oldest waiting
  request's key goes first, so no key starves, and requests with other keys
  never block it (no head-of-line blocking).
- Lifecycle: the scheduler owns every request from `add` to `finish`, where its
  future is resolved: its output, `RequestFailedError` or `RequestAbortedError`.
  A future cancelled by its caller while waiting is dropped at scheduling time;
  one that is scheduled is marked running, so from then on only `abort` stops it.
- Admission wait: when the oldest waiting request arrived at an idle engine,
  the batch starts once it is full or ``request_batch_max_wait_ms`` after that
  arrival, whichever comes first. Requests that queued behind a running batch
  start as soon as it finishes: they have waited already.
"""

from __future__ import annotations

import threading
import time

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.request import (
    DiffusionRequest,
    OmniRequestOutput,
    RequestAbortedError,
    RequestFailedError,
)


class Scheduler:
    def __init__(self, od_config: OmniDiffusionConfig):
        self.capacity = od_config.max_num_seqs
        self.max_wait_s = od_config.request_batch_max_wait_ms / 1000.0
        self._waiting: list[DiffusionRequest] = []
        self._running: list[DiffusionRequest] = []
        self._cond = threading.Condition()
        self._idle_since = time.monotonic()
        self._closed = False

    def add(self, request: DiffusionRequest) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the diffusion engine is shut down")
            self._waiting.append(request)
            self._cond.notify()

    def abort(self, request_id: str) -> bool:
        """Fail a waiting request now, or flag a running one (its batch finishes, `finish` drops it)."""
        with self._cond:
            for i, request in enumerate(self._waiting):
                if request.request_id == request_id:
                    _fail(self._waiting.pop(i), RequestAbortedError(request_id))
                    return True
            for request in self._running:
                if request.request_id == request_id:
                    request.aborted = True
                    return True
        return False

    def state(self, request_id: str) -> tuple[str, DiffusionRequest] | None:
        """``("waiting" | "running", request)`` for a request in flight, else ``None``."""
        with self._cond:
            for state, requests in (("waiting", self._waiting), ("running", self._running)):
                for request in requests:
                    if request.request_id == request_id:
                        return state, request
        return None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def schedule(self, timeout: float | None = None) -> list[DiffusionRequest]:
        """Block until a batch is due and return it; ``[]`` after ``timeout`` seconds or on `close`."""
        give_up = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                wait = None if give_up is None else give_up - now
                self._waiting = [r for r in self._waiting if not r.future.cancelled()]
                if self._waiting:
                    head = self._waiting[0]
                    batch = [r for r in self._waiting if r.key == head.key][: self.capacity]
                    start_at = head.arrival_time + self.max_wait_s if head.arrival_time >= self._idle_since else now
                    if len(batch) == self.capacity or now >= start_at:
                        chosen = set(map(id, batch))
                        self._waiting = [r for r in self._waiting if id(r) not in chosen]
                        self._running = [r for r in batch if r.future.set_running_or_notify_cancel()]
                        if self._running:
                            return self._running
                        continue
                    wait = start_at - now if wait is None else min(wait, start_at - now)
                if wait is not None and wait <= 0:
                    return []
                self._cond.wait(wait)
        return []

    def finish(self, batch: list[DiffusionRequest], outputs: list[OmniRequestOutput | BaseException]) -> None:
        """Resolve each request's future with its output; the engine is idle from now on."""
        with self._cond:
            self._running = []
            self._idle_since = time.monotonic()
        for request, output in zip(batch, outputs, strict=True):
            if request.aborted:
                request.future.set_exception(RequestAbortedError(request.request_id))
            elif isinstance(output, BaseException):
                request.future.set_exception(RequestFailedError(request.request_id, f"{type(output).__name__}: {output}"))
            else:
                request.future.set_result(output)

    def close(self, reason: str) -> None:
        """Stop scheduling and fail every request still waiting with ``reason``."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = self._waiting, []
            self._cond.notify_all()
        for request in waiting:
            _fail(request, RequestFailedError(request.request_id, reason))


def _fail(request: DiffusionRequest, error: RequestFailedError) -> None:
    """Fail a request that is still waiting, unless its caller has cancelled it already."""
    if request.future.set_running_or_notify_cancel():
        request.future.set_exception(error)
