"""Batch schedulers: which waiting requests run together, and when (not to be confused with the diffusers noise
schedulers that the steppers drive).

`BatchScheduler` is the request-level policy (``execution_mode: request``);
`StepBatchScheduler` the step-level one (``execution_mode: step``, see its docstring).

- Capacity is ``od_config.stage.max_num_seqs`` requests per batch, and at most
  ``od_config.stage.max_batch_pixels`` of ``width × height × frames × n`` summed over
  them when set (a request larger than that runs alone). The budget only makes
  batches smaller: the oldest request always goes first.
- Order: the waiting queue is ordered by arrival (``scheduling_policy: fcfs``) or by (``priority``, arrival)
  (``priority``: lower first). "The best waiting request" below is its head.
- Only requests with the same `BatchKey` share a batch. The best waiting
  request's key goes first, so no key starves within a priority, and requests with other keys
  never block it (no head-of-line blocking). A running batch is never interrupted (step mode: but for
  preemption, `StepBatchScheduler`).
- Lifecycle: the scheduler owns every request from `add` to `finish`, where its
  future is resolved: its output, `RequestFailedError` or `RequestAbortedError`.
  A future cancelled by its caller while waiting is dropped at scheduling time;
  one that is scheduled is marked running, so from then on only `abort` stops it.
- Admission wait: the batch starts once it is full or at `_start_at`: with
  ``request_batch_wait: window``, ``request_batch_max_wait_ms`` after the best
  waiting request arrived at an idle engine (at once if it waited while the
  engine was busy); with ``adaptive``, at `admission_deadline`, at most the
  window after it arrived at an idle engine (or after the engine became idle
  with it waiting): at once unless recent arrivals and finished batches say
  company is likely, and then only while the next request is expected. In step
  mode the same wait holds back an idle stage's first encode (nothing running,
  decoding, being encoded or preempted), so that a closed loop's clients, coming
  back moments apart, are encoded in one text-encoder call and start together;
  requests that arrive while others run join at the next step without waiting.
- LoRA: a batch (in step mode, the requests running and being encoded) uses at
  most ``max_loras`` distinct adapters, so every adapter it needs is resident.
- Engine calls (`call`): work that must run on the engine's thread between
  batches or steps (loading an adapter) wakes the scheduler and runs first. A
  draining call (new weights, sleep) runs once the requests in progress have
  finished, and no request starts (nor, in step mode, begins encoding) before
  it has run: a batch finishes on the weights it started with.
- Sleep (`pause`): while paused no request starts (nor begins encoding); requests that arrive wait, and calls
  still run, so that the wake-up (a call) can resume it.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.errors import RequestAbortedError, RequestFailedError, StageUnavailableError
from vllm_omni.outputs import OmniRequestOutput, StageOutput


def adapters_of(requests: Iterable[DiffusionRequest]) -> set[str]:
    """The names of the LoRA adapters ``requests`` apply."""
    return {selection.name for request in requests for selection in request.params.lora}


class Arrival(NamedTuple):
    """One request's arrival at a scheduler, as the admission wait reads it (`admission_deadline`)."""

    time: float
    company: bool
    """Whether another request was waiting or running when it arrived."""


class Finish(NamedTuple):
    """A batch that finished, as the admission wait reads it: its clients may send their next requests."""

    time: float
    size: int


ARRIVAL_HISTORY = 16
"""Arrivals the admission wait remembers: enough for a few bursts of a closed loop, few enough to follow a change of
load within about ten arrivals."""

FINISH_HISTORY = 4
"""Finished batches the admission wait remembers (their clients' answers are the arrivals after them)."""


