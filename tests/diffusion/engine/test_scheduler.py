"""BatchScheduler policy: capacity, batch keys, no head-of-line blocking, no starvation, priority order, admission
wait (by events on a clock of the test's), LoRA adapters per batch, engine calls."""

import threading
import time

import pytest

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine.request import BatchKey, DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import Arrival, BatchScheduler, Finish, admission_deadline
from vllm_omni.errors import RequestAbortedError, RequestFailedError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


class Clock:
    """The scheduler's clock, moved by the test: the admission wait is decided without real time passing."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(max_num_seqs=4, wait_ms=0.0, clock=time.monotonic, **knobs) -> BatchScheduler:
    return BatchScheduler(
        OmniDiffusionConfig.from_stage(
            "unused",
            StageDeployConfig(
                max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms, execution_mode="request", **knobs
            ),
        ),
        clock,
    )


def _request(name: str, size: int = 32, at: float | None = None, **params) -> DiffusionRequest:
    """A request; ``at``: its arrival on the test's clock (else now, on the real one)."""
    full = OmniDiffusionSamplingParams(height=size, width=size, num_inference_steps=4, **params)
    request = DiffusionRequest.create(name, f"prompt {name}", full, key=BatchKey.of(full))
    if at is not None:
        request.arrival_time = at
    return request


def _ids(batch):
    return [r.request_id for r in batch]


def _run(scheduler: BatchScheduler, batch) -> None:
    scheduler.finish(batch, [OmniRequestOutput(r.request_id, r.prompt) for r in batch])


def test_capacity_is_max_num_seqs():
    scheduler = _scheduler(max_num_seqs=4)
    for i in range(6):
        scheduler.add(_request(f"r{i}"))
    first = scheduler.schedule(timeout=1)
    assert _ids(first) == ["r0", "r1", "r2", "r3"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=1)) == ["r4", "r5"]


@pytest.mark.parametrize(
    "other",
    [
        dict(size=64),
        dict(num_outputs_per_prompt=2),
        dict(guidance_scale=7.0),
        dict(negative_prompt="blurry"),
        dict(output_type="np"),
        dict(extra_args={"max_sequence_length": 32}),
    ],
)
def test_only_requests_with_the_same_key_batch_together(other):
    scheduler = _scheduler(max_num_seqs=4)
    scheduler.add(_request("a"))
    scheduler.add(_request("b", **other))
    scheduler.add(_request("c"))
    first = scheduler.schedule(timeout=1)
    assert _ids(first) == ["a", "c"]  # c is not blocked behind the incompatible b
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=1)) == ["b"]


def test_different_seeds_and_prompts_share_a_batch():
    scheduler = _scheduler(max_num_seqs=4)
    scheduler.add(_request("a", seed=1))
    scheduler.add(_request("b", seed=2))
    assert _ids(scheduler.schedule(timeout=1)) == ["a", "b"]


def test_oldest_key_goes_first_so_no_key_starves():
    scheduler = _scheduler(max_num_seqs=2)
    scheduler.add(_request("a1"))
    scheduler.add(_request("big", size=64))
    for i in range(2, 8):
        scheduler.add(_request(f"a{i}"))
    first = scheduler.schedule(timeout=1)
    assert _ids(first) == ["a1", "a2"]
    _run(scheduler, first)
    second = scheduler.schedule(timeout=1)
    assert _ids(second) == ["big"]  # oldest waiting, although more compatible a* requests wait
    _run(scheduler, second)
    assert _ids(scheduler.schedule(timeout=1)) == ["a3", "a4"]


