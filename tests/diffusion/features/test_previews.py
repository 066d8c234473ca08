"""Partial images (``partial_images``): when previews are due, what they are made of, and how they reach the caller
through `AsyncOmni.generate` in request mode, step mode and a split deployment, on every tiny family."""

import asyncio
import logging
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.diffusion.engine import denoise
from vllm_omni.diffusion.features import previews as previews_module
from vllm_omni.diffusion.features.previews import LatentProjection, Previews, clean_latents, preview_steps
from vllm_omni.errors import SamplingParamsError
from vllm_omni.testing.checks.edits import noise_image

FAMILIES = ["flux", "sd", "sd3", "sdxl", "wan", "z_image", "qwen_image"]
FRAMES = {"wan": 5, "hunyuan_video15": 5, "ltx": 9}
"""The video families' frames per request (one video per prompt)."""
MODES = ["request", "step"]
STEPS = 4


# --- when previews are due --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "count", "expected"),
    [
        (4, 3, (1, 2, 3)),
        (20, 3, (5, 10, 15)),
        (10, 1, (5,)),
        (9, 2, (3, 6)),
        (3, 2, (1, 2)),
        (2, 3, (1,)),  # too few steps: fewer previews, never after the last step
        (1, 3, ()),
        (50, 0, ()),
    ],
)
def test_preview_steps(total, count, expected):
    assert preview_steps(total, count) == expected


@pytest.mark.parametrize("count", [1, 2, 3])
def test_preview_steps_are_evenly_spaced_whenever_there_are_enough_steps(count):
    for total in range(count + 1, 80):
        steps = preview_steps(total, count)
        assert len(steps) == count, (total, steps)
        assert all(0 < s < total for s in steps)
        for i, step in enumerate(steps):  # each within half a step of its even share of the schedule
            assert abs(step - total * (i + 1) / (count + 1)) <= 0.5, (total, steps)


# --- what previews are made of ----------------------------------------------------------------------------------


def _tensors(seed: int, shape=(2, 4, 8, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_clean_latents_of_flow_matching_is_the_sample_minus_sigma_times_the_velocity():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(4)
    sample, velocity = _tensors(0)
    for index in range(4):
        sigma = float(scheduler.sigmas[index])
        assert 0 < sigma <= 1
        clean = clean_latents(scheduler, index, scheduler.timesteps[index], velocity, sample)
        torch.testing.assert_close(clean, sample - sigma * velocity)
    # At the last step Euler goes to sigma 0: its step lands on that estimate.
    scheduler.set_begin_index(3)
    stepped = scheduler.step(velocity, scheduler.timesteps[3], sample).prev_sample
    torch.testing.assert_close(clean_latents(scheduler, 3, scheduler.timesteps[3], velocity, sample), stepped)


@pytest.mark.parametrize("scheduler_class", [DDIMScheduler, DDPMScheduler])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_clean_latents_of_ddpm_style_schedulers_inverts_the_prediction(scheduler_class, prediction_type):
    scheduler = scheduler_class(
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        prediction_type=prediction_type,
    )
    scheduler.set_timesteps(10)
    sample, prediction = _tensors(1)
    index = 3
    timestep = scheduler.timesteps[index]
    alpha = float(scheduler.alphas_cumprod[int(timestep)])
    by_hand = {
        "epsilon": (sample - (1 - alpha) ** 0.5 * prediction) / alpha**0.5,
        "v_prediction": alpha**0.5 * sample - (1 - alpha) ** 0.5 * prediction,
        "sample": prediction,
    }[prediction_type]
    clean = clean_latents(scheduler, index, timestep, prediction, sample)
    torch.testing.assert_close(clean, by_hand)
    # The same x0 as the scheduler's own step estimates.
    torch.testing.assert_close(clean, scheduler.step(prediction, timestep, sample).pred_original_sample)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_clean_latents_of_k_diffusion_schedulers_uses_their_sigmas(prediction_type):
    """SD's Euler scheduler (the tiny SD and SDXL models use it): latents are x0 + σ·ε, not DDPM-scaled."""
    scheduler = EulerDiscreteScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, prediction_type=prediction_type
    )
    scheduler.set_timesteps(10)
    assert float(scheduler.init_noise_sigma) != 1.0
    sample, prediction = _tensors(2)
    index = 4
    sigma = float(scheduler.sigmas[index])
    by_hand = {
        "epsilon": sample - sigma * prediction,
        "v_prediction": prediction * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1),
    }[prediction_type]
    timestep = scheduler.timesteps[index]
    clean = clean_latents(scheduler, index, timestep, prediction, sample)
    torch.testing.assert_close(clean, by_hand)
    scheduler.set_begin_index(index)
    torch.testing.assert_close(clean, scheduler.step(prediction, timestep, sample).pred_original_sample)


