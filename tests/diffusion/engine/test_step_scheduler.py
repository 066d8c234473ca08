"""Step-mode policy: admission at step boundaries, encode look-ahead, bucket fairness, abort frees a slot, LoRA
adapters in use, engine calls; under the priority policy, preemption and its kept-state limit. Every test drives the
scheduler by its events (plan, prepared, retire, complete), never by time."""

import threading
import time

import pytest
import torch

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import StepBatchScheduler
from vllm_omni.errors import RequestAbortedError, RequestFailedError, StageUnavailableError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def _nbytes(state) -> int:
    """What a test's state keeps: a tensor its bytes, a string (a state that stands for one) nothing."""
    return state.nbytes if isinstance(state, torch.Tensor) else 0


def _scheduler(max_num_seqs=2, wait_ms=0.0, clock=time.monotonic, **knobs) -> StepBatchScheduler:
    return StepBatchScheduler(
        OmniDiffusionConfig.from_stage(
            "unused",
            StageDeployConfig(
                max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms, execution_mode="step", **knobs
            ),
        ),
        clock,
        measure=_nbytes,
    )


class Clock:
    """The scheduler's clock, moved by the test: the admission wait is decided without real time passing."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _request(name: str, key="64x64", adapters=(), at: float | None = None) -> DiffusionRequest:
    """A request; ``at``: its arrival on the test's clock (else now, on the real one)."""
    lora = [{"name": a, "path": f"/loras/{a}"} for a in adapters]  # as admitted: each with its path
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4, lora=lora)
    request = DiffusionRequest.create(name, f"prompt {name}", params, key=key)
    if at is not None:
        request.arrival_time = at
    return request


def _ids(requests):
    return [r.request_id for r in requests]


def _encode(scheduler: StepBatchScheduler, plan) -> None:
    """What the encode worker does for each request the plan hands it."""
    for request in plan.to_prepare:
        assert scheduler.prepared(request, state=f"state of {request.request_id}")


def test_requests_join_at_the_next_boundary_up_to_max_num_seqs():
    scheduler = _scheduler(max_num_seqs=2)
    a = _request("a")
    scheduler.add(a)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a"] and plan.batch == []  # not encoded yet: it cannot run
    _encode(scheduler, plan)
    assert _ids(scheduler.plan(timeout=0).batch) == ["a"]
    for name in "bcd":
        scheduler.add(_request(name))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["b", "c"]  # encode look-ahead: max_num_seqs waiting requests
    assert _ids(plan.batch) == ["a"]
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a", "b"]  # a is still running: one slot was free
    assert _ids(plan.to_prepare) == ["d"]  # c is encoded and waiting, so one more may be encoded
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2


def test_a_request_that_leaves_frees_its_slot_for_the_next_boundary():
    scheduler = _scheduler(max_num_seqs=2)
    requests = [_request(name) for name in "abc"]
    for request in requests:
        scheduler.add(request)
    _encode(scheduler, scheduler.plan(timeout=0))
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["a", "b"]
    scheduler.retire([requests[0]])  # a finished denoising: it is decoded beside the loop
    assert _ids(scheduler.plan(timeout=0).batch) == ["b", "c"]
    assert scheduler.state("a") == ("running", requests[0])  # until its decode completes
    scheduler.complete(requests[0], OmniRequestOutput("a", "prompt a"))
    assert requests[0].future.result(timeout=0).request_id == "a"
    assert scheduler.state("a") is None


def test_another_bucket_drains_the_running_one_so_its_wait_is_bounded():
    """A 32x32 request arrives while 64x64 requests run: later 64x64 requests do not overtake it."""
    scheduler = _scheduler(max_num_seqs=3)
    a, odd, b = _request("a"), _request("odd", key="32x32"), _request("b")
    scheduler.add(a)
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["a"]
    scheduler.add(odd)
    scheduler.add(b)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a"]  # b has a free slot and the same key, but odd is older
    scheduler.retire([a])
    assert _ids(scheduler.plan(timeout=0).batch) == ["odd"]  # the drained bucket switches at once
    scheduler.retire([odd])
    assert _ids(scheduler.plan(timeout=0).batch) == ["b"]