def test_the_window_policy_waits_the_whole_window_and_a_burst_after_idle_runs_as_one_batch():
    """``request_batch_wait: window`` (the default): a lone client pays the window on every request, and a burst
    that arrives at an idle engine is not split (its first request waits for the rest)."""
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=50, clock=clock)
    for i in range(3):  # a lone client: each request waits the whole window
        scheduler.add(_request(f"solo{i}", at=clock.now))
        clock.now += 0.0499
        assert scheduler.schedule(timeout=0) == []
        clock.now += 0.0002
        _run(scheduler, scheduler.schedule(timeout=0))
        clock.now += 1.0
    scheduler.add(_request("a", at=clock.now))
    assert scheduler.schedule(timeout=0) == []  # no history says company is coming; the window does
    clock.now += 0.001
    for name in "bcd":
        scheduler.add(_request(name, at=clock.now))
    assert _ids(scheduler.schedule(timeout=0)) == ["a", "b", "c", "d"]


def test_without_admission_wait_a_partial_batch_starts_at_once():
    scheduler = _scheduler(max_num_seqs=4, wait_ms=0)
    scheduler.add(_request("a"))
    assert _ids(scheduler.schedule(timeout=0.5)) == ["a"]


def _busy(scheduler: BatchScheduler, clock: Clock, rounds: int = 4, gap: float = 0.002) -> None:
    """A busy stream in the arrival history: pairs ``gap`` apart at an idle engine (and nothing coming back after an
    answer)."""
    for i in range(rounds):
        scheduler.add(_request(f"warm{i}a", size=16, at=clock.now))
        clock.now += gap
        scheduler.add(_request(f"warm{i}b", size=16, at=clock.now))
        clock.now += 2 * gap + 1.0  # past its deadline: the pair starts, and the engine is idle again after it
        _run(scheduler, scheduler.schedule(timeout=0))
        clock.now += 1e6  # the next pair comes long after any window: not the answered clients coming back


def test_with_company_likely_a_lone_request_waits_until_the_next_is_no_longer_expected():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=300, clock=clock, request_batch_wait="adaptive")
    _busy(scheduler, clock, gap=0.002)
    scheduler.add(_request("a", at=clock.now))
    assert scheduler.schedule(timeout=0) == []
    clock.now += 0.003
    assert scheduler.schedule(timeout=0) == []  # within twice the longest gap at which company came
    clock.now += 0.0011
    assert _ids(scheduler.schedule(timeout=0)) == ["a"]  # 4 ms after it, long before the 300 ms bound


def test_the_window_bounds_the_wait_however_slowly_company_comes():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=50, clock=clock, request_batch_wait="adaptive")
    _busy(scheduler, clock, gap=0.040)  # company 40 ms apart: twice that is past the window
    scheduler.add(_request("a", at=clock.now))
    clock.now += 0.049
    assert scheduler.schedule(timeout=0) == []
    clock.now += 0.0011
    assert _ids(scheduler.schedule(timeout=0)) == ["a"]


def test_each_arrival_during_the_wait_extends_it_within_the_window():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=300, clock=clock, request_batch_wait="adaptive")
    _busy(scheduler, clock, gap=0.002)
    scheduler.add(_request("a", at=clock.now))
    clock.now += 0.003
    scheduler.add(_request("b", at=clock.now))  # 3 ms after a: the longest gap now, so the wait is 6 ms after b
    arrived = clock.now
    clock.now = arrived + 0.005  # past a's own 4 ms
    assert scheduler.schedule(timeout=0) == []
    clock.now = arrived + 0.0061
    assert _ids(scheduler.schedule(timeout=0)) == ["a", "b"]


def test_a_lone_client_never_waits():
    """One closed-loop client: each request arrives at an idle engine, so the window is never spent."""
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=20_000, clock=clock, request_batch_wait="adaptive")
    for i in range(6):
        scheduler.add(_request(f"r{i}", at=clock.now))
        batch = scheduler.schedule(timeout=0)
        assert _ids(batch) == [f"r{i}"]  # at once, on the clock it arrived
        clock.now += 0.010  # runs 10 ms, then the client sends the next one: arrivals 10 ms apart, never company
        _run(scheduler, batch)