class _LinearVae(torch.nn.Module):
    """A VAE whose latents are a known affine map of the mean colour of each 2x2 pixel block: the projection
    fitted to it must invert that map."""

    def __init__(self, channels: int, video: bool):
        super().__init__()
        generator = torch.Generator().manual_seed(channels)
        self.mix = torch.nn.Parameter(torch.randn(channels, 3, generator=generator), requires_grad=False)
        self.shift = torch.nn.Parameter(torch.randn(channels, generator=generator), requires_grad=False)
        self.video = video

    def encode(self, pixels: torch.Tensor):
        if self.video:  # [n, 3, f, h, w]: each frame alone, as the causal video VAEs do the first
            n, _, frames, h, w = pixels.shape
            flat = pixels.permute(0, 2, 1, 3, 4).reshape(n * frames, 3, h, w)
            latents = self._encode(flat)
            latents = latents.reshape(n, frames, *latents.shape[1:]).permute(0, 2, 1, 3, 4)
        else:
            latents = self._encode(pixels)

        class Distribution:
            @staticmethod
            def mode():
                return latents

        return type("Encoded", (), {"latent_dist": Distribution})()

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        rgb = (F.avg_pool2d(pixels, 2) + 1) / 2
        return torch.einsum("nkhw,ck->nchw", rgb, self.mix) + self.shift.view(1, -1, 1, 1)


@pytest.mark.parametrize("video", [False, True])
@pytest.mark.parametrize("channels", [4, 16])
def test_latent_projection_inverts_a_linear_vae(channels, video):
    vae = _LinearVae(channels, video)
    projection = LatentProjection(vae, video)
    assert projection.weights.shape == (channels + 1, 3)
    # Colours it was not fitted to, at another size.
    colours = torch.rand(3, 3, 5, 7, generator=torch.Generator().manual_seed(7))
    images = F.interpolate(colours, size=(40, 56), mode="bilinear", align_corners=False)
    pixels = images * 2 - 1
    latents = vae.encode(pixels.unsqueeze(2) if video else pixels).latent_dist.mode()
    rgb = projection(latents[:, :, 0] if video else latents)
    assert rgb.shape == (3, 3, 20, 28)
    torch.testing.assert_close(rgb, F.avg_pool2d(images, 2), atol=1e-4, rtol=0)


def _projection_error(vae, video: bool) -> tuple[float, float]:
    """Mean absolute error of the fitted projection on its own fitting images, and of their mean colour."""
    colours = torch.rand(LatentProjection.IMAGES, 3, 4, 4, generator=torch.Generator("cpu").manual_seed(0))
    size = LatentProjection.SIZE
    images = F.interpolate(colours, size=(size, size), mode="bilinear", align_corners=False)
    pixels = images * 2 - 1
    with torch.inference_mode():  # as the engine makes previews
        projection = LatentProjection(vae, video)
        latents = vae.encode(pixels.unsqueeze(2) if video else pixels).latent_dist.mode().float()
        latents = latents[:, :, 0] if video else latents
        target = F.adaptive_avg_pool2d(images, latents.shape[-2:])
        error = (projection(latents) - target).abs().mean().item()
    return error, (target - target.mean(dim=(0, 2, 3), keepdim=True)).abs().mean().item()


