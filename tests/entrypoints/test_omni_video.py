"""Text-to-video through the same scheduler and runner, on a real tiny WanPipeline."""

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams, SamplingParamsError

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["a cat running", "a red car", "an astronaut riding a horse", "a blue house"]


def _params(**kw):
    return OmniDiffusionSamplingParams(**{"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2, **kw})


def _frames(video) -> np.ndarray:
    return np.stack([np.asarray(frame, dtype=np.int16) for frame in video])


@pytest.fixture(scope="module")
def omni(tiny_wan):
    with Omni(model=tiny_wan, max_num_seqs=4, request_batch_max_wait_ms=300) as omni:
        yield omni


def test_four_video_requests_run_as_one_batch(omni):
    outputs = omni.generate(PROMPTS, _params(seed=0, fps=8))
    for output in outputs:
        assert output.error is None and output.images == []
        assert output.metrics["batch_size"] == 4 and output.metrics["fps"] == 8
        (video,) = output.videos
        assert len(video) == 9 and {frame.size for frame in video} == {(32, 32)}


def test_same_seed_gives_the_same_video_alone_or_batched(omni):
    alone = omni.generate([PROMPTS[1]], _params(seed=42))[0]
    batched = omni.generate(PROMPTS, [_params(seed=42 if p == PROMPTS[1] else i) for i, p in enumerate(PROMPTS)])[1]
    assert (alone.metrics["batch_size"], batched.metrics["batch_size"]) == (1, 4)
    assert np.abs(_frames(alone.videos[0]) - _frames(batched.videos[0])).max() <= 2


def test_frame_count_and_shape_split_batches(omni):
    outputs = omni.generate(PROMPTS[:2], [_params(seed=0), _params(seed=0, num_frames=5)])
    assert [o.metrics["batch_size"] for o in outputs] == [1, 1]
    assert [len(o.videos[0]) for o in outputs] == [9, 5]


def test_defaults_and_invalid_video_params(omni):
    with pytest.raises(SamplingParamsError, match="num_frames=10 must be 1 more than a multiple of 4"):
        omni.generate(["x"], _params(num_frames=10))
    with pytest.raises(SamplingParamsError, match="width=40 is not a multiple of 16"):
        omni.generate(["x"], OmniDiffusionSamplingParams(height=32, width=40, num_frames=5, num_inference_steps=1))
    completed = omni.engine.admit(OmniDiffusionSamplingParams()).params
    assert (completed.height, completed.width, completed.num_frames, completed.fps) == (480, 832, 81, 16)


def test_image_pipelines_refuse_video_params(tiny_flux):
    with Omni(model=tiny_flux) as omni:
        with pytest.raises(
            SamplingParamsError, match="num_frames applies to video pipelines; FluxPipeline makes images"
        ):
            omni.generate(["x"], OmniDiffusionSamplingParams(height=32, width=32, num_frames=9))
