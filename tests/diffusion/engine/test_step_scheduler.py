"""Step-mode policy: admission at step boundaries, encode look-ahead, bucket fairness, abort frees a slot, LoRA
adapters in use, engine calls."""

import threading

import pytest

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine.request import DiffusionRequest
from vllm_omni.diffusion.engine.scheduler import StepBatchScheduler
from vllm_omni.errors import RequestAbortedError, RequestFailedError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def _scheduler(max_num_seqs=2, **knobs) -> StepBatchScheduler:
    return StepBatchScheduler(
        OmniDiffusionConfig.from_stage(
            "unused",
            StageDeployConfig(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=0.0, execution_mode="step", **knobs),
        )
    )


def _request(name: str, key="64x64", adapters=()) -> DiffusionRequest:
    lora = [{"name": a, "path": f"/loras/{a}"} for a in adapters]  # as admitted: each with its path
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4, lora=lora)
    return DiffusionRequest.create(name, f"prompt {name}", params, key=key)


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


# Priority (scheduling_policy: priority): who is encoded and joins next; running requests are never preempted.


def _prioritized(name: str, priority: int, key="64x64") -> DiffusionRequest:
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4, priority=priority)
    return DiffusionRequest.create(name, f"prompt {name}", params, key=key)


def test_by_priority_a_better_request_joins_next_and_the_running_ones_run_on():
    scheduler = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    a, b, c = (_prioritized(name, 1) for name in "abc")
    for request in (a, b, c):
        scheduler.add(request)
    _encode(scheduler, scheduler.plan(timeout=0))  # a and b
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a", "b"] and _ids(plan.to_prepare) == ["c"]
    _encode(scheduler, plan)
    scheduler.add(_prioritized("urgent", -1))
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["a", "b"]  # no preemption: the running batch runs on
    assert _ids(plan.to_prepare) == ["urgent"]
    _encode(scheduler, plan)
    scheduler.retire([a])
    assert _ids(scheduler.plan(timeout=0).batch) == ["b", "urgent"]  # ahead of c, which waited longer


def test_by_priority_a_better_request_behind_a_full_encoding_budget_does_not_block_it():
    scheduler = _scheduler(max_num_seqs=2, scheduling_policy="priority")
    for name in ("low1", "low2"):
        scheduler.add(_prioritized(name, 5))
    plan = scheduler.plan(timeout=0)
    scheduler.add(_prioritized("urgent", 0, key="32x32"))  # the best, another key, and the budget is spent
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["low1", "low2"]  # the encoded ones run: they hold the budget until they join
    assert _ids(plan.to_prepare) == ["urgent"]
    _encode(scheduler, plan)
    plan = scheduler.plan(timeout=0)
    assert _ids(plan.batch) == ["low1", "low2"]  # urgent's key waits for the running key to drain


def test_by_priority_the_best_waiting_key_drains_the_running_one():
    scheduler = _scheduler(max_num_seqs=3, scheduling_policy="priority")
    running, later, other = _prioritized("running", 0), _prioritized("later", 0), _prioritized("other", -1, "32x32")
    scheduler.add(running)
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["running"]
    scheduler.add(later)
    scheduler.add(other)
    _encode(scheduler, scheduler.plan(timeout=0))
    assert _ids(scheduler.plan(timeout=0).batch) == ["running"]  # later, of the running key, does not join
    scheduler.retire([running])
    assert _ids(scheduler.plan(timeout=0).batch) == ["other"]
