"""Preemption in step mode on real tiny pipelines, each engine stepped on the test's thread (the CPU's step engine
encodes and decodes on its loop, so nothing here waits on time): a request preempted once or several times ends
with the image and SDE trajectory it makes unpreempted, bit-equal where it ran alone both ways (Flux, SD3, Wan and
the modular FLUX.2 [klein]); with a per-request step cache in batches of two, where the batch shapes differ
(2/255, trajectories 1e-5, and each request skips what it skips unpreempted); a split ``denoise`` stage's latents;
the kept state's gauge and the preemption counter."""

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from vllm_omni import OmniDiffusionSamplingParams
from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig, resolve_stage_configs
from vllm_omni.diffusion.engine.roles import ROLES
from vllm_omni.diffusion.engine.step_mode import StepEngine

pytestmark = pytest.mark.slow

BOUNDARIES = 100
"""More than any run here takes (each step boundary encodes, steps or decodes something)."""

SDE = {"sde_type": "sde", "noise_level": 0.8, "logprobs": True, "sde_window_size": 2, "sde_window_range": [0, 4]}


def _engine(model: str, stage: StageDeployConfig | None = None, **knobs) -> StepEngine:
    if stage is None:
        knobs = {"execution_mode": "step", "scheduling_policy": "priority", "max_num_seqs": 1} | knobs
        [stage] = resolve_stage_configs(global_knobs=knobs)
    return StepEngine(OmniDiffusionConfig.from_stage(model, stage), ROLES[stage.stage_type], side_workers=False)


def _params(engine: StepEngine, priority: int, seed: int, steps: int = 5, **extra) -> OmniDiffusionSamplingParams:
    frames = {"num_frames": 5} if engine.runner.card.output == "video" else {}
    params = OmniDiffusionSamplingParams(
        height=32,
        width=32,
        num_inference_steps=steps,
        seed=seed,
        priority=priority,
        output_type="np",
        extra_args=extra,
        **frames,
    )
    return engine.admission.admit(params).params


class _Run:
    """Requests through ``engine`` to the end, stepped one boundary at a time. A later request arrives at the
    boundary where the watched request has taken its given number of steps."""

    def __init__(self, engine: StepEngine, watched: str):
        self.engine, self.watched = engine, watched
        self.futures: dict = {}
        self.preempted_at: list[int] = []
        """The steps the watched request had taken each time it was preempted."""

    def add(self, request_id: str, params: OmniDiffusionSamplingParams, payload=None) -> None:
        self.futures[request_id] = self.engine.add_request(request_id, f"prompt {request_id}", params, payload)

    def until_done(self, arrivals: Sequence[tuple[int, str, OmniDiffusionSamplingParams]] = (), payload=None) -> dict:
        pending, was_preempted = list(arrivals), False
        for _ in range(BOUNDARIES):
            if not pending and all(f.done() for f in self.futures.values()):
                break
            found = self.engine.scheduler.state(self.watched)
            if found is not None and pending and found[0] == "running" and found[1].steps_done == pending[0][0]:
                _, request_id, params = pending.pop(0)
                self.add(request_id, params, payload)
            preempted = found is not None and found[1].preempted
            if preempted:
                assert found is not None
                if not was_preempted:
                    self.preempted_at.append(found[1].steps_done)
                assert _counted(self.engine, "vllm_omni:preempted_state_bytes") == found[1].kept_bytes > 0
            was_preempted = preempted
            self.engine.step(timeout=0)
        else:
            raise AssertionError(f"not done after {BOUNDARIES} step boundaries")
        assert self.engine.scheduler.kept_bytes == 0
        return {request_id: future.result() for request_id, future in self.futures.items()}


def _counted(engine: StepEngine, name: str) -> float:
    samples = [s for m in engine.metrics.registry.collect() for s in m.samples if s.name == name]
    return sum(s.value for s in samples)


def _pixels(output) -> np.ndarray:
    return np.round(np.asarray(output.images[0] if output.images else output.videos[0], dtype=np.float64) * 255)