def test_abort_of_a_running_request_frees_its_slot_at_the_next_boundary():
    scheduler = _scheduler(max_num_seqs=1)
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a"] and _ids(plan.to_prepare) == ["b"]
    _encode(scheduler, plan)
    assert scheduler.abort("a")
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.dropped) == ["a"] and _ids(plan.batch) == ["b"]  # the same boundary reuses the slot
    scheduler.complete(a, RequestAbortedError("a"))
    with pytest.raises(RequestAbortedError):
        a.future.result(timeout=0)


def test_abort_while_waiting_or_encoding_fails_at_once_and_drops_the_encoding():
    scheduler = _scheduler()
    a = _request("a")
    scheduler.add(a)
    plan = scheduler.plan(timeout=0)
    assert scheduler.abort("a")
    with pytest.raises(RequestAbortedError):
        a.future.result(timeout=0)
    assert not scheduler.prepared(plan.to_prepare[0], state="late")  # the encode worker's result is dropped
    assert a.state is None


def test_a_failed_encoding_fails_only_its_request():
    scheduler = _scheduler()
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.plan(timeout=0)
    scheduler.fail_waiting(a, RuntimeError("tokenizer exploded"))
    scheduler.prepared(b, state="ok")
    with pytest.raises(RequestFailedError, match="RuntimeError: tokenizer exploded"):
        a.future.result(timeout=0)
    assert _ids(scheduler.plan(timeout=0).batch) == ["b"]
    assert _ids(plan.to_prepare) == ["a", "b"]


def test_close_fails_waiting_requests_but_running_ones_finish():
    scheduler = _scheduler(max_num_seqs=1)
    a, b = _request("a"), _request("b")
    scheduler.add(a)
    scheduler.add(b)
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["a"]
    scheduler.close("shutting down")
    with pytest.raises(RequestFailedError, match="shutting down"):
        b.future.result(timeout=0)
    assert _ids(scheduler.plan(timeout=0).batch) == ["a"] and scheduler.has_unfinished
    scheduler.close("the loop died", include_running=True)
    with pytest.raises(RequestFailedError, match="the loop died"):
        a.future.result(timeout=0)


# LoRA: the requests running and being encoded use at most max_loras distinct adapters.


def _lora_scheduler(max_loras=1, max_num_seqs=4) -> StepBatchScheduler:
    return _scheduler(max_num_seqs=max_num_seqs, lora_modules=["a=/loras/a", "b=/loras/b"], max_loras=max_loras)


def test_a_request_with_another_adapter_is_prepared_once_the_slot_is_free():
    scheduler = _lora_scheduler(max_loras=1)
    a1, b1, a2 = _request("a1", adapters=("a",)), _request("b1", adapters=("b",)), _request("a2", adapters=("a",))
    for request in (a1, b1, a2):
        scheduler.add(request)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a1"]  # b1 needs a second adapter; a2 does not overtake it
    assert scheduler.adapters_in_use() == {"a"}  # being encoded counts
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a1"] and plan.to_prepare == []
    assert _ids(scheduler.plan(timeout=0).to_prepare) == []  # still not while a1 denoises
    scheduler.retire([a1])  # its denoising is done: the decode applies no adapter
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["b1"] and plan.batch == []
    assert scheduler.adapters_in_use() == {"b"}
    scheduler.complete(a1, OmniRequestOutput("a1", a1.prompt))
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["b1"] and plan.to_prepare == []  # a2 waits for b1 in turn
    scheduler.retire([b1])
    scheduler.complete(b1, OmniRequestOutput("b1", b1.prompt))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a2"]
    _encode(scheduler, plan)
    assert _ids(scheduler.plan(timeout=0).batch) == ["a2"]


def test_requests_with_the_adapter_in_use_and_base_requests_are_prepared_beside_it():
    scheduler = _lora_scheduler(max_loras=1)
    for request in (_request("a1", adapters=("a",)), _request("base"), _request("a2", adapters=("a",))):
        scheduler.add(request)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a1", "base", "a2"]
    _encode(scheduler, plan)
    assert _ids(scheduler.plan(timeout=0).batch) == ["a1", "base", "a2"]