# --- end to end: AsyncOmni on every tiny family -------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(request):
    """``engines(family, mode)``: one AsyncOmni per family and execution mode for the whole module (max_num_seqs 2;
    requests run alone unless a test holds the engine), shut down at its end."""
    made: dict[tuple[str, str], AsyncOmni] = {}

    def get(family: str, mode: str) -> AsyncOmni:
        if (family, mode) not in made:
            model = request.getfixturevalue(f"tiny_{family}")
            made[family, mode] = AsyncOmni(model=model, max_num_seqs=2, execution_mode=mode)
        return made[family, mode]

    yield get
    for omni in made.values():
        omni.shutdown()


def _params(family: str, partial: int = 0, seed: int = 0, **kwargs) -> OmniDiffusionSamplingParams:
    """Non-square, so that a preview with width and height swapped shows; two outputs per prompt for images."""
    shape = {"num_frames": FRAMES[family]} if family in FRAMES else {"num_outputs_per_prompt": 2}
    values = dict(height=64, width=96, num_inference_steps=STEPS, seed=seed, partial_images=partial)
    return OmniDiffusionSamplingParams(**(values | shape | kwargs))


async def _collect(omni, params, prompt="a photo of a cat", request_id=None):
    return [out async for out in omni.generate(prompt, params, request_id=request_id)]


def _final_pixels(output) -> np.ndarray:
    """Every image (or every frame of every video) of a finished output, as integers."""
    assert output.finished and output.error is None
    items = [frame for video in output.videos for frame in video] if output.videos else output.images
    return np.stack([np.asarray(item, dtype=np.float64) for item in items])


def _as_255(pixels: np.ndarray) -> np.ndarray:
    return np.round(pixels * 255) if pixels.max() <= 1.0 else pixels


def _preview_pixels(output) -> np.ndarray:
    return np.stack([np.asarray(image, dtype=np.int16) for image in output.images])


