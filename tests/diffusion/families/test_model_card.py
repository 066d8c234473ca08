"""`ModelCard` for image inputs: which pipeline serves each task, how its defaults complete a request, what is
refused (naming the field) and what it drops as a field the model would not use, read from loaded tiny
pipelines."""

import dataclasses

import pytest
from diffusers import DiffusionPipeline
from PIL import Image

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.pipeline_facts import TWO_EXPERT_ARGS
from vllm_omni.errors import SamplingParamsError
from vllm_omni.outputs import IgnoredField
from vllm_omni.sampling_params import OmniDiffusionSamplingParams
from vllm_omni.testing.checks.edits import noise_image, square_mask


def card_of(path: str) -> ModelCard:
    return ModelCard.of(DiffusionPipeline.from_pretrained(path, local_files_only=True))


def complete(card: ModelCard, **fields) -> OmniDiffusionSamplingParams:
    """``fields`` completed by ``card``, which drops none of them."""
    params, ignored = card.complete_params(OmniDiffusionSamplingParams(**fields))
    assert ignored == (), ignored
    return params


def dropped(card: ModelCard, **fields) -> tuple[OmniDiffusionSamplingParams, list[str]]:
    """``fields`` completed by ``card``, and the params of the fields it dropped as ones it would not use."""
    params, ignored = card.complete_params(OmniDiffusionSamplingParams(**fields))
    assert all(isinstance(field, IgnoredField) and field.reason for field in ignored)
    return params, [field.param for field in ignored]


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
    edited = complete(sd, image=image)
    assert (edited.height, edited.width, edited.strength) == (64, 64, 0.6)
    inpainted = complete(sd, image=image, mask_image=Image.new("L", (70, 70)))
    assert inpainted.strength == 1.0
    sized = complete(sd, image=image, height=32, width=48, strength=0.3)
    assert (sized.height, sized.width, sized.strength) == (32, 48, 0.3)
    assert complete(sd).strength is None  # text: no strength


def test_the_steps_a_strength_keeps_are_counted_as_each_family_counts_them(sd, flux):
    # SD's image pipelines keep int(4 * 0.3) = 1 step; the flow-matching ones drop int(4 - 1.2) = 2 and keep 2.
    assert (sd.strength_offset(4, 0.3), flux.strength_offset(4, 0.3)) == (3, 2)
    with pytest.raises(SamplingParamsError) as refused:
        sd.complete_params(OmniDiffusionSamplingParams(image=noise_image(0), strength=0.2, num_inference_steps=4))
    assert refused.value.param == "strength" and "no denoising step" in str(refused.value)
    complete(flux, image=noise_image(0), strength=0.2, num_inference_steps=4)


def test_what_a_pipeline_cannot_take_is_refused_naming_the_field(sd, flux, tiny_wan):
    wan = card_of(tiny_wan)
    cases = [
        (wan, dict(image=noise_image(0)), "image"),
        (sd, dict(image=[noise_image(0), noise_image(1)]), "image"),
        (flux, dict(num_frames=5), "num_frames"),  # a video from an image model: not what it makes
        (flux, dict(audio_length=1.0), "audio_length"),  # audio from an image or video model, neither
        (wan, dict(audio_start=0.5), "audio_start"),
        (sd, dict(extra_args={"steps": 2}), "extra_args.steps"),  # not a field at all
        (sd, dict(extra_args={"generator": None}), "extra_args.generator"),
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


def test_what_a_pipeline_would_not_use_is_dropped_in_the_order_checked(sd, flux, tiny_wan):
    """Each field that tunes something the pipeline does not have: the completion is the one without it."""
    wan = card_of(tiny_wan)
    cases = [
        (sd, dict(strength=0.5), ["strength"]),  # text-to-image: no image to noise
        (sd, dict(image=noise_image(0), extra_args={"true_cfg_scale": 2.0}), ["extra_args.true_cfg_scale"]),
        (flux, dict(negative_prompt="blurry"), ["negative_prompt"]),  # true_cfg_scale is 1
        (flux, dict(extra_args={"true_cfg_scale": 3.0}), ["extra_args.true_cfg_scale"]),  # no negative_prompt
        (sd, dict(negative_prompt="blurry", guidance_scale=1.0), ["negative_prompt"]),
        (
            wan,
            dict(extra_args={"guidance_scale_2": 3.0, "boundary_ratio": 0.5}),
            [f"extra_args.{a}" for a in TWO_EXPERT_ARGS],
        ),
        (
            wan,
            dict(negative_prompt="blurry", guidance_scale=1.0, extra_args={"true_cfg_scale": 4.0, "flow_shift": 2.0}),
            ["extra_args.true_cfg_scale", "negative_prompt"],
        ),
    ]
    for card, fields, params in cases:
        completed, ignored = dropped(card, **fields)
        assert ignored == params, (card.pipeline_name, fields)
        without = {k: v for k, v in fields.items() if k not in params}
        kept_args = {k: v for k, v in fields.get("extra_args", {}).items() if f"extra_args.{k}" not in params}
        assert completed == complete(card, **{**without, "extra_args": kept_args}), (card.pipeline_name, fields)


def test_flow_shift_sets_the_schedulers_fixed_shift_and_is_dropped_without_one(flux, sd):
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from vllm_omni.diffusion.families.pipeline_facts import flow_shift_key

    assert flow_shift_key(UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0)) == "flow_shift"  # Wan's
    assert flow_shift_key(FlowMatchEulerDiscreteScheduler(shift=3.0)) == "shift"  # SD3's
    assert flow_shift_key(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)) is None  # FLUX.1's
    assert flow_shift_key(DDIMScheduler()) is None
    dynamic = dataclasses.replace(flux, flow_shift_key=None)  # as FLUX.1's own folder
    for card, why in ((dynamic, "shifts by image size"), (sd, "is not a flow-matching one")):
        completed, ignored = card.complete_params(OmniDiffusionSamplingParams(extra_args={"flow_shift": 2.0}))
        assert [field.param for field in ignored] == ["extra_args.flow_shift"] and why in ignored[0].reason
        assert completed.extra_args == {} and card.scheduler_overrides(completed) == {}
    shifted = complete(flux, extra_args={"flow_shift": 2.0})
    assert flux.scheduler_overrides(shifted) == {"shift": 2.0}