def test_a_base_request_runs_beside_a_running_adapter_and_later_ones_wait_behind_a_blocked_one():
    scheduler = _lora_scheduler(max_loras=1)
    a1 = _request("a1", adapters=("a",))
    scheduler.add(a1)
    _encode(scheduler, scheduler.plan(timeout=0))
    for request in (_request("base1"), _request("b1", adapters=("b",)), _request("base2")):
        scheduler.add(request)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a1"]
    assert _ids(plan.to_prepare) == ["base1"]  # oldest first: base2 waits behind b1
    _encode(scheduler, plan)
    assert _ids(scheduler.plan(timeout=0).batch) == ["a1", "base1"]


def test_max_loras_counts_stacked_adapters_in_step_mode():
    scheduler = _lora_scheduler(max_loras=2)
    ab, c, a = _request("ab", adapters=("a", "b")), _request("c", adapters=("c",)), _request("a", adapters=("a",))
    for request in (ab, c, a):
        scheduler.add(request)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["ab"]
    assert scheduler.adapters_in_use() == {"a", "b"}


def test_an_aborted_request_frees_its_adapter_slot():
    scheduler = _lora_scheduler(max_loras=1)
    a1, b1 = _request("a1", adapters=("a",)), _request("b1", adapters=("b",))
    scheduler.add(a1)
    scheduler.add(b1)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a1"]
    assert scheduler.abort("a1")  # while it is encoded
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["b1"]


# Engine calls: they run between steps.


def test_a_pending_call_makes_plan_return_at_once():
    scheduler = _scheduler()
    future = scheduler.call(lambda: "loaded")
    plan = scheduler.plan()  # no timeout, nothing to do but the call: returns
    assert (plan.to_prepare, plan.batch, plan.dropped) == ([], [], [])
    scheduler.run_calls()
    assert future.result(timeout=0) == "loaded"


def test_a_call_wakes_an_idle_plan():
    scheduler = _scheduler()
    plans = []
    waiter = threading.Thread(target=lambda: plans.append(scheduler.plan()))
    waiter.start()
    future = scheduler.call(lambda: 1 / 0)
    waiter.join(timeout=60)
    assert not waiter.is_alive() and len(plans) == 1
    scheduler.run_calls()
    assert isinstance(future.exception(timeout=0), ZeroDivisionError)


def test_a_pending_call_does_not_hold_back_the_plan():
    scheduler = _scheduler()
    scheduler.add(_request("a"))
    scheduler.call(lambda: None)
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["a"]


def test_a_draining_call_runs_once_the_running_requests_finish_and_none_starts_before_it():
    scheduler = _scheduler(max_num_seqs=2)
    a = _request("a")
    scheduler.add(a)
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["a"]
    ran = []
    future = scheduler.call(lambda: ran.append("weights") or "swapped", drain=True)
    b = _request("b")
    scheduler.add(b)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a"] and plan.to_prepare == []  # b is neither encoded nor admitted
    scheduler.run_calls()
    assert ran == []  # a is still running
    scheduler.retire([a])
    scheduler.run_calls()
    assert ran == []  # a is still being decoded
    scheduler.complete(a, OmniRequestOutput(request_id="a", prompt="prompt a"))
    assert scheduler.plan(timeout=0).batch == []  # the call is due: plan returns for it
    scheduler.run_calls()
    assert future.result(timeout=0) == "swapped"
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["b"]


def test_while_paused_no_request_is_encoded_or_admitted_and_resume_starts_them():
    scheduler = _scheduler(max_num_seqs=2)
    a = _request("a")
    scheduler.add(a)
    plan = scheduler.plan(timeout=0)
    scheduler.pause(True)
    _encode(scheduler, plan)  # encoded before the sleep: it waits, encoded
    scheduler.add(_request("b"))
    plan = scheduler.plan(timeout=0)
    assert (plan.batch, plan.to_prepare) == ([], []) and scheduler.num_waiting == 2
    scheduler.pause(False)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a"] and _ids(plan.to_prepare) == ["b"]