def _check_stream(outputs, count: int, images: int, size=(96, 64), request_id=None):
    """``count`` previews, in order, each ``images`` images of ``size``; then one finished output."""
    *partial, final = outputs
    assert [(o.finished, o.partial_image_index) for o in partial] == [(False, i) for i in range(count)]
    for output in partial:
        assert output.metrics is None and output.error is None and output.videos == []
        assert [image.size for image in output.images] == [size] * images
        assert all(image.mode == "RGB" for image in output.images)
        if request_id is not None:
            assert output.request_id == request_id
    assert final.finished and final.partial_image_index is None and final.metrics is not None
    return partial, final


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
async def test_previews_arrive_in_order_before_the_unchanged_output(family, engines):
    """partial_images=3 on 4 steps: previews after steps 1, 2 and 3, each one image per output (for video, one
    frame), then the output, pixel-equal to the same seed's without previews; both modes make the same previews."""
    outputs_per_prompt = 1 if family in FRAMES else 2
    previews = {}
    for mode in MODES:
        omni = engines(family, mode)
        (plain,) = await _collect(omni, _params(family, 0, seed=3))
        outputs = await _collect(omni, _params(family, 3, seed=3), request_id=f"{family}-{mode}")
        partial, final = _check_stream(outputs, 3, outputs_per_prompt, request_id=f"{family}-{mode}")
        if family in FRAMES:
            assert final.images == [] and [len(video) for video in final.videos] == [FRAMES[family]]
        else:
            assert [image.size for image in final.images] == [(96, 64)] * 2
        assert np.array_equal(_final_pixels(final), _final_pixels(plain)), f"{family} {mode}: previews changed it"
        previews[mode] = [_preview_pixels(output) for output in partial]
        # Each is made from that step's own prediction: not the same picture three times.
        assert not all(np.array_equal(previews[mode][0], p) for p in previews[mode][1:])
    for i, (one, other) in enumerate(zip(previews["request"], previews["step"], strict=True)):
        worst = np.abs(one - other).max()
        assert worst <= 3, f"{family} preview {i}: request and step mode differ by {worst}/255"


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("flux2", "its decoder blocks read latent_ids"),
        ("ltx", "its decoder blocks read dtype"),
        ("hunyuan_video15", "its call takes no callback_on_step_end"),
    ],
)
async def test_families_that_preview_in_step_mode_only(family, why, engines):
    """FLUX.2's decoder blocks read the latents' position ids and LTX's their dtype, which the stock loop does not
    hand on, and HunyuanVideo 1.5's call has no step callback: request mode refuses previews naming that, step mode
    streams them."""
    params = _params(family, 2, seed=1)
    with pytest.raises(SamplingParamsError, match=f"{why}; use 'step'") as refused:
        await _collect(engines(family, "request"), params)
    assert refused.value.param == "partial_images"
    outputs = await _collect(engines(family, "step"), params)
    partial, final = _check_stream(outputs, 2, 1 if family in FRAMES else 2)
    (plain,) = await _collect(engines(family, "step"), _params(family, 0, seed=1))
    assert np.array_equal(_final_pixels(final), _final_pixels(plain))
    assert not np.array_equal(_preview_pixels(partial[0]), _preview_pixels(partial[1]))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_previews_count_the_steps_a_request_really_runs(mode, engines):
    """Fewer steps than previews: fewer previews. Image-to-image at strength 0.5 runs half its steps."""
    omni = engines("flux", mode)
    outputs = await _collect(omni, _params("flux", 3, num_inference_steps=2))
    _check_stream(outputs, 1, 2)
    edit = {"image": [noise_image(0, size=64)], "strength": 0.5, "num_inference_steps": 8}
    (plain,) = await _collect(omni, _params("flux", 0, **edit))
    outputs = await _collect(omni, _params("flux", 3, **edit))
    _, final = _check_stream(outputs, 3, 2)  # 4 steps run: after steps 1, 2, 3 of them
    assert np.array_equal(_final_pixels(final), _final_pixels(plain))
    outputs = await _collect(omni, _params("flux", 2, **edit | {"strength": 0.25}))  # 2 steps run
    _check_stream(outputs, 1, 2)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_the_latent_projection_of_a_family_fits_its_own_vae(family, engines):
    """The real (random-weight, seeded) VAEs: the fitted map reproduces the colours of its fitting images clearly
    better than their mean colour does (flux 0.14 vs 0.18, sd3 0.11 vs 0.18). Whether a preview resembles the final
    image cannot be tested on random weights: their decoder is no inverse of their encoder (the previews of the
    tiny models are further from their final images than a grey image is)."""
    pipeline = engines(family, "request").engine.stages[0].replicas[0].engine.runner.pipeline
    error, mean_colour = _projection_error(pipeline.vae, family == "wan")
    assert error < 0.85 * mean_colour, (error, mean_colour)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_a_failing_preview_is_logged_and_the_request_still_completes(mode, engines, monkeypatch, caplog):
    omni = engines("flux", mode)
    (plain,) = await _collect(omni, _params("flux", 0, seed=5))
    images, calls = Previews.images, []

    def fails_the_second(self, clean, params, state=None):
        calls.append(len(clean))
        if len(calls) == 2:
            raise RuntimeError("preview fault")
        return images(self, clean, params, state)

    monkeypatch.setattr(Previews, "images", fails_the_second)
    with caplog.at_level(logging.WARNING, logger="vllm_omni"):
        outputs = await _collect(omni, _params("flux", 3, seed=5), request_id=f"faulty-{mode}")
    _, final = _check_stream(outputs, 1, 2)  # the first preview; none after the one that failed
    assert calls == [2, 2]
    assert np.array_equal(_final_pixels(final), _final_pixels(plain))
    assert f"preview of request faulty-{mode} failed: RuntimeError: preview fault" in caplog.text


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_a_caller_that_cannot_take_a_preview_does_not_fail_the_engine(mode, engines, caplog):
    """``on_preview`` raising (what ``call_soon_threadsafe`` does once the caller's event loop is closed): the
    request completes without more previews and the engine keeps serving (step mode once lost its engine loop)."""
    omni = engines("flux", mode)
    (plain,) = await _collect(omni, _params("flux", 0, seed=6))
    taken = []

    def closed(preview):
        taken.append(preview.index)
        raise RuntimeError("Event loop is closed")

    with caplog.at_level(logging.WARNING, logger="vllm_omni"):
        future = omni.engine.add_request(f"gone-{mode}", "a photo of a cat", _params("flux", 3, seed=6), closed)
        output = await asyncio.wrap_future(future)
    assert taken == [0]
    assert np.array_equal(_final_pixels(output), _final_pixels(plain))
    assert f"preview of request gone-{mode} failed: RuntimeError: Event loop is closed" in caplog.text
    assert [h.alive for h in omni.health()] == [[0]]
    (again,) = await _collect(omni, _params("flux", 0, seed=6))
    assert np.array_equal(_final_pixels(again), _final_pixels(plain))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_no_previews_cost_nothing(mode, engines, monkeypatch):
    """partial_images=0: no preview is computed and request mode leaves the pipeline's scheduler alone. The same
    spies see a request with a preview, so they can see work."""
    omni = engines("flux", mode)
    engine = omni.engine.stages[0].replicas[0].engine
    pipeline = engine.runner.pipeline
    work = []
    for name in ("images", "emit"):
        original = getattr(Previews, name)
        monkeypatch.setattr(Previews, name, lambda *a, _o=original, _n=name, **k: work.append(_n) or _o(*a, **k))
    original_clean = clean_latents
    spy_clean = lambda *a, **k: work.append("clean_latents") or original_clean(*a, **k)  # noqa: E731
    monkeypatch.setattr(denoise, "clean_latents", spy_clean)
    monkeypatch.setattr(previews_module, "clean_latents", spy_clean)
    submitted, add = [], engine.scheduler.add
    monkeypatch.setattr(engine.scheduler, "add", lambda request: submitted.append(request) or add(request))
    wrapped = []  # per forward: whether the pipeline's scheduler.step is wrapped
    handle = pipeline.transformer.register_forward_pre_hook(
        lambda *_: wrapped.append("step" in vars(pipeline.scheduler))
    )
    try:
        outputs = await _collect(omni, _params("flux", 0))
        assert len(outputs) == 1 and outputs[0].finished
        assert work == [] and not any(wrapped) and len(wrapped) >= STEPS
        assert [r.on_preview for r in submitted] == [None]

        outputs = await _collect(omni, _params("flux", 1))
    finally:
        handle.remove()
    assert len(outputs) == 2
    assert work == ["clean_latents", "emit", "images"]
    assert any(wrapped) == (mode == "request")  # step mode steps its own schedulers
    assert "step" not in vars(pipeline.scheduler)  # unwrapped again