def admission_deadline(
    arrivals: Sequence[Arrival], first: float, window_s: float, finishes: Sequence[Finish] = ()
) -> float:
    """When a batch starts if it has not filled before: its best request arrived at ``first``, or ``first`` is when
    the engine became idle with it waiting; ``arrivals`` and ``finishes`` are the recent ones, oldest first;
    ``window_s`` (the stage's ``request_batch_max_wait_ms``) bounds the wait. It waits while company is expected,
    by either of two signs, and then for twice the gap that sign has seen (a straggler that misses the batch waits
    a whole batch; a short wait costs the batch little); else it starts at once. Pure: the tests drive it without
    timing.

    - A busy stream: at least half of the recent arrivals came within the window of the one before while another
      request was in flight. It waits until twice the longest such gap after the latest arrival.
    - Clients coming back: at least half of the requests of the earlier finished batches were followed by an
      arrival within the window (a closed loop), and fewer have arrived since the last batch finished than it
      held. It waits until twice the longest such delay after that finish.

    A lone client shows neither (its next request comes after its answer, and alone). Where clients come back, the
    second sign decides alone: once all are back nobody is expected."""
    if window_s <= 0:
        return first
    returning = _return_deadline(arrivals, finishes, window_s)
    # A closed loop whose clients are all back expects nobody, whatever the stream looked like (a lone client after
    # a busy spell would else pay the window until the busy arrivals leave the history).
    sign = returning if returning is not None else _stream_deadline(arrivals, window_s)
    return min(first + window_s, max(first, sign))


def _stream_deadline(arrivals: Sequence[Arrival], window_s: float) -> float:
    gaps = [
        later.time - earlier.time
        for earlier, later in itertools.pairwise(arrivals)
        if later.company and later.time - earlier.time <= window_s
    ]
    if not gaps or 2 * len(gaps) < len(arrivals) - 1:
        return -math.inf
    return arrivals[-1].time + 2 * max(gaps)


def _return_deadline(arrivals: Sequence[Arrival], finishes: Sequence[Finish], window_s: float) -> float | None:
    """``None`` without a sign of a closed loop; ``-inf`` when its clients are all back."""
    if not finishes or not arrivals:
        return None
    seen = [f for f in finishes if f.time >= arrivals[0].time]  # those whose answers' arrivals are remembered
    delays: list[float] = []
    for finish, following in itertools.pairwise(seen):
        end = min(finish.time + window_s, following.time)  # an arrival after the next finish is that one's
        delays += [a.time - finish.time for a in arrivals if finish.time <= a.time < end][: finish.size]
    if not delays or 2 * len(delays) < sum(f.size for f in seen[:-1]):
        return None
    latest = finishes[-1]
    if sum(a.time >= latest.time for a in arrivals) >= latest.size:
        return -math.inf
    return latest.time + 2 * max(delays)


