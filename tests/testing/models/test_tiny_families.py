"""The families people serve now (`vllm_omni.testing.models.tiny_families`), served as they are through `Omni`: each
loads
as its real pipeline class, and two requests batched equal stock diffusers called alone. A pipeline whose call
sets its size inside (Z-Image) or works it out (HunyuanVideo 1.5) starts; a request whose output is not finite
fails naming the likely cause, in request mode and in step mode, and is never answered as an image."""

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams, SamplingParamsError
from vllm_omni.orchestrator.replica import warm_up_params
from vllm_omni.testing.checks.stock import stock_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["a photo of a cat", "a red car"]

FAMILIES = [  # fixture, pipeline class, what a 2-step call takes besides the prompt, and the Omni knobs
    ("tiny_qwen_image", "QwenImagePipeline", {}, {}),
    ("tiny_z_image", "ZImagePipeline", {}, {}),
    ("tiny_flux2", "Flux2KleinPipeline", {"guidance_scale": 1.0}, {}),  # step-distilled: run unguided, as klein is
    ("tiny_ltx", "LTXPipeline", {"num_frames": 9}, {}),
    # Its VAE's attention cannot decode two videos at once in diffusers 0.42 (a causal mask of the batch's shape
    # where the attention has one head): batched, it decodes one video at a time.
    ("tiny_hunyuan_video15", "HunyuanVideo15Pipeline", {"num_frames": 5}, {"vae_slicing": True}),
]


def _params(seed: int, **call) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=seed, output_type="np", **call)


def _stock(model: str, prompt: str, seed: int, **call) -> np.ndarray:
    out = stock_pipeline(model)(
        prompt=[prompt],
        generator=[torch.Generator("cpu").manual_seed(seed)],
        num_inference_steps=2,
        height=32,
        width=32,
        output_type="np",
        **call,
    )
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)[0]


STEPPED = [  # the families step mode runs through their modular blocks (vllm_omni.diffusion.families.steppers.modular)
    ("tiny_qwen_image", "QwenImagePipeline", {}, {"execution_mode": "step"}),
    ("tiny_z_image", "ZImagePipeline", {}, {"execution_mode": "step"}),
    ("tiny_ltx", "LTXPipeline", {"num_frames": 9}, {"execution_mode": "step"}),
]


@pytest.mark.parametrize(
    ("fixture", "pipeline_class", "call", "knobs"),
    FAMILIES + STEPPED,
    ids=[case[1] for case in FAMILIES] + [f"{case[1]}-step" for case in STEPPED],
)
def test_two_requests_batched_equal_stock_diffusers_alone(request, fixture, pipeline_class, call, knobs):
    model = request.getfixturevalue(fixture)
    stepped = knobs.get("execution_mode") == "step"  # requests join at the next step: no wait for a batch to form
    wait = {} if stepped else {"request_batch_max_wait_ms": 2000}
    with Omni(model=model, max_num_seqs=2, **wait, **knobs) as omni:
        assert omni.model_card.pipeline_name == pipeline_class  # model_index.json names the real classes
        outputs = omni.generate(PROMPTS, [_params(seed, **call) for seed in (1, 2)])
    made = []
    for output, prompt, seed in zip(outputs, PROMPTS, (1, 2), strict=True):
        # (whether two stepped requests overlap is the engine's timing: tests/diffusion/families/test_steppers.py
        # shares)
        assert output.error is None and (stepped or output.metrics["batch_size"] == 2)
        (item,) = output.videos if omni.model_card.output == "video" else output.images
        made.append(np.asarray(item))
        assert np.isfinite(made[-1]).all() and made[-1].std() > 1e-3, "a constant or broken output"
        assert np.abs(made[-1] - _stock(model, prompt, seed, **call)).max() * 255 <= 2
    assert np.abs(made[0] - made[1]).max() > 1e-3  # two prompts and seeds: the bar above tells outputs apart


@pytest.mark.parametrize(
    ("fixture", "size"),
    [("tiny_z_image", (1024, 1024)), ("tiny_hunyuan_video15", (24, 40))],  # ZImageModularPipeline's; a 16:9 bucket
)
def test_a_pipeline_that_sets_its_size_inside_its_call_starts(request, fixture, size):
    """Z-Image's call sets 1024x1024 inside (its modular pipeline declares it), HunyuanVideo 1.5's works one out from
    its aspect ratio: each card has it, so the warm-up (one step at the default size) is admitted, where it was
    refused with "has no default size"; a request without a size gets it."""
    with Omni(model=request.getfixturevalue(fixture), max_num_seqs=1) as omni:
        card = omni.model_card
        assert card.default_size == size
        for params in warm_up_params(card):
            admitted = omni.admit(params).params
            assert (admitted.height, admitted.width, admitted.num_inference_steps) == (*size, 1)
        assert omni.admit(OmniDiffusionSamplingParams()).params.height == size[0]


def test_too_few_steps_are_refused_and_an_output_that_is_not_finite_fails_naming_the_likely_cause(
    tiny_qwen_image, tiny_flux
):
    """Qwen-Image at one step: its scheduler's one-step schedule (stretched to a terminal sigma) is 0 / 0, and stock
    diffusers makes NaN, which PIL would show as black: admission refuses it, naming the field. The warm-up takes
    the two steps the scheduler needs."""
    with Omni(model=tiny_qwen_image, max_num_seqs=1) as omni:
        assert omni.model_card.min_steps == 2
        assert [p.num_inference_steps for p in warm_up_params(omni.model_card)] == [2]
        with pytest.raises(SamplingParamsError) as refused:
            omni.generate(["a red car"], OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=1))
        assert refused.value.param == "num_inference_steps" and "num_inference_steps >= 2" in str(refused.value)
    # Step mode (Flux's stepper decodes), a decoder made to overflow: the request fails, its output is never an image.
    with Omni(model=tiny_flux, max_num_seqs=2, execution_mode="step") as omni:
        omni.engine.stages[0].replicas[0].engine.runner.pipeline.vae.decoder.conv_out.bias.data.fill_(float("inf"))
        for output_type in ("np", "pil"):
            params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, output_type=output_type)
            for output in omni.generate(PROMPTS, params):
                assert output.images == [] and "FluxPipeline's output is not finite" in output.error
                assert "likely a numerical overflow" in output.error
