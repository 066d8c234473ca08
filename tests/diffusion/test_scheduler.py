"""BatchScheduler policy: capacity, batch keys, no head-of-line blocking, no starvation, admission wait."""

import threading
import time

import pytest

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.outputs import OmniRequestOutput
from vllm_omni.diffusion.request import (
    DiffusionRequest,
    OmniDiffusionSamplingParams,
    RequestAbortedError,
    RequestFailedError,
)
from vllm_omni.diffusion.batching import BatchScheduler


def _scheduler(max_num_seqs=4, wait_ms=0.0) -> BatchScheduler:
    return BatchScheduler(
        OmniDiffusionConfig.from_stage(
            "unused",
            StageDeployConfig(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms, execution_mode="request"),
        )
    )


def _request(name: str, size: int = 32, **params) -> DiffusionRequest:
    full = OmniDiffusionSamplingParams(height=size, width=size, num_inference_steps=4, **params)
    return DiffusionRequest.create(name, f"prompt {name}", full)


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


def test_without_admission_wait_a_partial_batch_starts_at_once():
    scheduler = _scheduler(max_num_seqs=4, wait_ms=0)
    scheduler.add(_request("a"))
    assert _ids(scheduler.schedule(timeout=0.5)) == ["a"]


def test_admission_wait_holds_an_idle_engine_until_the_deadline():
    scheduler = _scheduler(max_num_seqs=4, wait_ms=300)
    request = _request("a")
    scheduler.add(request)
    due = request.arrival_time + 0.3
    early = scheduler.schedule(timeout=0.05)  # not due yet, unless a busy machine took longer than that to get here
    assert early == [] or time.monotonic() >= due
    batch = early or scheduler.schedule(timeout=30)
    assert _ids(batch) == ["a"]
    assert time.monotonic() >= due  # never before the deadline, measured from the arrival, not from a later clock


def test_admission_wait_ends_as_soon_as_the_batch_is_full():
    scheduler = _scheduler(max_num_seqs=3, wait_ms=20_000)
    scheduler.add(_request("a"))

    def late_arrivals():
        time.sleep(0.1)
        scheduler.add(_request("b"))
        scheduler.add(_request("other", size=64))  # does not fill a's batch
        scheduler.add(_request("c"))

    threading.Thread(target=late_arrivals).start()
    started = time.monotonic()
    assert _ids(scheduler.schedule(timeout=30)) == ["a", "b", "c"]
    assert time.monotonic() - started < 10  # far below the 20 s deadline


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
    scheduler = _scheduler(wait_ms=20_000)
    request = _request("a")
    scheduler.add(request)
    threading.Timer(0.1, scheduler.close, args=("shutting down",)).start()
    assert scheduler.schedule() == []
    with pytest.raises(RequestFailedError, match="shutting down"):
        request.future.result(timeout=1)
    with pytest.raises(RuntimeError, match="shut down"):
        scheduler.add(_request("b"))