class BatchScheduler:
    def __init__(self, od_config: OmniDiffusionConfig, clock: Callable[[], float] = time.monotonic):
        self.capacity = od_config.stage.max_num_seqs
        self.max_pixels = od_config.stage.max_batch_pixels
        self.max_wait_s = od_config.stage.request_batch_max_wait_ms / 1000.0
        self.adaptive_wait = self.max_wait_s > 0 and od_config.stage.request_batch_wait == "adaptive"
        self.max_loras = od_config.stage.max_loras
        self.by_priority = od_config.stage.scheduling_policy == "priority"
        """Whether the waiting queue is ordered by (``priority``, arrival) rather than by arrival."""
        self._clock = clock
        """Where the scheduler reads the time (``time.monotonic``, the clock of `DiffusionRequest.arrival_time`;
        the tests give their own)."""
        self._waiting: list[DiffusionRequest] = []
        """Best first: by arrival, or by (``priority``, arrival)."""
        self._running: list[DiffusionRequest] = []
        self._calls: list[_Call] = []
        self._arrivals: deque[Arrival] = deque(maxlen=ARRIVAL_HISTORY)
        self._finishes: deque[Finish] = deque(maxlen=FINISH_HISTORY)
        self._cond = threading.Condition()
        self._idle_since = clock()
        self._closed = False
        self.paused = False
        """Whether the engine sleeps: no request starts until `pause` (False)."""
        self.on_schedule: Callable[[list[DiffusionRequest]], None] | None = None
        """Told of each batch `schedule` starts, before it runs: the request engine's metrics observe the scheduler
        there (the step engine observes each step's batch itself, once late joiners are in)."""

    def call(self, fn: Callable[[], Any], *, drain: bool = False) -> Future:
        """Run ``fn`` on the engine's thread at the next batch or step boundary; the future holds its result.
        ``drain``: at the first boundary with no request in progress, and no request starts before it has run."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the diffusion engine is shut down")
            self._calls.append(_Call(fn, future, drain))
            self._cond.notify_all()
        return future

    @property
    def _draining(self) -> bool:
        """Whether a draining call waits: no request may start until it has run."""
        return any(call.drain for call in self._calls)

    def pause(self, paused: bool) -> None:
        """Sleep (True) or serve again (False; the requests that waited meanwhile start at once)."""
        with self._cond:
            self.paused, self._idle_since = paused, self._clock()
            self._cond.notify_all()

    def _due_calls(self) -> list[_Call]:
        """The pending calls that may run now (a draining one once nothing is in progress)."""
        busy = bool(self._in_progress())
        return [call for call in self._calls if not (call.drain and busy)]

    def run_calls(self) -> None:
        """Run the pending `call` functions that are due (the engine's thread, at a boundary), in order."""
        with self._cond:
            calls = self._due_calls()
            self._calls = [call for call in self._calls if call not in calls]
        for fn, future, _ in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller's future says why
                    future.set_exception(exc)

    def adapters_in_use(self) -> set[str]:
        """The adapters of the requests past scheduling: what an adapter load must not evict."""
        with self._cond:
            return adapters_of(self._in_progress())

    def fits(self, batch: list[DiffusionRequest], request: DiffusionRequest) -> bool:
        """Whether ``request`` may join ``batch`` within the pixel budget (the first request always may)."""
        return not batch or self.max_pixels is None or sum(r.pixels for r in batch) + request.pixels <= self.max_pixels

    def _fitting(self, candidates: list[DiffusionRequest], in_use: set[str]) -> tuple[list[DiffusionRequest], bool]:
        """The oldest ``candidates`` that fit beside ``in_use`` adapters, up to capacity and the pixel budget; and
        whether waiting cannot make the batch fuller (one was left out for its adapters, or the budget is spent)."""
        chosen: list[DiffusionRequest] = []
        adapters, left_out = set(in_use), False
        for request in candidates:
            if len(chosen) == self.capacity:
                break
            if not self.fits(chosen, request):
                return chosen, True
            wanted = adapters | adapters_of([request])
            if len(wanted) > self.max_loras:
                left_out = True
                continue
            chosen.append(request)
            adapters = wanted
        # Requests that share a key have the same size: one more like the last would not fit, so none would.
        spent = bool(chosen) and not self.fits(chosen, chosen[-1])
        return chosen, left_out or spent

    def add(self, request: DiffusionRequest) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the diffusion engine is shut down")
            if self.adaptive_wait:
                self._arrivals.append(Arrival(request.arrival_time, bool(self._waiting or self._in_progress())))
            # After every request of its rank: arrival order among equals (fcfs ranks all alike, so it appends).
            bisect.insort(self._waiting, request, key=self._rank)
            self._cond.notify()

    def _rank(self, request: DiffusionRequest) -> int:
        """Where a request queues: by its ``priority`` under the ``priority`` policy, else all alike."""
        return request.params.priority if self.by_priority else 0

    def abort(self, request_id: str) -> bool:
        """Fail a waiting request now (freeing what it keeps), or flag a running one (its batch finishes, `finish`
        drops it)."""
        with self._cond:
            for i, request in enumerate(self._waiting):
                if request.request_id == request_id:
                    self._release(self._waiting.pop(i))
                    _fail(request, RequestAbortedError(request_id))
                    return True
            for request in self._in_progress():
                if request.request_id == request_id:
                    request.aborted = True
                    return True
        return False

    def state(self, request_id: str) -> tuple[str, DiffusionRequest] | None:
        """``("waiting" | "running", request)`` for a request in flight, else ``None``."""
        with self._cond:
            for state, requests in (("waiting", self._waiting), ("running", self._in_progress())):
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
        """Block until a batch is due and return it (telling `on_schedule`); ``[]`` after ``timeout`` seconds or on
        `close`."""
        batch = self._next_batch(timeout)
        if batch and self.on_schedule is not None:
            self.on_schedule(batch)
        return batch

    def _next_batch(self, timeout: float | None) -> list[DiffusionRequest]:
        give_up = None if timeout is None else self._clock() + timeout
        with self._cond:
            while not self._closed:
                now = self._clock()
                wait = None if give_up is None else give_up - now
                self._waiting = [r for r in self._waiting if not r.future.cancelled()]
                if self._calls:
                    return []
                if self._waiting and not self.paused:
                    head = self._waiting[0]
                    batch, left_out = self._fitting([r for r in self._waiting if r.key == head.key], set())
                    start_at = self._start_at(head, now)
                    if len(batch) == self.capacity or left_out or now >= start_at:
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

    def _start_at(self, head: DiffusionRequest, now: float) -> float:
        """When a batch led by ``head`` starts if it has not filled before (``request_batch_wait``): ``window``,
        the window after its arrival at an idle engine, and at once when it waited while the engine was busy (its
        company had that time to come); ``adaptive``, `admission_deadline` from its arrival at an idle engine, or
        from when the engine became idle with it waiting."""
        if self.adaptive_wait:
            first = max(head.arrival_time, self._idle_since)
            return admission_deadline(self._arrivals, first, self.max_wait_s, self._finishes)
        return head.arrival_time + self.max_wait_s if head.arrival_time >= self._idle_since else now

    def finish(
        self, batch: list[DiffusionRequest], outputs: list[OmniRequestOutput | StageOutput | BaseException]
    ) -> None:
        """Resolve each request's future with its output; the engine is idle from now on."""
        with self._cond:
            self._running = []
            self._idle_since = self._clock()
            if self.adaptive_wait:
                self._finishes.append(Finish(self._idle_since, len(batch)))
        for request, output in zip(batch, outputs, strict=True):
            _resolve(request, output)

    def close(self, reason: str, *, include_running: bool = False) -> None:
        """Stop scheduling and fail every request still waiting with ``reason``; with ``include_running``
        (the engine loop died) the running ones too."""
        with self._cond:
            self._closed = True
            failed = [r for r in self._waiting if include_running or not self._started(r)]
            self._waiting = [r for r in self._waiting if r not in failed]
            calls, self._calls = self._calls, []
            if include_running:
                failed += self._in_progress()
            for request in failed:
                self._release(request)
            self._cond.notify_all()
        for request in failed:
            _fail(request, RequestFailedError(request.request_id, reason))
        for _, future, _ in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(reason))

    def _in_progress(self) -> list[DiffusionRequest]:
        """Requests past scheduling and not yet finished."""
        return list(self._running)

    def _started(self, request: DiffusionRequest) -> bool:
        """Whether a waiting request has started already (step mode: a preempted one), so that a `close` that
        lets the running requests finish lets it finish too."""
        return False

    def _release(self, request: DiffusionRequest) -> None:
        """Free what a request that leaves unfinished keeps in the scheduler (step mode: a preempted one's state)."""