def test_guidance_scale_of_a_model_without_a_guidance_embedding_is_dropped(tiny_flux_schnell, flux):
    schnell = card_of(tiny_flux_schnell)
    assert schnell.ignores_guidance_scale and not flux.ignores_guidance_scale
    completed, ignored = schnell.complete_params(OmniDiffusionSamplingParams(guidance_scale=7.5))
    assert [field.param for field in ignored] == ["guidance_scale"] and "no guidance embedding" in ignored[0].reason
    assert completed == complete(schnell)  # its default still runs, as without the field
    assert complete(schnell).guidance_scale == 3.5


def _frames(count: int, size: int = 32) -> list[Image.Image]:
    return [noise_image(i, size=size) for i in range(count)]


def test_a_text_to_video_model_remixes_with_its_video_to_video_variant(tiny_wan):
    wan = card_of(tiny_wan)
    assert wan.tasks == {"text", "video"} and wan.for_task("text") is wan
    variant = wan.for_task("video")
    assert variant.pipeline_name == "WanVideoToVideoPipeline" and variant.output == "video"
    assert not variant.batches_images  # one video per call: a remix runs alone
    remix = complete(wan, video=_frames(9), num_inference_steps=2, fps=8)
    assert (remix.height, remix.width, remix.num_frames, remix.fps, remix.strength) == (32, 32, 9, 8, 0.8)
    assert remix.task == "video"
    # WanVideoToVideoPipeline.get_timesteps keeps int(4 * 0.6) = 2 steps, whatever its flow-matching scheduler.
    assert variant.strength_offset(4, 0.6) == 2


def test_what_a_remix_cannot_take_is_refused_naming_the_field(tiny_wan, tiny_wan_i2v, tiny_wan22):
    wan, i2v, wan22 = card_of(tiny_wan), card_of(tiny_wan_i2v), card_of(tiny_wan22)
    assert wan22.tasks == {"text"}  # WanVideoToVideoPipeline has no second expert: from_pipe would drop it
    cases = [
        (i2v, dict(video=_frames(5)), "video", "WanImageToVideoPipeline has no video-to-video variant"),
        (wan22, dict(video=_frames(5)), "video", "WanPipeline has no video-to-video variant"),
        (wan, dict(video=_frames(9), num_frames=5), "num_frames", "the input video has 9 frames"),
        (wan, dict(video=_frames(8)), "num_frames", "1 more than a multiple of 4"),
        (wan, dict(video=_frames(5), extra_args={"video": None}), "extra_args.video", "set by vllm-omni"),
    ]
    for card, fields, param, why in cases:
        with pytest.raises(SamplingParamsError, match=why) as refused:
            card.complete_params(OmniDiffusionSamplingParams(**fields))
        assert refused.value.param == param, fields
    with pytest.raises(ValueError, match="an input video or input images, not both"):
        OmniDiffusionSamplingParams(image=noise_image(0), video=_frames(5))