def test_a_draining_call_waits_for_a_request_on_the_encode_worker():
    """With an encode worker (CUDA), a request being encoded is in progress: weights must not move under it."""
    scheduler = _scheduler()
    a = _request("a")
    scheduler.add(a)
    plan = scheduler.plan(timeout=0)  # handed to the encode worker
    ran = []
    future = scheduler.call(lambda: ran.append("sleep"), drain=True)
    scheduler.run_calls()
    assert ran == [] and not future.done()
    _encode(scheduler, plan)
    scheduler.run_calls()
    assert ran == ["sleep"]


def test_close_fails_pending_step_calls():
    scheduler = _scheduler()
    future = scheduler.call(lambda: "never")
    scheduler.close("the engine stopped")
    with pytest.raises(RuntimeError, match="the engine stopped"):
        future.result(timeout=0)


def test_the_pixel_budget_bounds_the_running_batch_and_the_next_joins_when_one_leaves():
    scheduler = _scheduler(max_num_seqs=4, max_batch_pixels=2 * 64 * 64)
    requests = [_request(name) for name in "abc"]
    for request in requests:
        scheduler.add(request)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a", "b"]  # c is encoded, but a third 64x64 would pass the budget
    scheduler.retire([requests[0]])
    assert _ids(scheduler.plan(timeout=0).batch) == ["b", "c"]


# Priority (scheduling_policy: priority): who is encoded, joins and leaves next.


def _prioritized(name: str, priority: int, key="64x64", n=1) -> DiffusionRequest:
    params = OmniDiffusionSamplingParams(
        height=64, width=64, num_inference_steps=4, priority=priority, num_outputs_per_prompt=n
    )
    return DiffusionRequest.create(name, f"prompt {name}", params, key=key)


def _boundary(scheduler: StepBatchScheduler):
    """One step boundary, whose encodes are done at once (the CPU's step engine encodes on its loop)."""
    plan = scheduler.plan(timeout=0)
    _encode(scheduler, plan)
    return plan


def _running(scheduler: StepBatchScheduler, *requests: DiffusionRequest) -> list[str]:
    """Queue ``requests``; the batch the second boundary after steps (the first encodes them)."""
    for request in requests:
        scheduler.add(request)
    _boundary(scheduler)
    return _ids(_boundary(scheduler).batch)


def test_a_better_request_preempts_the_worst_running_one_which_rejoins_with_its_state_when_there_is_room():
    scheduler = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    x, y, urgent = _prioritized("x", 5), _prioritized("y", 5), _prioritized("urgent", 0)
    assert _running(scheduler, x, y) == ["x", "y"]
    scheduler.add(urgent)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["urgent"] and plan.preempted == []  # it preempts once encoded
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.preempted) == ["y"]  # of the worst priority, the latest arrival
    assert _ids(plan.batch) == ["x", "urgent"]
    assert y.preempted and y.state == "state of y" and scheduler.state("y") == ("waiting", y)
    assert not y.future.done() and scheduler.has_unfinished
    assert _ids(scheduler.plan(timeout=0).batch) == ["x", "urgent"]  # no room yet
    scheduler.retire([urgent])
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["x", "y"] and plan.preempted == []
    assert not y.preempted and y.state == "state of y"  # the same state: it goes on from the step it left


def test_a_preempted_request_rejoins_best_first_among_the_waiting_ones():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low, mid = _prioritized("low", 5), _prioritized("mid", 3)
    assert _running(scheduler, low) == ["low"]
    assert _running(scheduler, mid) == ["mid"]
    assert low.preempted
    later_low, later_mid = _prioritized("later_low", 5), _prioritized("later_mid", 3)
    assert _running(scheduler, later_low, later_mid) == ["mid"]
    order = []
    for _ in range(3):
        [running] = _boundary(scheduler).batch
        scheduler.retire([running])
        order.append(_ids(_boundary(scheduler).batch))
    # later_mid before low (priority), low before later_low (arrival: it came first)
    assert order == [["later_mid"], ["low"], ["later_low"]]