def _resolve(request: DiffusionRequest, output: OmniRequestOutput | StageOutput | BaseException) -> None:
    """Resolve a scheduled request's future: its output, `RequestAbortedError` or `RequestFailedError`."""
    if request.future.done():  # failed already by `close(include_running=True)`
        return
    if request.aborted:
        request.future.set_exception(RequestAbortedError(request.request_id))
    elif isinstance(output, RequestFailedError):  # the engine's own failure of it (`NonFiniteOutputError`)
        request.future.set_exception(output)
    elif isinstance(output, BaseException):
        request.future.set_exception(RequestFailedError(request.request_id, f"{type(output).__name__}: {output}"))
    else:
        request.future.set_result(output)


def _fail(request: DiffusionRequest, error: RequestFailedError) -> None:
    """Fail a request, unless it is done already or its caller has cancelled it while it waited."""
    if request.future.done():
        return
    if request.future.running() or request.future.set_running_or_notify_cancel():
        with contextlib.suppress(InvalidStateError):  # resolved meanwhile by another thread
            request.future.set_exception(error)


class _Call(NamedTuple):
    """A function to run on the engine's thread (`BatchScheduler.call`)."""

    fn: Callable[[], Any]
    future: Future
    drain: bool


@dataclass
class StepPlan:
    """What the step engine does at one step boundary."""

    to_prepare: list[DiffusionRequest] = field(default_factory=list)
    """Waiting requests to hand to the encode worker now."""
    batch: list[DiffusionRequest] = field(default_factory=list)
    """The running requests: one denoiser forward for all of them."""
    dropped: list[DiffusionRequest] = field(default_factory=list)
    """Running requests aborted since the last step; their slots are free again."""
    preempted: list[DiffusionRequest] = field(default_factory=list)
    """Running requests that left the batch at this boundary for better ones; they wait with their state kept."""