def test_admission_wait_ends_as_soon_as_the_batch_is_full():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=3, wait_ms=20_000, clock=clock, request_batch_wait="adaptive")
    _busy(scheduler, clock, gap=0.5)
    scheduler.add(_request("a", at=clock.now))
    assert scheduler.schedule(timeout=0) == []
    clock.now += 0.1
    scheduler.add(_request("b", at=clock.now))
    scheduler.add(_request("other", size=64, at=clock.now))  # does not fill a's batch
    assert scheduler.schedule(timeout=0) == []
    scheduler.add(_request("c", at=clock.now))
    assert _ids(scheduler.schedule(timeout=0)) == ["a", "b", "c"]  # full: no more waiting


def test_clients_coming_back_are_waited_for_and_heal_a_split_batch():
    """Four closed-loop clients that started split (one request alone, three queued behind it): once the engine has
    seen answers come back, the three waiting when the lone one finishes wait for its client, and the batch is
    whole again."""
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=50, clock=clock, request_batch_wait="adaptive")
    for i in range(3):  # a lone client first: each answer comes back 5 ms after it (the engine learns the delay)
        scheduler.add(_request(f"solo{i}", at=clock.now))
        batch = scheduler.schedule(timeout=0)
        assert _ids(batch) == [f"solo{i}"]
        clock.now += 0.010
        _run(scheduler, batch)
        clock.now += 0.005
    scheduler.add(_request("a", at=clock.now))
    alone = scheduler.schedule(timeout=0)
    assert _ids(alone) == ["a"]  # nothing said company was coming
    for name in "bcd":
        scheduler.add(_request(name, at=clock.now))  # they queue behind it
    clock.now += 0.010
    _run(scheduler, alone)
    assert scheduler.schedule(timeout=0) == []  # a's client is expected back within 2 x 5 ms
    clock.now += 0.005
    scheduler.add(_request("a2", at=clock.now))
    assert _ids(scheduler.schedule(timeout=0)) == ["b", "c", "d", "a2"]


def _a(time: float, company: bool = True) -> Arrival:
    return Arrival(time, company)


@pytest.mark.parametrize(
    ("arrivals", "first", "window", "deadline"),
    [
        ([], 10.0, 0.05, 10.0),  # no history: nothing says company is coming
        ([_a(9.0, False), _a(10.0, False)], 10.0, 0.05, 10.0),  # arrivals at an idle engine only
        ([_a(9.9), _a(10.0)], 10.0, 0.05, 10.0),  # company, but 100 ms apart: not within the 50 ms window
        ([_a(9.0, False), _a(9.01), _a(10.0, False)], 10.0, 0.05, 10.02),  # one gap of two: wait 2 x 10 ms
        ([_a(8.0, False), _a(8.01), _a(9.0, False), _a(10.0, False)], 10.0, 0.05, 10.0),  # one of three: go
        ([_a(9.0, False), _a(9.04), _a(10.0, False)], 10.0, 0.05, 10.05),  # 2 x 40 ms: the window bounds it
        ([_a(9.0, False), _a(9.001), _a(10.0, False), _a(10.003)], 10.0, 0.05, 10.009),  # from the latest arrival
        ([_a(9.0, False), _a(9.01), _a(10.0, False)], 10.0, 0.0, 10.0),  # no window: never waits
    ],
)
def test_admission_deadline_of_a_stream(arrivals, first, window, deadline):
    assert admission_deadline(arrivals, first, window) == pytest.approx(deadline)


_F = Finish


def _r(time: float) -> Arrival:
    """An answer's client coming back: no other request in flight (the stream sign stays out of it)."""
    return Arrival(time, False)