def _hold_engine(scheduler) -> tuple[threading.Event, threading.Event]:
    """Occupy the engine's thread with an engine call until the second event is set (the first: it holds it), so
    that requests submitted meanwhile are all waiting when its next batch is formed."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        holding.set()
        assert release.wait(120), "the test never released the engine"

    scheduler.call(hold)
    return holding, release


async def _until(predicate, timeout=60.0):
    """Wait for a state of the engine the test itself brought about (never for the engine's speed)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def _one_batch(omni, params: list[OmniDiffusionSamplingParams]) -> list[list]:
    scheduler = omni.engine.stages[0].replicas[0].engine.scheduler
    holding, release = _hold_engine(scheduler)
    try:
        assert await asyncio.to_thread(holding.wait, 60)
        tasks = [asyncio.create_task(_collect(omni, p, prompt=f"prompt {i}")) for i, p in enumerate(params)]
        await _until(lambda: scheduler.num_waiting == len(params))
    finally:
        release.set()
    return await asyncio.gather(*tasks)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", MODES)
async def test_only_the_request_that_asks_gets_previews_in_a_shared_batch(mode, engines):
    omni = engines("flux", mode)
    plain = await _one_batch(omni, [_params("flux", 0, seed=1), _params("flux", 0, seed=2)])
    mixed = await _one_batch(omni, [_params("flux", 2, seed=1), _params("flux", 0, seed=2)])
    assert [o.metrics["batch_size"] for (o,) in plain] == [2, 2]
    with_previews, without = mixed
    _check_stream(with_previews, 2, 2)
    assert len(without) == 1 and without[0].finished
    assert [o.metrics["batch_size"] for o in (with_previews[-1], without[0])] == [2, 2]
    for (want,), got in zip(plain, (with_previews[-1], without[0]), strict=True):
        assert np.array_equal(_final_pixels(got), _final_pixels(want))


# --- a split deployment: the denoise stage makes them ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("denoise_mode", MODES)
async def test_a_split_deployment_streams_the_previews_of_its_denoise_stage(denoise_mode, tiny_flux):
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], execution_mode=denoise_mode),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    async with AsyncOmni(model=tiny_flux, deploy_config=deploy) as omni:
        handed = []  # (stage, whether it was given an on_preview)
        for stage in omni.engine.stages:
            replica, submit = stage.replicas[0], stage.replicas[0].submit

            def recording(*args, _stage=stage.stage_id, _submit=submit):
                handed.append((_stage, args[4] is not None))
                return _submit(*args)

            replica.submit = recording
        (plain,) = await _collect(omni, _params("flux", 0, seed=4))
        outputs = await _collect(omni, _params("flux", 3, seed=4))
    _, final = _check_stream(outputs, 3, 2)
    assert np.array_equal(_final_pixels(final), _final_pixels(plain))
    assert [s["stage_type"] for s in final.metrics["stages"]] == ["encode", "denoise", "decode"]
    assert handed == [(0, False), (1, False), (2, False), (0, False), (1, True), (2, False)]


