"""Engine faults on a real tiny pipeline: out of memory splits the batch, an engine loop that dies fails fast."""

import logging

import pytest
import torch
from prometheus_client import REGISTRY

from vllm_omni import Omni, OmniDiffusionSamplingParams, StageUnavailableError

pytestmark = pytest.mark.slow

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse", "a blue house"]
PARAMS = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=0)


def _splits() -> float:
    return REGISTRY.get_sample_value("vllm_omni:oom_batch_splits_total", {"stage": "0", "replica": "0"}) or 0.0


def test_out_of_memory_splits_the_batch_and_retries(tiny_flux, caplog):
    """A wrapper around the real transformer raises torch.OutOfMemoryError above 2 rows."""
    with Omni(model=tiny_flux, max_num_seqs=4, request_batch_max_wait_ms=500) as omni:
        transformer = omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer

        def fail_above_two(module, args, kwargs):
            if kwargs["hidden_states"].shape[0] > 2:
                raise torch.OutOfMemoryError("simulated: out of memory above 2 rows")

        handle = transformer.register_forward_pre_hook(fail_above_two, with_kwargs=True)
        splits = _splits()
        with caplog.at_level(logging.WARNING, logger="vllm_omni"):
            outputs = omni.generate(PROMPTS, PARAMS)
        handle.remove()
        assert _splits() == splits + 1  # while the engine lives: its metrics leave /metrics with it
    assert [o.error for o in outputs] == [None] * 4
    assert [o.metrics["batch_size"] for o in outputs] == [2, 2, 2, 2]
    assert "out of memory with a batch of 4; retrying as 2 + 2" in caplog.text


def test_out_of_memory_alone_fails_only_that_request(tiny_flux):
    with Omni(model=tiny_flux, max_num_seqs=2, request_batch_max_wait_ms=500) as omni:
        transformer = omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer

        def fail_always(module, args, kwargs):
            raise torch.OutOfMemoryError("simulated: out of memory")

        handle = transformer.register_forward_pre_hook(fail_always, with_kwargs=True)
        outputs = omni.generate(PROMPTS[:2], PARAMS)
        handle.remove()
        assert all("OutOfMemoryError" in o.error for o in outputs)
        assert omni.generate(PROMPTS[:1], PARAMS)[0].error is None  # the engine still serves


def test_engine_loop_death_fails_waiting_and_new_requests_fast(tiny_flux):
    with Omni(model=tiny_flux, max_num_seqs=1) as omni:
        stage = omni.engine.stages[0]
        scheduler = stage.replicas[0].engine.scheduler
        original_finish = scheduler.finish

        def finish_then_break(batch, outputs):
            original_finish(batch, outputs)
            raise RuntimeError("simulated scheduler bug")

        scheduler.finish = finish_then_break
        first = omni.engine.add_request("first", "a cat", PARAMS)
        second = omni.engine.add_request("second", "a dog", PARAMS)
        assert first.result(timeout=60).error is None  # delivered before the loop broke
        with pytest.raises(Exception, match="engine loop of stage 0 replica 0 died: RuntimeError"):
            second.result(timeout=60)
        assert not omni.engine.is_alive
        with pytest.raises(StageUnavailableError, match="stage 0 is unavailable: no replica is alive"):
            omni.engine.add_request("third", "a car", PARAMS)
