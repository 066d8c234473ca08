"""Instruction-edit and image-to-video models served as they are, through `Omni`: a batched edit equals the stock
pipeline called alone, row for row (their tiny random weights barely use the image, so the bar is tight), what a
model cannot take is refused naming the field, and what it would not use is dropped with a warning."""

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams, SamplingParamsError
from vllm_omni.testing.checks.edits import noise_image, square_mask
from vllm_omni.testing.checks.stock import stock_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["make it red", "add a hat"]


def stock(model: str, prompt: str, image, seed: int, n: int = 1, **kwargs) -> np.ndarray:
    pipeline = stock_pipeline(model)
    generator = torch.Generator("cpu").manual_seed(seed)
    return pipeline(
        prompt=[prompt] * n,
        image=[image] * n,
        generator=[generator] * n,
        num_inference_steps=2,
        height=64,
        width=64,
        output_type="np",
        **kwargs,
    ).images


@pytest.mark.parametrize(("family", "extra"), [("kontext", {"max_area": 64 * 64}), ("qwen_edit", {})])
def test_batched_instruction_edits_equal_the_stock_pipeline_alone(family, extra, request):
    model = request.getfixturevalue(f"tiny_{family}")
    images = [Image.new("RGB", (64, 64), (230, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 230))]
    with Omni(model=model, max_num_seqs=2, request_batch_max_wait_ms=2000) as omni:
        assert "image" in omni.model_card.tasks
        outputs = omni.generate(
            PROMPTS,
            [
                OmniDiffusionSamplingParams(
                    image=images[i], num_inference_steps=2, num_outputs_per_prompt=2, seed=5 + i, output_type="np"
                )
                for i in range(2)
            ],
        )
        with pytest.raises(SamplingParamsError) as refused:
            omni.generate(["x"], OmniDiffusionSamplingParams(image=images[0], mask_image=square_mask()))
        assert refused.value.param == "mask_image"
        with pytest.warns(UserWarning, match="strength ignored: strength is not accepted by"):
            (dropped,) = omni.generate(
                ["x"],
                OmniDiffusionSamplingParams(image=images[0], strength=0.5, num_inference_steps=2, height=64, width=64),
            )
        assert [field.param for field in dropped.ignored_fields] == ["strength"]  # it conditions on the image
    for i, output in enumerate(outputs):
        assert output.metrics["batch_size"] == 2
        expected = stock(model, PROMPTS[i], images[i], 5 + i, n=2, **extra)
        assert np.abs(np.asarray(output.images) - expected).max() <= 1e-5
    # So the bar above tells input images apart: the first output of the other image (one output: each input image
    # is a VAE encode at about 1024x1024 px, most of a stock call).
    other_image = stock(model, PROMPTS[0], images[1], 5, **extra)
    assert np.abs(np.asarray(outputs[0].images[:1]) - other_image).max() > 1e-4


def test_a_qwen_edit_model_needs_an_image_and_plus_takes_several(tiny_qwen_edit, tiny_qwen_edit_plus):
    with Omni(model=tiny_qwen_edit, max_num_seqs=2) as omni:
        assert omni.model_card.tasks == {"image"}
        with pytest.raises(SamplingParamsError) as refused:
            omni.generate(["x"], OmniDiffusionSamplingParams(height=64, width=64))
        assert refused.value.param == "image"
        with pytest.raises(SamplingParamsError) as refused:
            omni.generate(["x"], OmniDiffusionSamplingParams(image=[noise_image(1), noise_image(2)]))
        assert refused.value.param == "image"
    with Omni(model=tiny_qwen_edit_plus, max_num_seqs=2) as omni:
        params = OmniDiffusionSamplingParams(
            image=[noise_image(1), noise_image(2)], num_inference_steps=2, height=64, width=64, seed=3
        )
        first, second = omni.generate(["combine them", "combine them"], [params, params])
        assert first.metrics["batch_size"] == second.metrics["batch_size"] == 1  # each request's images alone
        assert first.images[0].size == (64, 64)
        assert np.array_equal(np.asarray(first.images[0]), np.asarray(second.images[0]))