@pytest.mark.parametrize(
    ("arrivals", "finishes", "first", "deadline"),
    [
        # Two batches of 2, each answered by 2 arrivals 3 and 5 ms later; the last batch's clients are not back yet.
        ([_r(1.003), _r(1.005), _r(2.003), _r(2.005)], [_F(1.0, 2), _F(2.0, 2), _F(3.0, 2)], 3.0, 3.01),
        # One of them is back (it is the batch's first request): the other is waited for.
        ([_r(1.003), _r(1.005), _r(2.003), _r(2.005), _r(3.003)], [_F(1.0, 2), _F(2.0, 2), _F(3.0, 2)], 3.003, 3.01),
        # Both are back: nothing more is expected.
        ([_r(1.003), _r(1.005), _r(2.003), _r(3.003), _r(3.004)], [_F(1.0, 2), _F(2.0, 1), _F(3.0, 2)], 3.004, 3.004),
        # All back, however busy the stream looked (company 1-2 ms apart): the closed loop decides, nobody is expected.
        (
            [_a(1.003), _a(1.005), _a(2.003), _a(2.005), _a(3.003), _a(3.004)],
            [_F(1.0, 2), _F(2.0, 2), _F(3.0, 2)],
            3.004,
            3.004,
        ),
        # Answers were not followed by arrivals within the window (an open stream): no wait.
        ([_r(1.3), _r(2.4), _r(2.9)], [_F(1.0, 1), _F(2.0, 1), _F(3.0, 1)], 3.0, 3.0),
        # Clients come back, but 40 ms later: twice that is past the window, which bounds it.
        ([_r(1.04), _r(2.04)], [_F(1.0, 1), _F(2.0, 1), _F(3.0, 1)], 3.0, 3.05),
    ],
)
def test_admission_deadline_of_returning_clients(arrivals, finishes, first, deadline):
    assert admission_deadline(arrivals, first, 0.05, finishes) == pytest.approx(deadline)


def test_no_admission_wait_for_requests_that_queued_behind_a_running_batch():
    scheduler = _scheduler(max_num_seqs=4, wait_ms=20_000)
    for name in "abcd":
        scheduler.add(_request(name))
    running = scheduler.schedule(timeout=1)
    scheduler.add(_request("e"))  # arrives while the batch runs
    _run(scheduler, running)
    started = time.monotonic()
    assert _ids(scheduler.schedule(timeout=30)) == ["e"]
    assert time.monotonic() - started < 10


def test_abort_of_a_waiting_request_fails_it_at_once():
    scheduler = _scheduler()
    request = _request("a")
    scheduler.add(request)
    assert scheduler.abort("a") is True
    with pytest.raises(RequestAbortedError):
        request.future.result(timeout=1)
    assert scheduler.num_waiting == 0
    assert scheduler.abort("a") is False


def test_abort_of_a_running_request_drops_its_result_only():
    scheduler = _scheduler()
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule(timeout=1)
    assert scheduler.num_running == 2
    assert scheduler.abort("a") is True
    _run(scheduler, batch)
    with pytest.raises(RequestAbortedError):
        a.future.result(timeout=1)
    assert b.future.result(timeout=1).request_id == "b"
    assert scheduler.num_running == 0


def test_a_request_cancelled_by_its_caller_is_never_scheduled():
    scheduler = _scheduler()
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    assert a.future.cancel()
    assert _ids(scheduler.schedule(timeout=1)) == ["b"]


def test_errors_fail_only_their_own_request():
    scheduler = _scheduler()
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule(timeout=1)
    scheduler.finish(batch, [ValueError("bad prompt"), OmniRequestOutput("b", b.prompt)])
    with pytest.raises(RequestFailedError, match="request a failed: ValueError: bad prompt"):
        a.future.result(timeout=1)
    assert b.future.result(timeout=1).request_id == "b"


def test_close_fails_waiting_requests_and_unblocks_schedule():
    clock = Clock()
    scheduler = _scheduler(wait_ms=20_000, clock=clock)
    _busy(scheduler, clock, gap=5.0)
    request = _request("a", at=clock.now)  # held by the admission wait (the test's clock stands still)
    scheduler.add(request)
    threading.Timer(0.1, scheduler.close, args=("shutting down",)).start()
    assert scheduler.schedule() == []
    with pytest.raises(RequestFailedError, match="shutting down"):
        request.future.result(timeout=1)
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.add(_request("b"))


