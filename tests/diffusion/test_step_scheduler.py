"""Step-mode policy: admission at step boundaries, encode look-ahead, bucket fairness, abort frees a slot."""

import pytest

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.outputs import OmniRequestOutput
from vllm_omni.diffusion.request import (
    DiffusionRequest,
    OmniDiffusionSamplingParams,
    RequestAbortedError,
    RequestFailedError,
)
from vllm_omni.diffusion.batching import StepBatchScheduler


def _scheduler(max_num_seqs=2) -> StepBatchScheduler:
    return StepBatchScheduler(
        OmniDiffusionConfig.from_stage(
            "unused",
            StageDeployConfig(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=0.0, execution_mode="step"),
        )
    )


def _request(name: str, key="64x64") -> DiffusionRequest:
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4)
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
