"""Image-to-image and inpainting in step mode and split stages against the stock ``from_pipe`` image pipelines:
requests of different tasks and strengths join a running batch (with a text request) at different engine steps
and end with the image the stock pipeline makes for them alone, within 2/255."""

import functools
import inspect
import pickle

import diffusers
import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting, DiffusionPipeline, UNet2DConditionModel
from PIL import Image

from vllm_omni.diffusion.families.steppers import SPLIT, make_stepper
from vllm_omni.diffusion.pipeline.components import DENOISERS, TEXT_ENCODERS
from vllm_omni.diffusion.pipeline.image_inputs import fitted_inputs
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams
from vllm_omni.testing.checks.steppers import run_joined

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")
SIZE = {"height": 64, "width": 64}


def _load(path: str, scheduler: str | None = None):
    pipeline = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    if scheduler is not None:  # built anew, so that its __init__ sees the scheduler (as loading it would)
        swapped = getattr(diffusers, scheduler).from_config(pipeline.scheduler.config)
        pipeline = type(pipeline)(**{**pipeline.components, "scheduler": swapped})
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _image(seed: int) -> Image.Image:
    """A 96x80 picture (fitted to 64x64 as request mode fits it): a gradient with noise, different per seed."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, 96)[None, :, None] * rng.uniform(0.2, 1.0, (1, 1, 3))
    pixels = ramp + rng.normal(0, 40, (80, 96, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


MASK = Image.fromarray(np.pad(np.full((40, 36), 255, np.uint8), ((10, 30), (20, 40))))
"""White (repaint) over a box of the 96x80 picture, black elsewhere."""


def _params(image: int | None = None, mask: bool = False, **kwargs) -> OmniDiffusionSamplingParams:
    inputs = {} if image is None else {"image": _image(image), "mask_image": MASK if mask else None}
    return OmniDiffusionSamplingParams(output_type="np", **SIZE, **inputs, **kwargs)


def _stock(pipeline, prompt: str, params: OmniDiffusionSamplingParams, seed: int) -> np.ndarray:
    """The stock pipeline of the request's task (``from_pipe`` for an image task), this request alone, called as the
    request-mode runner calls it."""
    n = params.num_outputs_per_prompt
    kwargs = dict(
        prompt=prompt,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        output_type="np",
        generator=[torch.Generator("cpu").manual_seed(seed)] * n,
        num_images_per_prompt=n,
        **params.extra_args,
    )
    if params.task != "text":
        auto = AutoPipelineForInpainting if params.task == "inpaint" else AutoPipelineForImage2Image
        pipeline = auto.from_pipe(pipeline)
        pipeline.set_progress_bar_config(disable=True)
        images, mask = fitted_inputs(params)
        kwargs.update(image=[images[0]] * n, strength=params.strength)
        if mask is not None:
            kwargs["mask_image"] = [mask] * n
    if "height" in inspect.signature(type(pipeline).__call__).parameters:  # not SD's image-to-image
        kwargs.update(height=params.height, width=params.width)
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = params.negative_prompt
    return np.asarray(pipeline(**kwargs).images)


def _check(pipeline, script) -> dict[str, np.ndarray]:
    """Each request of ``script`` in step mode within 2/255 of the stock pipeline alone; the outputs by name."""
    outputs, largest = run_joined(make_stepper(pipeline, CPU), script)
    assert largest >= 3, "the script should make requests share forwards"
    got = {name: np.asarray(outputs[name], dtype=np.float64) for _, name, _, _, _ in script}
    for _, name, prompt, params, seed in script:
        want = _stock(pipeline, prompt, params, seed)
        assert got[name].shape == want.shape, name
        worst = np.abs(np.round(got[name] * 255) - np.round(want * 255)).max()
        assert worst <= 2, f"{name}: worst pixel difference {worst}/255 against the stock pipeline alone"
    return got


def _script(guidance: float, **extra):
    """Image-to-image and inpainting requests of strengths 0.3-1 joining a text request at different steps."""
    return [
        (0, "text", "a photo of a cat", _params(num_inference_steps=4, guidance_scale=guidance), 1),
        (0, "image", "a red car", _params(image=1, num_inference_steps=4, guidance_scale=guidance, strength=0.75), 2),
        (
            1,
            "inpaint",
            "a blue house",
            _params(
                image=1,
                mask=True,
                num_inference_steps=4,
                guidance_scale=guidance,
                strength=1.0,
                negative_prompt="a dog",
            ),
            3,
        ),
        (
            2,
            "inpaint half",
            "a small tree",
            _params(image=2, mask=True, num_inference_steps=4, guidance_scale=guidance, strength=0.5, **extra),
            4,
        ),
        (
            2,
            "image low, 2 outputs",
            "a green horse",
            _params(image=2, num_inference_steps=4, guidance_scale=1.0, strength=0.3, num_outputs_per_prompt=2),
            5,
        ),
    ]


def test_stable_diffusion_image_tasks_join_at_different_steps(tiny_sd):
    _check(_load(tiny_sd), _script(7.5))


@pytest.mark.parametrize("scheduler", ["EulerAncestralDiscreteScheduler", "DDIMScheduler"])
def test_stable_diffusion_schedulers_keep_their_semantics(tiny_sd, scheduler):
    """Euler-a draws noise every step, after the inpaint pipeline's draws of the masked image; DDIM noises the image
    by timestep value."""
    _check(
        _load(tiny_sd, scheduler),
        [
            (0, "text", "a photo of a cat", _params(num_inference_steps=3, guidance_scale=1.0), 1),
            (0, "image", "a red car", _params(image=1, num_inference_steps=3, guidance_scale=1.0, strength=0.7), 2),
            (
                1,
                "inpaint",
                "a blue house",
                _params(image=2, mask=True, num_inference_steps=3, guidance_scale=1.0, strength=0.7),
                3,
            ),
        ],
    )


def test_flux_image_tasks_join_at_different_steps(tiny_flux):
    """Flux counts a strength's steps after subtracting (0.3 of 4 steps runs 2) and inpaints at strength 1 from its
    image noised to σ=1; "inpaint half" uses true CFG."""
    _check(_load(tiny_flux), _script(3.5, negative_prompt="a dog", extra_args={"true_cfg_scale": 2.0}))


@pytest.mark.parametrize("family", ["tiny_sdxl", "tiny_sd3"])
def test_sdxl_and_sd3_image_tasks_join_at_different_steps(family, request):
    """SD3's inpaint pipeline decodes without the VAE's shift_factor: its requests here too."""
    _check(
        _load(request.getfixturevalue(family)),
        [
            (0, "text", "a photo of a cat", _params(num_inference_steps=4, guidance_scale=5.0), 1),
            (1, "image", "a red car", _params(image=1, num_inference_steps=4, guidance_scale=5.0, strength=0.6), 2),
            (
                1,
                "inpaint",
                "a blue house",
                _params(image=2, mask=True, num_inference_steps=4, guidance_scale=1.0, strength=1.0),
                3,
            ),
            (
                2,
                "inpaint half",
                "a small tree",
                _params(image=1, mask=True, num_inference_steps=4, guidance_scale=5.0, strength=0.5),
                4,
            ),
        ],
    )


@pytest.mark.parametrize("family", ["tiny_sd", "tiny_flux"])
def test_split_stages_equal_step_mode(family, request):
    """The encode stage (no denoiser) encodes prompts and images; its Conditioning, pickled as to a Ray replica,
    starts the request in a denoise stage (no text encoders): the images of one diffusion stage in step mode."""
    path = request.getfixturevalue(family)
    low = next(entry for entry in _script(1.0) if entry[1] == "image low, 2 outputs")
    script = [*_script(1.0), (3, "image low, other image", low[2], low[3].model_copy(update={"image": [_image(3)]}), 5)]
    want, _ = run_joined(make_stepper(_load(path), CPU), script)
    encoder = make_stepper(load_pipeline(path, torch.float32, CPU, DENOISERS), CPU, SPLIT)
    denoiser = make_stepper(load_pipeline(path, torch.float32, CPU, TEXT_ENCODERS), CPU, SPLIT)

    def begin(prompt: str, params: OmniDiffusionSamplingParams, seed: int):
        conditioning = pickle.loads(pickle.dumps(encoder.encode([prompt], [params])[0]))
        assert (conditioning.image is None) == (params.task == "text")
        return denoiser.start(conditioning, params, seed)

    got, _ = run_joined(denoiser, script, begin)
    for _, name, _, _, _ in script:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    # The input image matters: the same request with another one.
    assert np.abs(np.asarray(want["image low, 2 outputs"]) - np.asarray(want["image low, other image"])).max() > 0.05


def test_image_tasks_share_forwards_with_text_requests(tiny_flux):
    stepper = make_stepper(_load(tiny_flux), CPU)
    key = functools.partial(stepper.key, stepper.card)
    text = _params(num_inference_steps=4, guidance_scale=3.5)
    assert key(text) == key(_params(image=1, num_inference_steps=8, guidance_scale=3.5, strength=0.5))
    assert key(text) == key(_params(image=1, mask=True, num_inference_steps=4, guidance_scale=3.5, strength=1.0))


def test_image_tasks_a_stepper_cannot_run_are_refused(tiny_sd, tiny_wan):
    wan = make_stepper(_load(tiny_wan), CPU)
    video = {"num_inference_steps": 4, "guidance_scale": 5.0, "num_frames": 5, "strength": 0.6}
    for mask, field in ((False, "image"), (True, "mask_image")):
        with pytest.raises(SamplingParamsError, match=f"{field} is not supported by WanPipeline") as excinfo:
            wan.check_params(wan.card, _params(image=1, mask=mask, **video))
        assert excinfo.value.param == field
    pipeline = _load(tiny_sd)
    inpainting_unet = UNet2DConditionModel.from_config({**pipeline.unet.config, "in_channels": 9})
    inpainting = type(pipeline)(**{**pipeline.components, "unet": inpainting_unet})
    with pytest.raises(ValueError, match=r"does not support inpainting UNets \(9 input channels"):
        make_stepper(inpainting, CPU)