class StepBatchScheduler(BatchScheduler):
    """Step-level policy: requests join and leave the running batch at denoising-step boundaries.

    - At every boundary, waiting requests whose prompt is encoded join the running
      batch, best first (by arrival, or by (``priority``, arrival)), while it holds fewer than ``max_num_seqs``
      requests and the next one fits the pixel budget. A better request that is not yet handed to the encoder does
      not hold back encoded ones.
    - Only requests with the same key share the running batch (what must match
      inside one forward: size, frames, text length). Steps and guidance may differ.
    - Fairness: when the best waiting request needs another key, the running key
      stops admitting and drains; the best key starts once it is empty. So a
      request waits at most for the requests that were running when it arrived (and, by priority, for the better
      ones that arrive meanwhile).
    - Admission wait: an idle stage holds its first encode back for company as request mode holds a batch
      (``request_batch_max_wait_ms``, ``request_batch_wait``; the module docstring), then encodes what came.
    - Encoding runs ahead of admission: a waiting request is handed to the encoder while fewer than
      ``max_num_seqs`` requests ahead of it are encoded (or being encoded), best first. Under ``fcfs`` that is
      ``max_num_seqs`` at a time; under ``priority`` a better request is encoded at once, however many worse ones
      are, so that it can preempt.
    - Preemption (``priority`` only): when an encoded waiting request cannot join (the batch is full, its pixel
      budget spent, or it runs another key) and running requests have a strictly worse priority, the worst of them
      (worst priority, latest arrival) leave the batch at this boundary until it can: as many as it needs for a
      slot (and pixels), or every running one for another key (only if all are worse). A preempted request
      waits with its whole state (`DiffusionRequest.state`: latents, noise scheduler, generator, step-cache and
      SDE state; its previews counter) and rejoins, best first among the waiting, at the step it left; it may be
      preempted again. Equal priorities never preempt each other, so nothing ping-pongs.
    - Kept-state limit: the bytes of the preempted requests' states (``measure``) stay within
      ``max_preempted_state_mb``. A preemption that would pass it does not happen: the better request waits for a
      slot. While that is so (at the latest boundary a preemption was held back for the limit), a new request that
      would wait behind every waiting request is refused with `StageUnavailableError` (a 503) naming the knob. No
      request already queued, running or preempted is ever failed for it.
    - An abort of a running request frees its slot at the next boundary; one of a preempted request fails it at
      once and frees its state; one of a request that is being decoded drops its result. Preempted requests count
      as in progress: a draining call waits for them (they rejoin while it waits: they started on the weights in
      place), and a `close` lets them finish.
    """

    def __init__(
        self,
        od_config: OmniDiffusionConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        measure: Callable[[Any], int],
    ):
        """``measure``: the bytes a request's state keeps (the engine's `kept_nbytes`; the tests' states are their
        own)."""
        super().__init__(od_config, clock)
        self._finishing: list[DiffusionRequest] = []
        self.stage_id = od_config.stage.stage_id
        self.max_kept_bytes = od_config.stage.max_preempted_state_mb * 2**20
        self.preempts = self.by_priority and self.max_kept_bytes > 0
        """Whether running requests may be preempted: the ``priority`` policy, with room to keep their state."""
        self._measure = measure
        self.kept_bytes = 0
        """What the preempted requests keep now (the sum of their `DiffusionRequest.kept_bytes`)."""
        self._held_back = False
        """Whether at the latest boundary a preemption was held back for ``max_preempted_state_mb``."""
        self._done_since_idle = 0
        """Requests completed since the stage was last idle: the size of the `Finish` its becoming idle records."""

    def _in_progress(self) -> list[DiffusionRequest]:
        """Running, decoding, preempted, and on an encode worker: a draining call waits for those too."""
        waiting = [r for r in self._waiting if r.preempted or (r.preparing and r.state is None)]
        return self._running + self._finishing + waiting

    def _started(self, request: DiffusionRequest) -> bool:
        return request.preempted

    def _release(self, request: DiffusionRequest) -> None:
        if request.preempted:
            self._resume(request)
            request.state = None  # its latents, scheduler and caches go with it

    def _resume(self, request: DiffusionRequest) -> None:
        """A preempted request's state no longer counts against the limit (it rejoins, or it leaves)."""
        self.kept_bytes -= request.kept_bytes
        request.preempted, request.kept_bytes = False, 0

    def adapters_in_use(self) -> set[str]:
        """The adapters of the running requests, of the preempted ones and of those encoded or being encoded."""
        with self._cond:
            return adapters_of(self._running + [r for r in self._waiting if r.preparing])

    @property
    def has_unfinished(self) -> bool:
        with self._cond:
            return bool(self._running or self._finishing or any(r.preempted for r in self._waiting))

    def add(self, request: DiffusionRequest) -> None:
        """Queue ``request``; refused (`StageUnavailableError`) while preemption is held back by the kept-state limit
        and it would wait behind every waiting request (class docstring)."""
        with self._cond:
            refused = (
                self._held_back
                and not self._closed
                and all(self._rank(request) >= self._rank(r) for r in self._waiting)
            )
            if not refused:
                super().add(request)
        if refused:
            limit = self.max_kept_bytes // 2**20
            why = (
                f"the state kept by its preempted requests is at max_preempted_state_mb ({limit} MiB) and this "
                f"request (priority {request.params.priority}) would wait behind every waiting request; retry later, "
                "or raise --max-preempted-state-mb"
            )
            _fail(request, StageUnavailableError(self.stage_id, why, request.request_id))

    def plan(self, timeout: float | None = None) -> StepPlan:
        """Block until there is work (an encode to start, a batch to step, an abort) and return it.

        With requests running it never blocks: the running batch is stepped at once.
        """
        return self._next_plan(timeout)

    def _next_plan(self, timeout: float | None) -> StepPlan:
        give_up = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._waiting = [r for r in self._waiting if not r.future.cancelled()]
                plan = StepPlan(dropped=[r for r in self._running if r.aborted])
                self._running = [r for r in self._running if not r.aborted]
                plan.preempted = self._admit()
                plan.batch = list(self._running)
                now = self._clock()
                held_until = self._encodes_held_until(now)
                plan.to_prepare = self._to_encode() if held_until is None else []
                if (
                    plan.to_prepare
                    or plan.batch
                    or plan.dropped
                    or self._due_calls()
                    or (self._closed and not self._finishing)
                ):
                    return plan
                wait = None if give_up is None else give_up - now
                if wait is not None and wait <= 0:
                    return plan
                if held_until is not None:
                    wait = held_until - now if wait is None else min(wait, held_until - now)
                self._cond.wait(wait)

    def _idle(self) -> bool:
        """Whether nothing is in progress: no request running, decoding, being encoded or preempted."""
        return not (self._running or self._finishing or any(r.preparing or r.preempted for r in self._waiting))

    def _encodes_held_until(self, now: float) -> float | None:
        """When an idle stage starts encoding a group that is not full (the admission wait of the module docstring,
        as request mode starts a batch: ``request_batch_max_wait_ms`` and ``request_batch_wait``), or ``None`` to start
        now. Only an idle stage waits: requests that arrive while others run join at the next step."""
        if self.max_wait_s <= 0 or not self._waiting or self.paused or self._draining or not self._idle():
            return None
        head = self._waiting[0]
        group, left_out = self._fitting([r for r in self._waiting if r.key == head.key], set())
        start_at = self._start_at(head, now)
        return None if len(group) == self.capacity or left_out or now >= start_at else start_at

    def _to_encode(self) -> list[DiffusionRequest]:
        """The waiting requests to hand to the encoder now, marked as handed (the look-ahead of the class
        docstring), best first, within ``max_loras`` beside the adapters in use."""
        if self._draining or self.paused:
            return []
        handed, ahead = [], 0
        in_use = adapters_of(self._running + [r for r in self._waiting if r.preparing])
        for request in self._waiting:
            if request.preempted:
                continue  # encoded long ago: its state counts against the kept-state limit instead
            if not request.preparing:
                if ahead >= self.capacity:
                    break
                wanted = in_use | adapters_of([request])
                if len(wanted) > self.max_loras:
                    break  # best first: it is prepared once the adapters in use leave room
                in_use = wanted
                request.preparing = True
                handed.append(request)
            ahead += 1
        return handed

    def _admit(self) -> list[DiffusionRequest]:
        """Move encoded waiting requests into the running batch, preempting worse running ones where the policy
        lets them (the class docstring); returns the preempted."""
        self._held_back = False
        if self.paused:
            return []
        preempted: list[DiffusionRequest] = []
        # While a draining call waits only preempted requests rejoin: they started on the weights in place. A request
        # not yet handed to the encoder (a better one that arrived behind others) does not count here: waiting for it
        # would hold the slots.
        for request in [r for r in self._waiting if r.preparing and (r.preempted or not self._draining)]:
            if request.state is None:
                break  # being encoded: the ones behind it wait their turn
            if not self._joins(self._running, request):
                victims = self._victims(request)
                if not victims:
                    break
                sizes = [self._measure(victim.state) for victim in victims]
                if self.kept_bytes + sum(sizes) > self.max_kept_bytes:
                    self._held_back = True
                    break
                for victim, size in zip(victims, sizes, strict=True):
                    self._preempt(victim, size)
                preempted += victims
            self._waiting.remove(request)
            if request.preempted:
                self._resume(request)
                self._running.append(request)
            elif request.future.set_running_or_notify_cancel():
                self._running.append(request)
        return preempted

    def _joins(self, running: list[DiffusionRequest], request: DiffusionRequest) -> bool:
        """Whether ``request`` may join ``running``: a free slot, its key, within the pixel budget."""
        same_key = not running or running[0].key == request.key
        return same_key and len(running) < self.capacity and self.fits(running, request)

    def _victims(self, request: DiffusionRequest) -> list[DiffusionRequest]:
        """The running requests that leave for ``request`` (worst first), or none when it cannot join that way."""
        if not self.preempts or self._draining:
            return []
        rank = self._rank(request)
        worse = sorted(
            (r for r in self._running if self._rank(r) > rank),
            key=lambda r: (self._rank(r), r.arrival_time),
            reverse=True,
        )
        if self._running[0].key != request.key:  # another key: the whole batch leaves, or none of it
            return worse if len(worse) == len(self._running) else []
        staying = list(self._running)
        for count, victim in enumerate(worse, start=1):
            staying.remove(victim)
            if self._joins(staying, request):
                return worse[:count]
        return []

    def _preempt(self, request: DiffusionRequest, size: int) -> None:
        """``request`` leaves the running batch and waits, its state kept, in its place among the waiting."""
        self._running.remove(request)
        request.preempted, request.kept_bytes = True, size
        self.kept_bytes += size
        bisect.insort(self._waiting, request, key=lambda r: (self._rank(r), r.arrival_time))

    def prepared(self, request: DiffusionRequest, state) -> bool:
        """Attach the encoded ``state``; False (and nothing attached) if the request left the queue meanwhile."""
        with self._cond:
            if not any(r is request for r in self._waiting):
                return False
            request.state = state
            self._cond.notify_all()
            return True

    def fail_waiting(self, request: DiffusionRequest, error: BaseException) -> None:
        """Fail a waiting request on its own (its encoding failed)."""
        with self._cond:
            self._waiting = [r for r in self._waiting if r is not request]
            self._cond.notify_all()
        _fail(request, RequestFailedError(request.request_id, f"{type(error).__name__}: {error}"))

    def retire(self, requests: list[DiffusionRequest]) -> None:
        """Denoising is done for ``requests``: they leave the running batch and are decoded."""
        with self._cond:
            done = set(map(id, requests))
            self._running = [r for r in self._running if id(r) not in done]
            self._finishing += requests
            self._cond.notify_all()

    def complete(self, request: DiffusionRequest, output: OmniRequestOutput | StageOutput | BaseException) -> None:
        """Resolve a request that was running or decoding with its output (or error)."""
        self.complete_all([request], [output])

    def complete_all(
        self, requests: list[DiffusionRequest], outputs: list[OmniRequestOutput | StageOutput | BaseException]
    ) -> None:
        """`complete` for requests decoded together: all leave before any is resolved, so that a client that sends
        its next request on its answer finds the stage idle if it is (the admission wait counts from there)."""
        done = set(map(id, requests))
        with self._cond:
            self._running = [r for r in self._running if id(r) not in done]
            self._finishing = [r for r in self._finishing if id(r) not in done]
            self._done_since_idle += len(requests)
            if self._idle():  # the admission wait counts from here (`_encodes_held_until`)
                self._idle_since = self._clock()
                if self.adaptive_wait:
                    self._finishes.append(Finish(self._idle_since, self._done_since_idle))
                self._done_since_idle = 0
            self._cond.notify_all()
        for request, output in zip(requests, outputs, strict=True):
            request.state = None
            _resolve(request, output)
