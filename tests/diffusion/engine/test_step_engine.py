"""Step mode end to end through `Omni`: mixed steps share forwards, abort between steps, faults stay local."""

import threading
import time

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.errors import RequestAbortedError, SamplingParamsError

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse", "a blue house"]


def _params(steps=4, **kwargs) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=steps, output_type="np", **kwargs)


def _until(predicate, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _step_until_done(engine, futures) -> list:
    """Step an engine driven by the test until every request is done; their outputs, in order."""
    while not all(f.done() for f in futures):
        engine.step(timeout=0.05)
    return [f.result() for f in futures]


@pytest.fixture(scope="module")
def omni(tiny_flux):
    with Omni(model=tiny_flux, max_num_seqs=4, execution_mode="step") as omni:
        yield omni


def test_requests_with_different_steps_share_forwards_and_match_the_stock_pipeline(omni):
    assert omni.stage_configs[0].execution_mode == "step"
    assert omni.stage_configs[0].provenance["execution_mode"] == "python"
    steps = [6, 3, 8, 5]  # one batch in step mode; four batches in request mode
    outputs = omni.generate(PROMPTS, [_params(s, seed=i) for i, s in enumerate(steps)])
    assert [o.error for o in outputs] == [None] * 4
    assert [o.metrics["steps"] for o in outputs] == steps
    assert max(o.metrics["batch_size"] for o in outputs) > 1
    pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
    for i, output in enumerate(outputs):
        stock = pipeline(
            prompt=PROMPTS[i],
            height=32,
            width=32,
            num_inference_steps=steps[i],
            output_type="np",
            generator=[torch.Generator("cpu").manual_seed(i)],
        ).images[0]
        assert np.abs(np.round(output.images[0] * 255) - np.round(stock * 255)).max() <= 2


def test_abort_between_steps_frees_the_slot_and_progress_counts_steps(omni):
    engine = omni.engine
    long = engine.add_request("long", PROMPTS[0], _params(1000))
    _until(lambda: (engine.progress("long") or ("waiting", 0.0))[1] >= 0.002)
    state, fraction = engine.progress("long")
    assert state == "running" and 0 < fraction < 1
    assert engine.abort("long")
    with pytest.raises(RequestAbortedError):
        long.result(timeout=30)
    assert engine.progress("long") is None
    assert engine.stages[0].replicas[0].engine.scheduler.num_running == 0
    assert omni.generate(PROMPTS[:1], _params(2))[0].error is None


def test_a_failing_request_fails_alone(omni, poison_t5):
    """A fault injected into the real T5 encoder: only the request holding the poisoned word fails."""
    poison_t5(omni.engine.stages[0].replicas[0].engine.runner.pipeline, "astronaut")
    outputs = omni.generate(PROMPTS, _params(seed=0))
    assert [o.prompt for o in outputs if o.error] == [PROMPTS[2]]
    assert "RuntimeError: poisoned prompt" in outputs[2].error


def test_out_of_memory_in_a_step_splits_the_forward(omni):
    transformer = omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer

    def fail_above_two(module, args, kwargs):
        if kwargs["hidden_states"].shape[0] > 2:
            raise torch.OutOfMemoryError("simulated: out of memory above 2 rows")

    handle = transformer.register_forward_pre_hook(fail_above_two, with_kwargs=True)
    try:
        outputs = omni.generate(PROMPTS, _params(seed=0))
    finally:
        handle.remove()
    assert [o.error for o in outputs] == [None] * 4


def test_what_step_mode_cannot_run_is_refused_before_it_runs(omni):
    with pytest.raises(SamplingParamsError, match=r"extra_args key 'joint_attention_kwargs' is not supported"):
        omni.generate(["x"], _params(extra_args={"joint_attention_kwargs": {}}))


def test_encode_and_decode_on_side_workers_give_the_same_results(tiny_flux):
    """The CUDA arrangement (encode and decode on worker threads beside the loop), run on the CPU."""
    from vllm_omni.config import OmniDiffusionConfig, resolve_stage_configs
    from vllm_omni.diffusion.engine.roles import ROLES
    from vllm_omni.diffusion.engine.step_mode import StepEngine

    [stage] = resolve_stage_configs(global_knobs={"max_num_seqs": 4, "execution_mode": "step"})
    engine = StepEngine(OmniDiffusionConfig.from_stage(tiny_flux, stage), ROLES["diffusion"], side_workers=True)
    threads = []
    encode = engine.role.stepper.encode

    def recording_encode(*args):
        threads.append(threading.current_thread().name)
        return encode(*args)

    engine.role.stepper.encode = recording_encode
    try:
        # Straight to the engine, past admission: the parameters are complete already (Flux's default guidance).
        futures = [
            engine.add_request(f"r{i}", PROMPTS[i], _params(3 + i, seed=i, guidance_scale=3.5)) for i in range(3)
        ]
        outputs = _step_until_done(engine, futures)
    finally:
        engine.close()
        engine.shutdown()
    assert threads and all(name.startswith("vllm-omni-encode-0") for name in threads)
    pipeline = engine.runner.pipeline
    for i, output in enumerate(outputs):
        stock = pipeline(
            prompt=PROMPTS[i],
            height=32,
            width=32,
            num_inference_steps=3 + i,
            output_type="np",
            generator=[torch.Generator("cpu").manual_seed(i)],
        ).images[0]
        assert np.abs(np.round(output.images[0] * 255) - np.round(stock * 255)).max() <= 2


def test_requests_encoded_at_a_boundary_take_its_step_together(tiny_flux):
    """Encoded on the loop's thread (the CPU arrangement): the prompts waiting at a boundary are encoded in one call,
    and those that arrive meanwhile (a closed loop's other clients, moments behind the first) in the next, and all
    of them take that boundary's step: they step, finish and are decoded as one group, not a step apart."""
    from vllm_omni.config import OmniDiffusionConfig, resolve_stage_configs
    from vllm_omni.diffusion.engine.roles import ROLES
    from vllm_omni.diffusion.engine.step_mode import StepEngine

    [stage] = resolve_stage_configs(global_knobs={"max_num_seqs": 4, "execution_mode": "step"})
    engine = StepEngine(OmniDiffusionConfig.from_stage(tiny_flux, stage), ROLES["diffusion"], side_workers=False)
    encoded: list[list[str]] = []
    encode = engine.role.stepper.encode

    def add(i: int):
        return engine.add_request(f"r{i}", PROMPTS[i], _params(2, seed=i, guidance_scale=3.5))

    def encode_while_others_arrive(prompts, params):
        encoded.append(list(prompts))
        if len(encoded) == 1:
            futures.extend(add(i) for i in range(2, 4))
        return encode(prompts, params)

    engine.role.stepper.encode = encode_while_others_arrive
    try:
        futures = [add(0), add(1)]
        assert engine.step() == 4
        assert encoded == [PROMPTS[:2], PROMPTS[2:]]
        assert [engine.scheduler.state(f"r{i}")[1].steps_done for i in range(4)] == [1] * 4
        outputs = _step_until_done(engine, futures)
    finally:
        engine.close()
        engine.shutdown()
    assert [(o.metrics.batch_size, o.metrics.steps) for o in outputs] == [(4.0, 2)] * 4


def test_an_idle_step_stage_with_a_window_encodes_requests_that_come_apart_in_one_call(tiny_flux):
    """``request_batch_max_wait_ms`` in step mode: the idle stage holds its first encode until the group is full (the
    window is never reached here), so three requests added apart are encoded in one call and share every forward."""
    with Omni(model=tiny_flux, max_num_seqs=3, execution_mode="step", request_batch_max_wait_ms=600_000) as omni:
        pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
        calls: list[int] = []
        handle = pipeline.text_encoder_2.register_forward_pre_hook(
            lambda _, args, kwargs: calls.append(len(args[0] if args else kwargs["input_ids"])), with_kwargs=True
        )
        try:
            futures = []
            for i in range(3):
                futures.append(omni.engine.add_request(f"apart-{i}", PROMPTS[i], _params(3, seed=i)))
                time.sleep(0.05)
            outputs = [future.result(timeout=120) for future in futures]
        finally:
            handle.remove()
    assert [o.error for o in outputs] == [None] * 3
    assert calls == [3], "one text-encoder call for the three prompts"
    assert [o.metrics["batch_size"] for o in outputs] == [3.0] * 3