# --- what is refused --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.e2e
def test_omni_generate_refuses_partial_images(tiny_flux):
    with Omni(model=tiny_flux) as omni:
        params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1, partial_images=1)
        with pytest.raises(ValueError, match="partial_images"):
            omni.generate(["a cat"], params)
        with pytest.raises(ValueError, match="partial_images"):
            omni.generate(["a cat", "a dog"], [params.model_copy(update={"partial_images": 0}), omni.admit(params)])
        assert omni.num_waiting == 0
        (output,) = omni.generate(["a cat"], params.model_copy(update={"partial_images": 0}))
        assert output.error is None


def test_partial_images_are_bounded():
    assert OmniDiffusionSamplingParams(partial_images=3).partial_images == 3
    for bad in (-1, 4):
        with pytest.raises(ValueError, match="partial_images"):
            OmniDiffusionSamplingParams(partial_images=bad)


@pytest.mark.slow
@pytest.mark.e2e
async def test_a_family_without_a_stepper_refuses_partial_images_at_admission(tiny_kontext):
    """FluxKontextPipeline has no stepper, so no previews: refused before anything runs, naming the field."""
    async with AsyncOmni(model=tiny_kontext) as omni:
        params = OmniDiffusionSamplingParams(
            height=32, width=32, num_inference_steps=1, image=[noise_image(0, size=32)], partial_images=1
        )
        with pytest.raises(SamplingParamsError, match="FluxKontextPipeline cannot show partial images") as refused:
            omni.admit(params)
        assert refused.value.param == "partial_images"
        with pytest.raises(SamplingParamsError, match="partial_images"):
            await _collect(omni, params)
        assert omni.engine.stages[0].replicas[0].engine.role.previews is None
        (output,) = await _collect(omni, params.model_copy(update={"partial_images": 0}))
        assert output.finished and len(output.images) == 1
