"""`ModelCard` for image inputs: which pipeline serves each task, how its defaults complete a request, and what is
refused (naming the field), read from loaded tiny pipelines."""

import dataclasses

import pytest
from diffusers import DiffusionPipeline
from PIL import Image

from vllm_omni.diffusion.model_card import ModelCard
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams
from vllm_omni.testing.edits import noise_image, square_mask


def card_of(path: str) -> ModelCard:
    return ModelCard.of(DiffusionPipeline.from_pretrained(path, local_files_only=True))


@pytest.fixture(scope="module")
def sd(tiny_sd):
    return card_of(tiny_sd)


@pytest.fixture(scope="module")
def flux(tiny_flux):
    return card_of(tiny_flux)


def test_a_text_to_image_model_serves_edits_by_its_diffusers_variants(sd, flux):
    assert sd.tasks == flux.tasks == {"text", "image", "inpaint"}
    assert sd.for_task("image").pipeline_name == "StableDiffusionImg2ImgPipeline"
    assert flux.for_task("inpaint").pipeline_name == "FluxInpaintPipeline"
    assert sd.for_task("text") is sd


def test_edits_complete_with_the_image_size_and_the_task_strength(sd):
    image = noise_image(0, size=70)  # 70 is not a multiple of 8
    edited = sd.complete_params(OmniDiffusionSamplingParams(image=image))
    assert (edited.height, edited.width, edited.strength) == (64, 64, 0.6)
    inpainted = sd.complete_params(OmniDiffusionSamplingParams(image=image, mask_image=Image.new("L", (70, 70))))
    assert inpainted.strength == 1.0
    sized = sd.complete_params(OmniDiffusionSamplingParams(image=image, height=32, width=48, strength=0.3))
    assert (sized.height, sized.width, sized.strength) == (32, 48, 0.3)
    assert sd.complete_params(OmniDiffusionSamplingParams()).strength is None  # text: no strength


def test_the_steps_a_strength_keeps_are_counted_as_each_family_counts_them(sd, flux):
    # SD's image pipelines keep int(4 * 0.3) = 1 step; the flow-matching ones drop int(4 - 1.2) = 2 and keep 2.
    assert (sd.strength_offset(4, 0.3), flux.strength_offset(4, 0.3)) == (3, 2)
    with pytest.raises(SamplingParamsError) as refused:
        sd.complete_params(OmniDiffusionSamplingParams(image=noise_image(0), strength=0.2, num_inference_steps=4))
    assert refused.value.param == "strength" and "no denoising step" in str(refused.value)
    flux.complete_params(OmniDiffusionSamplingParams(image=noise_image(0), strength=0.2, num_inference_steps=4))


def test_what_a_pipeline_cannot_take_is_refused_naming_the_field(sd, tiny_wan):
    wan = card_of(tiny_wan)
    cases = [
        (wan, dict(image=noise_image(0)), "image"),
        (sd, dict(image=[noise_image(0), noise_image(1)]), "image"),
        (sd, dict(strength=0.5), "strength"),
        (sd, dict(image=noise_image(0), extra_args={"true_cfg_scale": 2.0}), "extra_args.true_cfg_scale"),
    ]
    for card, fields, param in cases:
        with pytest.raises(SamplingParamsError) as refused:
            card.complete_params(OmniDiffusionSamplingParams(**fields))
        assert refused.value.param == param, fields
    with pytest.raises(ValueError, match="mask_image is 32x32 and the image 64x64"):
        OmniDiffusionSamplingParams(image=noise_image(0), mask_image=square_mask(32))
    with pytest.raises(ValueError, match="mask_image needs an image"):
        OmniDiffusionSamplingParams(mask_image=square_mask())


def test_an_image_to_image_or_inpainting_folder_is_served_as_it_is(tiny_sd):
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    base = DiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True)
    img2img = ModelCard.of(StableDiffusionImg2ImgPipeline(**base.components))
    inpaint = ModelCard.of(StableDiffusionInpaintPipeline(**base.components))
    assert (img2img.tasks, inpaint.tasks) == ({"image"}, {"inpaint"})
    assert img2img.for_task("image") is img2img and inpaint.for_task("inpaint") is inpaint
    for card, fields, param in [
        (img2img, {}, "image"),
        (img2img, dict(image=noise_image(0), mask_image=square_mask()), "mask_image"),
        (inpaint, dict(image=noise_image(0)), "mask_image"),
        (inpaint, {}, "mask_image"),
    ]:
        with pytest.raises(SamplingParamsError) as refused:
            card.complete_params(OmniDiffusionSamplingParams(**fields))
        assert refused.value.param == param, (card.pipeline_name, fields)


def test_flow_shift_sets_the_schedulers_fixed_shift_and_is_refused_without_one(flux, sd):
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from vllm_omni.diffusion.model_card import flow_shift_key

    assert flow_shift_key(UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0)) == "flow_shift"  # Wan's
    assert flow_shift_key(FlowMatchEulerDiscreteScheduler(shift=3.0)) == "shift"  # SD3's
    assert flow_shift_key(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) is None  # FLUX.1's
    assert flow_shift_key(DDIMScheduler()) is None
    dynamic = dataclasses.replace(flux, flow_shift_key=None)  # as FLUX.1's own folder
    with pytest.raises(SamplingParamsError, match="shifts by image size") as caught:
        dynamic.complete_params(OmniDiffusionSamplingParams(extra_args={"flow_shift": 2.0}))
    assert caught.value.param == "extra_args.flow_shift"
    with pytest.raises(SamplingParamsError, match="is not a flow-matching one"):
        sd.complete_params(OmniDiffusionSamplingParams(extra_args={"flow_shift": 2.0}))
    shifted = flux.complete_params(OmniDiffusionSamplingParams(extra_args={"flow_shift": 2.0}))
    assert flux.scheduler_overrides(shifted) == {"shift": 2.0}


def test_guidance_scale_of_a_model_without_a_guidance_embedding_is_refused(tiny_flux_schnell, flux):
    schnell = card_of(tiny_flux_schnell)
    assert schnell.ignores_guidance_scale and not flux.ignores_guidance_scale
    with pytest.raises(SamplingParamsError, match="no guidance embedding") as caught:
        schnell.complete_params(OmniDiffusionSamplingParams(guidance_scale=3.5))
    assert caught.value.param == "guidance_scale"
    assert schnell.complete_params(OmniDiffusionSamplingParams()).guidance_scale == 3.5  # its default still runs