def test_a_request_is_preempted_each_time_a_better_one_comes():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low = _prioritized("low", 5)
    assert _running(scheduler, low) == ["low"]
    for round_ in range(3):
        urgent = _prioritized(f"urgent{round_}", 0)
        scheduler.add(urgent)
        _encode(scheduler, scheduler.plan(timeout=0))
        plan = scheduler.plan(timeout=0)
        assert _ids(plan.preempted) == ["low"] and _ids(plan.batch) == [urgent.request_id]
        scheduler.retire([urgent])
        assert _ids(scheduler.plan(timeout=0).batch) == ["low"]


@pytest.mark.parametrize(("policy", "priority"), [("fcfs", 0), ("priority", 5)])
def test_fcfs_and_equal_priorities_never_preempt(policy, priority):
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy=policy)
    assert _running(scheduler, _prioritized("first", 5 if policy == "priority" else 0)) == ["first"]
    second = _prioritized("second", priority)
    scheduler.add(second)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["first"] and plan.preempted == [] and scheduler.kept_bytes == 0


def test_another_key_preempts_the_whole_batch_only_when_all_of_it_is_worse():
    scheduler = _scheduler(max_num_seqs=3, scheduling_policy="priority")
    a, b = _prioritized("a", 5), _prioritized("b", 1)
    assert _running(scheduler, a, b) == ["b", "a"]  # best first
    other = _prioritized("other", 1, key="32x32")  # not better than b: it waits for the key to drain
    assert _running(scheduler, other) == ["b", "a"]
    better = _prioritized("better", 0, key="32x32")
    plan_batch = _running(scheduler, better)
    assert plan_batch == ["better", "other"]  # both running ones were worse than better; other then joins its key
    assert a.preempted and b.preempted
    scheduler.retire([scheduler.plan(timeout=0).batch[0]])
    scheduler.retire([other])
    assert _ids(scheduler.plan(timeout=0).batch) == ["b", "a"]  # back best first


def test_the_pixel_budget_preempts_as_many_as_a_larger_request_needs():
    scheduler = _scheduler(max_num_seqs=4, max_batch_pixels=2 * 64 * 64, scheduling_policy="priority")
    a, b = _prioritized("a", 5), _prioritized("b", 4)
    assert _running(scheduler, a, b) == ["b", "a"]
    one = _prioritized("one", 0)  # one 64x64 output: one of them leaves, the worse
    scheduler.add(one)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.preempted) == ["a"] and _ids(plan.batch) == ["b", "one"]
    two = _prioritized("two", -1, n=2)  # two outputs: the whole budget
    scheduler.add(two)
    _encode(scheduler, scheduler.plan(timeout=0))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.preempted) == ["b", "one"] and _ids(plan.batch) == ["two"]


