"""Component timings (`vllm_omni.diffusion.pipeline.timings`): each output's ``metrics.components`` and the engine's
``vllm_omni:component_seconds``, in request mode, step mode and a split pipeline, on the real tiny pipelines."""

import asyncio
import logging

import pytest

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3


def _params(seed: int, **kwargs) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=STEPS, seed=seed, **kwargs)


def _observations(omni: Omni, stage: int = 0) -> dict[str, float]:
    """Each component's observation count in the stage's ``vllm_omni:component_seconds``."""
    engine = omni.engine.stages[stage].replicas[0].engine
    counts = {}
    for family in engine.metrics.collect():
        if family.name == "vllm_omni:component_seconds":
            counts.update({s.labels["component"]: s.value for s in family.samples if s.name.endswith("_count")})
    return counts


def _check_whole(components: dict[str, float], exec_ms: float, encoders: tuple[str, ...]) -> None:
    """A whole pipeline's record: every component timed, in the order they run, none longer than the request."""
    assert list(components) == [*encoders, "denoise", "denoise_step", "vae_decode", "postprocess"]
    assert all(ms > 0 for ms in components.values())
    # The loop is its steps (and, in request mode, the scheduler's bookkeeping between them).
    assert components["denoise_step"] * STEPS <= components["denoise"] * 1.001
    assert sum(v for k, v in components.items() if k != "denoise_step") <= exec_ms


@pytest.mark.parametrize("mode", ["request", "step"])
def test_each_component_of_a_batch_is_timed_in_the_record_and_the_histogram(tiny_flux, mode, caplog):
    # Request mode waits for the second request (the batch starts once full), so both run in one call.
    wait = {"request_batch_max_wait_ms": 600_000} if mode == "request" else {}
    with Omni(model=tiny_flux, max_num_seqs=2, execution_mode=mode, log_pipeline_timings=True, **wait) as omni:
        with caplog.at_level(logging.INFO, logger="vllm_omni.diffusion.pipeline.timings"):
            outputs = omni.generate(["a cat", "a dog"], [_params(0), _params(1)])
        counts = _observations(omni)
    assert [o.error for o in outputs] == [None, None]
    for output in outputs:
        _check_whole(output.metrics["components"], output.metrics["exec_ms"], ("text_encoder", "text_encoder_2"))
    assert counts["denoise"] == 2  # one observation per request for its loop
    lines = [r.getMessage() for r in caplog.records if "Pipeline timings of stage 0" in r.getMessage()]
    if mode == "request":  # one pipeline call: one record for the batch, one call of each component and step
        assert outputs[0].metrics["components"] == outputs[1].metrics["components"]
        assert counts["text_encoder"] == counts["vae_decode"] == counts["postprocess"] == 1
        assert counts["denoise_step"] == STEPS
        assert len(lines) == 1 and all(output.request_id in lines[0] for output in outputs)
        assert f"denoise_step {outputs[0].metrics['components']['denoise_step']:.1f} ms" in lines[0]
    else:  # the prompts handed over at one boundary share an encoder call, so one call, or two when the second
        # request came after the first's boundary; they share the steps they both run (the second may join late)
        assert counts["text_encoder"] in (1, 2) and STEPS <= counts["denoise_step"] <= 2 * STEPS
        assert all(any(output.request_id in line for line in lines) for output in outputs)


def test_a_video_pipeline_and_one_with_three_text_encoders_are_timed(tiny_wan, tiny_sd3):
    with Omni(model=tiny_wan) as omni:
        video = omni.generate("a cat", _params(0, num_frames=5))[0]
    _check_whole(video.metrics["components"], video.metrics["exec_ms"], ("text_encoder",))
    with Omni(model=tiny_sd3) as omni:
        image = omni.generate("a cat", _params(0))[0]
    _check_whole(
        image.metrics["components"], image.metrics["exec_ms"], ("text_encoder", "text_encoder_2", "text_encoder_3")
    )


def test_a_split_pipeline_times_each_stage_and_sums_them(tiny_sd3):
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0]),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    with Omni(model=tiny_sd3, deploy_config=deploy) as omni:
        output = omni.generate("a cat", _params(0))[0]
        counts = [_observations(omni, stage) for stage in range(3)]
    stages = [stage.components for stage in output.metrics["stages"]]
    assert [list(c) for c in stages] == [
        ["text_encoder", "text_encoder_2", "text_encoder_3"],
        ["denoise", "denoise_step"],
        ["vae_decode", "postprocess"],
    ]
    assert output.metrics["components"] == {name: ms for c in stages for name, ms in c.items()}
    assert counts[1] == {"denoise_step": STEPS, "denoise": 1}
    assert counts[2] == {"vae_decode": 1, "postprocess": 1}


def test_a_preview_is_timed_apart_from_the_steps_and_its_vae_call(tiny_flux):
    async def run() -> tuple[list, dict]:
        async with AsyncOmni(model=tiny_flux, execution_mode="step") as omni:
            params = _params(0, partial_images=1, output_type="np")
            items = [item async for item in omni.generate("a cat", params)]
            return items, _observations(omni)

    items, counts = asyncio.run(run())
    assert [item.finished for item in items] == [False, True]
    components = items[-1].metrics["components"]
    assert components["preview"] > 0 and counts["preview"] == 1
    assert counts["vae_decode"] == 1  # the final decode only: the preview's projection is the preview's


def test_with_component_timings_off_nothing_is_hooked_or_recorded(tiny_flux):
    with Omni(model=tiny_flux, component_timings=False) as omni:
        output = omni.generate("a cat", _params(0))[0]
        pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
        counts = _observations(omni)
    assert "components" not in output.metrics and counts == {}
    assert not pipeline.transformer._forward_pre_hooks and "decode" not in vars(pipeline.vae)