@pytest.mark.parametrize("family", ["flux", "sd3", "wan", "flux2"])
def test_a_request_preempted_again_and_again_ends_as_it_does_unpreempted(request, family):
    """``max_num_seqs`` 1: the watched request runs alone both ways, so image and trajectory are bit-equal."""
    engine = _engine(request.getfixturevalue(f"tiny_{family}"))
    extra = SDE | ({"sde_type": "dance_sde"} if family == "wan" else {})
    alone = _Run(engine, "low")
    alone.add("low", _params(engine, 5, seed=3, **extra))
    want = alone.until_done()["low"]
    run = _Run(engine, "low")
    run.add("low", _params(engine, 5, seed=3, **extra))
    urgent = [(1, "urgent0", _params(engine, 0, seed=4, steps=2)), (3, "urgent1", _params(engine, -1, seed=5, steps=2))]
    got = run.until_done(urgent)["low"]
    assert _counted(engine, "vllm_omni:num_preemptions_total") == 2
    assert run.preempted_at == [1, 3]  # the urgent one is encoded at the boundary it came, and preempts there
    assert np.array_equal(_pixels(got), _pixels(want))
    for name in ("trajectory_latents", "trajectory_log_probs", "trajectory_timesteps"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.metrics.steps == want.metrics.steps == 5
    assert _counted(engine, "vllm_omni:preempted_state_bytes") == 0


def test_a_step_cache_and_sde_in_batches_that_change_shape(tiny_flux):
    """Two requests run together; an urgent one preempts the worse (b) after its first step, so b's batches differ
    from its unpreempted run: its image within 2/255, its trajectory within 1e-5, and every request makes the skip
    decisions it makes unpreempted (the skip count of the run is the sum of theirs)."""
    cache = {"cache_backend": "taylorseer", "cache_config": {"cache_interval": 2, "disable_cache_before_step": 2}}
    engine = _engine(tiny_flux, max_num_seqs=2, **cache)

    def requests(run: _Run) -> None:
        run.add("a", _params(engine, 5, seed=1, steps=6))
        run.add("b", _params(engine, 6, seed=2, steps=6, **SDE))

    skipped = _counted(engine, "vllm_omni:cache_skipped_steps_total")
    reference = _Run(engine, "b")
    requests(reference)
    want = reference.until_done()
    urgent = _Run(engine, "urgent")
    urgent.add("urgent", _params(engine, 0, seed=3, steps=3))
    want |= urgent.until_done()
    skipped_apart = _counted(engine, "vllm_omni:cache_skipped_steps_total") - skipped
    run = _Run(engine, "b")
    requests(run)
    got = run.until_done([(1, "urgent", _params(engine, 0, seed=3, steps=3))])
    assert run.preempted_at == [1] and _counted(engine, "vllm_omni:num_preemptions_total") == 1
    assert skipped_apart > 0
    assert _counted(engine, "vllm_omni:cache_skipped_steps_total") - skipped - skipped_apart == skipped_apart
    for name in ("a", "b", "urgent"):
        assert np.abs(_pixels(got[name]) - _pixels(want[name])).max() <= 2, name
    for field in ("trajectory_latents", "trajectory_log_probs"):
        assert (getattr(got["b"], field) - getattr(want["b"], field)).abs().max().item() <= 1e-5


def test_a_split_denoise_stage_preempts_and_hands_on_the_same_latents(tiny_flux):
    encoder = _engine(tiny_flux).role.stepping  # what the encode stage computes, run here
    stage = StageDeployConfig(
        stage_id=1, stage_type="denoise", inputs=(0,), execution_mode="step", scheduling_policy="priority"
    )
    engine = _engine(tiny_flux, stage)
    low, urgent = _params(engine, 5, seed=1), _params(engine, 0, seed=2, steps=2)
    [low_prompt, urgent_prompt] = encoder.encode(["prompt low", "prompt urgent"], [low, urgent])
    alone = _Run(engine, "low")
    alone.add("low", low, low_prompt)
    want = alone.until_done()["low"].payload
    run = _Run(engine, "low")
    run.add("low", low, low_prompt)
    got = run.until_done([(2, "urgent", urgent)], payload=urgent_prompt)["low"].payload
    assert run.preempted_at == [2]
    assert torch.equal(got.latents, want.latents)