def test_the_kept_state_limit_holds_preemption_back_and_refuses_the_worst_new_requests():
    """Each state is 768 KiB against a 1 MiB limit: one preempted request fits, a second does not."""
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority", max_preempted_state_mb=1)
    state = {}

    def encode(plan):
        for request in plan.to_prepare:
            state[request.request_id] = torch.zeros(3 * 2**16)  # 768 KiB of float32
            assert scheduler.prepared(request, state[request.request_id])

    def run(*requests):
        for request in requests:
            scheduler.add(request)
        encode(scheduler.plan(timeout=0))
        return scheduler.plan(timeout=0)

    low, mid, urgent = _prioritized("low", 5), _prioritized("mid", 3), _prioritized("urgent", 0)
    run(low)
    plan = run(mid)
    assert _ids(plan.preempted) == ["low"] and scheduler.kept_bytes == 768 * 1024 == low.kept_bytes
    plan = run(urgent)
    assert plan.preempted == [] and _ids(plan.batch) == ["mid"]  # mid's state would pass the limit: it runs on
    late = _prioritized("late", 5)  # behind every waiting request (low came first)
    scheduler.add(late)
    error = late.future.exception(timeout=0)
    assert isinstance(error, StageUnavailableError)
    assert "max_preempted_state_mb (1 MiB)" in str(error) and error.request_id == "late"
    better = _prioritized("better", 4)  # ahead of low: taken
    scheduler.add(better)
    assert not better.future.done()
    scheduler.retire([mid])  # a slot frees: urgent joins without preempting, nothing is held back
    encode(scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["urgent"]
    late_again = _prioritized("late_again", 5)
    scheduler.add(late_again)
    assert not late_again.future.done()
    finished = []
    for _ in range(4):  # none of the admitted requests was dropped: each runs in its turn
        [running] = scheduler.plan(timeout=0).batch
        finished.append(running.request_id)
        scheduler.retire([running])
        encode(scheduler.plan(timeout=0))
    assert finished == ["urgent", "better", "low", "late_again"]
    assert scheduler.kept_bytes == 0 and not low.future.done()  # low is decoding


def test_an_abort_of_a_preempted_request_fails_it_at_once_and_frees_its_state():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low, urgent = _prioritized("low", 5), _prioritized("urgent", 0)
    scheduler.add(low)
    plan = scheduler.plan(timeout=0)
    assert scheduler.prepared(low, torch.zeros(1024))
    assert _ids(scheduler.plan(timeout=0).batch) == ["low"]
    assert _running(scheduler, urgent) == ["urgent"]
    assert low.preempted and scheduler.kept_bytes == 4096
    assert scheduler.abort("low")
    with pytest.raises(RequestAbortedError):
        low.future.result(timeout=0)
    assert low.state is None and not low.preempted and scheduler.kept_bytes == 0
    assert scheduler.state("low") is None and _ids(plan.to_prepare) == ["low"]
    scheduler.retire([urgent])
    scheduler.complete(urgent, OmniRequestOutput("urgent", urgent.prompt))
    assert scheduler.plan(timeout=0).batch == [] and not scheduler.has_unfinished


def test_a_draining_call_waits_for_a_preempted_request_which_rejoins_meanwhile():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low, urgent = _prioritized("low", 5), _prioritized("urgent", 0)
    assert _running(scheduler, low) == ["low"]
    assert _running(scheduler, urgent) == ["urgent"]
    ran = []
    future = scheduler.call(lambda: ran.append("new weights"), drain=True)
    newcomer = _prioritized("newcomer", 0)
    scheduler.add(newcomer)
    scheduler.retire([urgent])
    scheduler.complete(urgent, OmniRequestOutput("urgent", urgent.prompt))
    scheduler.run_calls()
    assert ran == []  # low started on the weights in place: it finishes on them
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["low"] and plan.to_prepare == []  # low rejoins; the newcomer waits for the call
    scheduler.retire([low])
    scheduler.complete(low, OmniRequestOutput("low", low.prompt))
    scheduler.run_calls()
    assert ran == ["new weights"] and future.result(timeout=0) is None
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["newcomer"]


def test_close_fails_the_waiting_requests_but_a_preempted_one_finishes():
    scheduler = _scheduler(max_num_seqs=1, scheduling_policy="priority")
    low, urgent, waiting = _prioritized("low", 5), _prioritized("urgent", 0), _prioritized("waiting", 7)
    assert _running(scheduler, low) == ["low"]
    assert _running(scheduler, urgent) == ["urgent"]
    scheduler.add(waiting)
    scheduler.close("shutting down")
    with pytest.raises(RequestFailedError, match="shutting down"):
        waiting.future.result(timeout=0)
    assert not low.future.done() and scheduler.has_unfinished
    scheduler.retire([urgent])
    assert _ids(scheduler.plan(timeout=0).batch) == ["low"]


def test_a_better_request_is_encoded_past_the_look_ahead_so_that_it_can_preempt():
    for policy, encoded in (("fcfs", []), ("priority", ["urgent"])):
        scheduler = _scheduler(max_num_seqs=1, scheduling_policy=policy)
        first, second = _prioritized("first", 0), _prioritized("second", 0)
        assert _running(scheduler, first, second) == ["first"]  # second is encoded and waits: the look-ahead is full
        assert second.state is not None
        scheduler.add(_prioritized("urgent", -1 if policy == "priority" else 0))
        assert _ids(scheduler.plan(timeout=0).to_prepare) == encoded


def test_with_preemption_off_the_running_batch_runs_on_and_a_better_key_waits_for_it_to_drain():
    """``max_preempted_state_mb: 0``: priority orders the queue only."""
    scheduler = _scheduler(max_num_seqs=3, scheduling_policy="priority", max_preempted_state_mb=0)
    running, later, other = _prioritized("running", 0), _prioritized("later", 0), _prioritized("other", -1, "32x32")
    assert _running(scheduler, running) == ["running"]
    assert _running(scheduler, later, other) == ["running"]  # later, of the running key, does not join
    scheduler.retire([running])
    assert _ids(scheduler.plan(timeout=0).batch) == ["other"]


def _finish_all(scheduler: StepBatchScheduler, plan) -> None:
    """Encode what ``plan`` hands on, run it to its end and decode it: the stage is idle again."""
    _encode(scheduler, plan)
    batch = scheduler.plan(timeout=0).batch
    scheduler.retire(batch)
    for request in batch:
        scheduler.complete(request, OmniRequestOutput(request.request_id, request.prompt))


def test_an_idle_stage_holds_its_first_encode_for_company_within_the_window():
    """``request_batch_max_wait_ms`` in step mode: an idle stage encodes once the group is full or the window after
    its first request's arrival has passed, so that requests arriving moments apart are encoded in one call."""
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=3, wait_ms=50, clock=clock)
    scheduler.add(_request("a", at=clock.now))
    assert scheduler.plan(timeout=0).to_prepare == []  # alone at an idle stage: it waits for company
    clock.now += 0.001
    scheduler.add(_request("b", at=clock.now))
    assert scheduler.plan(timeout=0).to_prepare == []
    clock.now += 0.001
    scheduler.add(_request("c", at=clock.now))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a", "b", "c"]  # full: at once, in one encode
    _finish_all(scheduler, plan)

    scheduler.add(_request("d", at=clock.now))
    assert scheduler.plan(timeout=0).to_prepare == []
    clock.now += 0.050
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["d"]  # the window has passed: alone
    _encode(scheduler, plan)
    assert _ids(scheduler.plan(timeout=0).batch) == ["d"]
    scheduler.add(_request("e", at=clock.now))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["e"] and _ids(plan.batch) == ["d"]  # the stage runs: no wait to join


