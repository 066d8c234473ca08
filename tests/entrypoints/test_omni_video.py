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


def test_a_remix_equals_the_stock_video_to_video_pipeline(omni, tiny_wan):
    """A request with an input video runs the served model's video-to-video variant: its frames equal the stock
    ``WanVideoToVideoPipeline`` built with ``from_pipe`` and called alone, bit for bit (the Videos API's remix
    checks its plumbing on MP4s, whose encoder is not bit-stable across processes)."""
    import torch
    from diffusers import WanVideoToVideoPipeline

    from vllm_omni.testing.checks.stock import stock_pipeline

    source = omni.generate([PROMPTS[0]], _params(seed=11))[0].videos[0]
    remix = {"height": 32, "width": 32, "num_inference_steps": 2, "strength": 0.75}
    (output,) = omni.generate(["a dog walking"], OmniDiffusionSamplingParams(video=source, seed=5, **remix))
    assert output.error is None and len(output.videos[0]) == 9
    stock = WanVideoToVideoPipeline.from_pipe(stock_pipeline(tiny_wan))
    stock.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(5)
    expected = stock(prompt="a dog walking", video=source, generator=generator, output_type="pil", **remix).frames[0]
    np.testing.assert_array_equal(_frames(output.videos[0]), _frames(expected))


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
    with (
        Omni(model=tiny_flux) as omni,
        pytest.raises(SamplingParamsError, match="num_frames applies to video pipelines; FluxPipeline makes images"),
    ):
        omni.generate(["x"], OmniDiffusionSamplingParams(height=32, width=32, num_frames=9))


def test_a_two_expert_wan_takes_guidance_scale_2_and_boundary_ratio_as_stock(tiny_wan22):
    """Wan 2.2's knobs, batched together with different values (each its own batch key), each request equal to
    the stock pipeline called with the same values."""
    import torch
    from diffusers import DiffusionPipeline

    common = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 4, "guidance_scale": 3.0}
    variants = [
        {},
        {"guidance_scale_2": 20.0},
        {"boundary_ratio": 0.5},
        {"guidance_scale_2": 6.0, "boundary_ratio": 0.3},
    ]
    with Omni(model=tiny_wan22, max_num_seqs=4) as omni:
        params = [
            OmniDiffusionSamplingParams(**common, seed=i, negative_prompt="blurry", extra_args=v)
            for i, v in enumerate(variants)
        ]
        outputs = omni.generate(["a cat running"] * 4, params)
    stock = DiffusionPipeline.from_pretrained(tiny_wan22)
    videos = []
    for i, variant in enumerate(variants):
        stock.register_to_config(boundary_ratio=variant.get("boundary_ratio", 0.875))
        expected = stock(
            "a cat running",
            negative_prompt="blurry",
            guidance_scale_2=variant.get("guidance_scale_2"),
            generator=torch.Generator("cpu").manual_seed(i),
            output_type="pil",
            **common,
        ).frames[0]
        videos.append(_frames(outputs[i].videos[0]))
        assert np.abs(videos[-1] - _frames(expected)).max() <= 2, variant
    # Each knob moved the video (against the same seed's run without it, from the batch above).
    same_seed = OmniDiffusionSamplingParams(**common, seed=0, negative_prompt="blurry")
    with Omni(model=tiny_wan22) as omni:
        base = _frames(omni.generate(["a cat running"], same_seed)[0].videos[0])
        for variant in variants[1:]:
            moved = omni.generate(["a cat running"], same_seed.model_copy(update={"extra_args": variant}))[0]
            assert np.abs(_frames(moved.videos[0]) - base).max() > 2, variant


def test_a_one_expert_wan_drops_the_two_expert_knobs_with_a_warning(omni):
    plain = omni.generate(["x"], _params(seed=4))[0]
    for arg in ("guidance_scale_2", "boundary_ratio"):
        with pytest.warns(UserWarning, match=f"extra_args.{arg} ignored: {arg} applies to two-expert Wan 2.2 folders"):
            output = omni.generate(["x"], _params(seed=4, extra_args={arg: 0.5}))[0]
        assert [field.param for field in output.ignored_fields] == [f"extra_args.{arg}"]
        assert np.array_equal(_frames(output.videos[0]), _frames(plain.videos[0]))