# LoRA: a batch holds at most max_loras distinct adapters.


def _lora_scheduler(max_loras=1, max_num_seqs=4, wait_ms=0.0, clock=time.monotonic, **knobs) -> BatchScheduler:
    return _scheduler(
        max_num_seqs=max_num_seqs, wait_ms=wait_ms, clock=clock, enable_lora=True, max_loras=max_loras, **knobs
    )


def _with(name: str, *adapters: str, **params) -> DiffusionRequest:
    """A request applying ``adapters`` (as admitted: each with its path)."""
    return _request(name, lora=[{"name": a, "path": f"/loras/{a}"} for a in adapters], **params)


def test_a_batch_holds_at_most_max_loras_adapters_and_the_rest_wait_their_turn():
    scheduler = _lora_scheduler(max_loras=1)
    for request in (_with("a1", "a"), _with("b1", "b"), _with("a2", "a")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["a1", "a2"]  # b1 has the same key but a second adapter
    assert scheduler.adapters_in_use() == {"a"}
    _run(scheduler, first)
    assert scheduler.adapters_in_use() == set()
    assert _ids(scheduler.schedule(timeout=0)) == ["b1"]


def test_a_request_left_out_for_its_adapter_is_not_overtaken_by_later_arrivals():
    scheduler = _lora_scheduler(max_loras=1)
    for request in (_with("a1", "a"), _with("b1", "b"), _with("a2", "a")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    scheduler.add(_with("a3", "a"))  # arrives while a's batch runs
    _run(scheduler, first)
    second = scheduler.schedule(timeout=0)
    assert _ids(second) == ["b1"]  # the oldest waiting request leads the next batch
    _run(scheduler, second)
    assert _ids(scheduler.schedule(timeout=0)) == ["a3"]


def test_max_loras_counts_stacked_adapters():
    scheduler = _lora_scheduler(max_loras=2)
    for request in (_with("ab", "a", "b"), _with("c", "c"), _with("a", "a"), _with("b", "b")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["ab", "a", "b"]
    assert scheduler.adapters_in_use() == {"a", "b"}
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["c"]


def test_base_requests_join_any_batch():
    scheduler = _lora_scheduler(max_loras=1)
    for request in (_with("a1", "a"), _request("base1"), _with("b1", "b"), _request("base2")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["a1", "base1", "base2"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["b1"]


def test_a_base_request_at_the_head_batches_with_the_first_adapter():
    scheduler = _lora_scheduler(max_loras=1)
    for request in (_request("base"), _with("b1", "b"), _with("c1", "c"), _with("b2", "b")):
        scheduler.add(request)
    assert _ids(scheduler.schedule(timeout=0)) == ["base", "b1", "b2"]


def test_capacity_still_bounds_a_batch_with_adapters():
    scheduler = _lora_scheduler(max_loras=1, max_num_seqs=2)
    for request in (_with("a1", "a"), _with("b1", "b"), _with("a2", "a"), _with("a3", "a")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["a1", "a2"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["b1"]  # the oldest waiting request goes next


def test_a_batch_that_left_a_request_out_for_its_adapter_does_not_wait():
    """Waiting for more requests cannot help a batch that could not take one it had: it starts at once."""
    scheduler = _lora_scheduler(max_loras=1, wait_ms=600_000)
    for request in (_with("a1", "a"), _with("b1", "b"), _with("a2", "a")):
        scheduler.add(request)
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["a1", "a2"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["b1"]  # it queued behind a running batch: no wait either


def test_without_a_request_left_out_the_admission_wait_still_holds():
    clock = Clock()
    scheduler = _lora_scheduler(max_loras=1, wait_ms=600_000, clock=clock, request_batch_wait="adaptive")
    _busy(scheduler, clock, gap=0.5)
    scheduler.add(_with("a1", "a", at=clock.now))
    scheduler.add(_with("a2", "a", at=clock.now))
    scheduler.add(_with("big", "b", size=64, at=clock.now))  # another key: not left out for its adapter
    assert scheduler.schedule(timeout=0) == []


def test_without_lora_enabled_any_number_of_requests_without_adapters_batch():
    scheduler = _scheduler(max_num_seqs=8)
    for i in range(8):
        scheduler.add(_request(f"r{i}"))
    assert len(scheduler.schedule(timeout=0)) == 8


# Engine calls: run on the engine's thread between batches.


def test_a_call_runs_in_run_calls_and_its_result_lands_in_the_future():
    scheduler = _scheduler()
    ran = []
    future = scheduler.call(lambda: ran.append("x") or 42)
    assert not future.done() and ran == []  # nothing runs it but the engine's thread
    scheduler.run_calls()
    assert future.result(timeout=0) == 42 and ran == ["x"]
    scheduler.run_calls()  # each call runs once
    assert ran == ["x"]


def test_a_failing_call_fails_its_future_only():
    scheduler = _scheduler()

    def fail():
        raise ValueError("bad adapter file")

    failing, fine = scheduler.call(fail), scheduler.call(lambda: "ok")
    scheduler.run_calls()
    assert isinstance(failing.exception(timeout=0), ValueError)
    assert str(failing.exception(timeout=0)) == "bad adapter file"
    assert fine.result(timeout=0) == "ok"


def test_a_cancelled_call_does_not_run():
    scheduler = _scheduler()
    ran = []
    future = scheduler.call(lambda: ran.append("x"))
    assert future.cancel()
    scheduler.run_calls()
    assert ran == []


def test_a_pending_call_comes_before_a_due_batch():
    scheduler = _scheduler()
    scheduler.add(_request("a"))
    future = scheduler.call(lambda: "loaded")
    assert scheduler.schedule() == []  # no timeout: returns because a call is pending
    scheduler.run_calls()
    assert future.result(timeout=0) == "loaded"
    assert _ids(scheduler.schedule(timeout=0)) == ["a"]


def test_a_call_wakes_an_idle_schedule():
    clock = Clock()
    scheduler = _scheduler(wait_ms=600_000, clock=clock)
    _busy(scheduler, clock, gap=300.0)
    scheduler.add(_request("a", at=clock.now))  # not due for ten minutes
    result = []
    waiter = threading.Thread(target=lambda: result.append(scheduler.schedule()))
    waiter.start()
    future = scheduler.call(lambda: "loaded")
    waiter.join(timeout=60)
    assert not waiter.is_alive() and result == [[]]
    scheduler.run_calls()
    assert future.result(timeout=0) == "loaded"
    assert scheduler.num_waiting == 1


def test_while_paused_no_request_starts_but_calls_run_and_resume_starts_the_waiting_ones():
    """Sleep: requests that arrive wait (not refused, not lost), the wake-up call still runs, and once resumed they
    start at once (they have waited already), however long the admission wait."""
    scheduler = _scheduler(wait_ms=600_000)
    scheduler.pause(True)
    scheduler.add(_request("a"))
    assert scheduler.schedule(timeout=0) == [] and scheduler.num_waiting == 1
    assert scheduler.state("a")[0] == "waiting"
    future = scheduler.call(lambda: scheduler.pause(False) or "awake", drain=True)
    assert scheduler.schedule() == []  # no timeout: returns for the call
    scheduler.run_calls()
    assert future.result(timeout=0) == "awake" and not scheduler.paused
    assert _ids(scheduler.schedule(timeout=0)) == ["a"]


def test_resume_wakes_an_idle_schedule():
    scheduler = _scheduler()
    scheduler.pause(True)
    scheduler.add(_request("a"))
    batches = []
    waiter = threading.Thread(target=lambda: batches.append(scheduler.schedule()))
    waiter.start()
    scheduler.pause(False)
    waiter.join(timeout=60)
    assert not waiter.is_alive() and [_ids(batch) for batch in batches] == [["a"]]


def test_close_fails_pending_calls_and_refuses_new_ones():
    scheduler = _scheduler()
    ran = []
    future = scheduler.call(lambda: ran.append("x"))
    scheduler.close("shutting down")
    with pytest.raises(RuntimeError, match="shutting down"):
        future.result(timeout=0)
    scheduler.run_calls()
    assert ran == []
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.call(lambda: None)


def test_the_pixel_budget_makes_batches_smaller_than_max_num_seqs():
    scheduler = _scheduler(max_num_seqs=4, max_batch_pixels=2 * 64 * 64)
    for i in range(4):
        scheduler.add(_request(f"big{i}", size=64))
    for i in range(4):
        scheduler.add(_request(f"small{i}", size=32))
    sizes = []
    while batch := scheduler.schedule(timeout=0):
        sizes.append(_ids(batch))
        _run(scheduler, batch)
    # Two 64x64 fill the budget; four 32x32 are within it, so max_num_seqs bounds them.
    assert sizes == [["big0", "big1"], ["big2", "big3"], ["small0", "small1", "small2", "small3"]]


def test_a_request_larger_than_the_budget_runs_alone_and_n_counts():
    scheduler = _scheduler(max_num_seqs=4, max_batch_pixels=64 * 64)
    for i in range(2):
        scheduler.add(_request(f"n2-{i}", size=64, num_outputs_per_prompt=2))  # 2 × 64 × 64: over the budget
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["n2-0"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["n2-1"]


def test_a_batch_that_spent_the_budget_starts_without_the_admission_wait():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=4, wait_ms=3_600_000, max_batch_pixels=2 * 32 * 32, clock=clock)
    _busy(scheduler, clock, gap=600.0)
    scheduler.add(_request("a", at=clock.now))
    assert scheduler.schedule(timeout=0) == []  # room left: the admission wait holds it
    scheduler.add(_request("b", at=clock.now))
    assert _ids(scheduler.schedule(timeout=0)) == ["a", "b"]  # the budget is spent: waiting cannot fill it more


# Priority (scheduling_policy: priority): the waiting queue by (priority, arrival); a running batch runs on.


def test_by_priority_the_best_waiting_requests_batch_first_in_arrival_order_among_equals():
    scheduler = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    for name, priority in (("low1", 5), ("low2", 5), ("high", -1), ("default", 0)):
        scheduler.add(_request(name, priority=priority))
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["high", "default"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["low1", "low2"]


def test_by_priority_a_batch_forms_from_the_best_requests_key():
    scheduler = _scheduler(max_num_seqs=4, scheduling_policy="priority")
    scheduler.add(_request("old", priority=1))
    scheduler.add(_request("big", size=64, priority=0))
    scheduler.add(_request("big2", size=64, priority=2))  # worse than old, but of the best request's key
    first = scheduler.schedule(timeout=0)
    assert _ids(first) == ["big", "big2"]
    _run(scheduler, first)
    assert _ids(scheduler.schedule(timeout=0)) == ["old"]


def test_by_priority_a_running_batch_is_not_interrupted_and_a_better_arrival_goes_next():
    scheduler = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    for name in ("a", "b", "c"):
        scheduler.add(_request(name, priority=3))
    running = scheduler.schedule(timeout=0)
    scheduler.add(_request("urgent", priority=-5))
    assert scheduler.state("a")[0] == "running" and scheduler.state("urgent")[0] == "waiting"
    _run(scheduler, running)
    assert _ids(running) == ["a", "b"]
    assert _ids(scheduler.schedule(timeout=0)) == ["urgent", "c"]


def test_fcfs_keeps_arrival_order_whatever_the_priorities():
    scheduler = _scheduler(max_num_seqs=1)  # the engine's own order; the API refuses priorities under fcfs
    for name, priority in (("first", 5), ("second", -5)):
        scheduler.add(_request(name, priority=priority))
    assert _ids(scheduler.schedule(timeout=0)) == ["first"]
