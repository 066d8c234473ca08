"""`AsyncOmni`: concurrent requests batch together; abort and cancellation free their slot."""

import asyncio
import threading

import pytest

from vllm_omni import AsyncOmni, OmniDiffusionSamplingParams, RequestFailedError, StageUnavailableError

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _params(steps=4, **kw):
    return OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=steps, **kw)


async def _collect(omni, prompt, params, request_id=None):
    return [out async for out in omni.generate(prompt, params, request_id=request_id)]


def _hold_batches(scheduler) -> threading.Event:
    """The engine runs its batches but finishes none until the returned event is set: the test, not the speed of
    the machine, decides when a running request can end."""
    finish, released = scheduler.finish, threading.Event()

    def finish_when_released(batch, outputs):
        released.wait()
        finish(batch, outputs)

    scheduler.finish = finish_when_released
    return released


async def _until(predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_concurrent_generate_calls_share_one_batch(tiny_flux):
    # The batch starts as soon as it is full, so a long admission wait costs nothing and no arrival is too late.
    async with AsyncOmni(model=tiny_flux, max_num_seqs=4, request_batch_max_wait_ms=120_000) as omni:
        results = await asyncio.gather(
            *(_collect(omni, f"prompt {i}", _params(seed=i), request_id=f"req-{i}") for i in range(4))
        )
    assert [len(r) for r in results] == [1, 1, 1, 1]
    assert [r[0].request_id for r in results] == [f"req-{i}" for i in range(4)]
    assert [r[0].metrics["batch_size"] for r in results] == [4, 4, 4, 4]
    assert all(r[0].images[0].size == (32, 32) for r in results)


async def test_abort_and_cancel_free_their_slots(tiny_flux):
    async with AsyncOmni(model=tiny_flux, max_num_seqs=1) as omni:
        scheduler = omni.engine.stages[0].replicas[0].engine.scheduler
        release = _hold_batches(scheduler)  # "running" stays in flight until it is aborted below
        slow = _params(steps=400, seed=0)
        running = asyncio.create_task(_collect(omni, "long", slow, request_id="running"))
        try:
            await _until(lambda: scheduler.num_running == 1)
            waiting = asyncio.create_task(_collect(omni, "queued", _params(seed=1), request_id="waiting"))
            cancelled = asyncio.create_task(_collect(omni, "queued", _params(seed=2), request_id="cancelled"))
            await _until(lambda: scheduler.num_waiting == 2)

            assert await omni.abort("waiting") is True
            assert await waiting == []  # an aborted request ends its stream without output
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            assert await omni.abort("running") is True  # interrupts the 400-step batch
        finally:
            release.set()
        assert await asyncio.wait_for(running, timeout=120) == []
        await _until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0)
        assert await omni.abort("running") is False

        # The engine is free again and still serves.
        (output,) = await _collect(omni, "after", _params(seed=3))
        assert output.metrics["batch_size"] == 1


async def test_failed_request_raises_and_duplicate_ids_are_refused(tiny_flux):
    async with AsyncOmni(model=tiny_flux, max_num_seqs=2) as omni:
        encoder = omni.engine.stages[0].replicas[0].engine.runner.pipeline.text_encoder_2
        handle = encoder.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("encoder fault")))
        try:
            with pytest.raises(RequestFailedError, match="request bad failed: RuntimeError: encoder fault"):
                await _collect(omni, "x", _params(seed=0), request_id="bad")
        finally:
            handle.remove()
        first = asyncio.create_task(_collect(omni, "x", _params(steps=50, seed=0), request_id="same"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="request_id 'same' is already in flight"):
            await _collect(omni, "y", _params(seed=0), request_id="same")
        assert len(await first) == 1


async def test_shutdown_fails_waiting_requests(tiny_flux):
    omni = AsyncOmni(model=tiny_flux, max_num_seqs=1)
    scheduler = omni.engine.stages[0].replicas[0].engine.scheduler
    release = _hold_batches(scheduler)  # the running batch cannot finish before the shutdown has begun
    running = asyncio.create_task(_collect(omni, "long", _params(steps=200, seed=0)))
    try:
        await _until(lambda: scheduler.num_running == 1)
        waiting = asyncio.create_task(_collect(omni, "queued", _params(seed=1)))
        await _until(lambda: scheduler.num_waiting == 1)
        stopping = asyncio.create_task(asyncio.to_thread(omni.shutdown))
        with pytest.raises(RequestFailedError, match="shutting down"):
            await asyncio.wait_for(waiting, timeout=120)  # failed while the running batch still runs
    finally:
        release.set()
    await asyncio.wait_for(stopping, timeout=120)
    assert len(await running) == 1  # the running batch finishes
    with pytest.raises(StageUnavailableError, match="^stage 0 is unavailable: no replica is alive$"):
        await _collect(omni, "late", _params())


async def test_parameters_admitted_once_are_not_completed_again(tiny_flux):
    """What the HTTP layer uses: ``admit`` completes the parameters (model defaults, a seed), ``generate`` takes them
    as they are, and the engine's figures are read through `AsyncOmni`."""
    async with AsyncOmni(model=tiny_flux, max_num_seqs=1) as omni:
        await omni.warm_up()
        assert (omni.model_card.output, omni.num_waiting, omni.progress("nope")) == ("image", 0, None)
        assert [(h.stage_id, h.status) for h in omni.health()] == [(0, "ok")]
        admitted = omni.admit(OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2))
        assert admitted.params.seed is not None and admitted.params.guidance_scale is not None
        assert len(admitted.keys) == 1

        calls = []
        admit = omni.engine.admit
        omni.engine.admit = lambda params: calls.append(params) or admit(params)
        (once,) = await _collect(omni, "a cat", admitted)
        assert calls == []
        (again,) = await _collect(omni, "a cat", _params(steps=2, seed=admitted.params.seed))
        assert len(calls) == 1
        assert once.images[0].tobytes() == again.images[0].tobytes()