def test_without_a_window_an_idle_stage_encodes_at_once_and_adaptive_waits_only_for_clients_coming_back():
    clock = Clock()
    scheduler = _scheduler(max_num_seqs=2, clock=clock)
    scheduler.add(_request("a", at=clock.now))
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["a"]

    scheduler = _scheduler(max_num_seqs=2, wait_ms=50, clock=clock, request_batch_wait="adaptive")
    scheduler.add(_request("lone", at=clock.now))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["lone"]  # no sign of company: at once
    clock.now += 0.010
    _finish_all(scheduler, plan)
    clock.now += 0.002  # its client comes back 2 ms after its answer, with a second one
    scheduler.add(_request("a1", at=clock.now))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["a1"]  # one finish seen: no closed loop shows yet
    _encode(scheduler, plan)
    clock.now += 0.002
    scheduler.add(_request("b1", at=clock.now))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.to_prepare) == ["b1"] and _ids(plan.batch) == ["a1"]  # the stage runs: no wait
    clock.now += 0.010
    _finish_all(scheduler, plan)
    clock.now += 0.002  # a closed loop now: its clients come back moments after their answers
    scheduler.add(_request("a2", at=clock.now))
    assert scheduler.plan(timeout=0).to_prepare == []  # the other client is expected
    clock.now += 0.001
    scheduler.add(_request("b2", at=clock.now))
    assert _ids(scheduler.plan(timeout=0).to_prepare) == ["a2", "b2"]  # one encode for both
