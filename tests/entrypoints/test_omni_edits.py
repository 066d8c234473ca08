"""Image inputs through `Omni` (request mode): image-to-image and inpainting of a text-to-image model, run by its
diffusers variants built on the loaded components, equal the stock variant called alone, alone or in a batch."""

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.checks.edits import noise_image, square_mask, stock_edit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["a red cat", "a blue dog", "a green tree", "a small house"]
STEPS, GUIDANCE = 4, 3.0


def stock(model: str, prompt: str, image, seed: int, strength: float, mask=None) -> np.ndarray:
    return stock_edit(model, prompt, image, seed, strength, mask, num_inference_steps=STEPS, guidance_scale=GUIDANCE)


def params(**kwargs) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(num_inference_steps=STEPS, guidance_scale=GUIDANCE, output_type="np", **kwargs)


@pytest.fixture(scope="module", params=["tiny_sd", "tiny_flux"])
def served(request):
    path = request.getfixturevalue(request.param)
    # A full batch starts at once; the long wait only holds requests that arrive one at a time.
    with Omni(model=path, max_num_seqs=4, request_batch_max_wait_ms=2000) as omni:
        yield path, omni


@pytest.mark.parametrize("task", ["image", "inpaint"])
def test_edits_in_a_batch_of_four_equal_the_stock_variant_alone(served, task):
    path, omni = served
    mask = square_mask() if task == "inpaint" else None
    images = [noise_image(i) for i in range(4)]
    outputs = omni.generate(
        PROMPTS, [params(image=images[i], mask_image=mask, strength=0.75, seed=10 + i) for i in range(4)]
    )
    for i, output in enumerate(outputs):
        assert output.error is None and output.metrics["batch_size"] == 4
        expected = stock(path, PROMPTS[i], images[i], 10 + i, 0.75, mask)
        assert np.abs(np.asarray(output.images[0]) - expected).max() <= 2 / 255


def test_an_edit_alone_equals_the_stock_variant_and_the_input_matters(served):
    path, omni = served
    first, second = (omni.generate([PROMPTS[0]], params(image=noise_image(i), seed=7))[0] for i in (1, 2))
    expected = stock(path, PROMPTS[0], noise_image(1), 7, 0.6)  # 0.6: the default strength of image-to-image
    assert first.metrics["batch_size"] == 1
    assert np.abs(np.asarray(first.images[0]) - expected).max() <= 2 / 255
    assert np.abs(np.asarray(first.images[0]) - np.asarray(second.images[0])).max() > 0.05


def test_size_defaults_to_the_first_image(served):
    _, omni = served
    image = noise_image(3, size=80)  # 80 is not a multiple of 16: the default size rounds down to 64 or 80
    output = omni.generate(["a cat"], params(image=image, num_outputs_per_prompt=2, seed=1))[0]
    multiple = omni.model_card.size_multiple
    side = 80 - 80 % multiple
    assert [im.shape[:2] for im in output.images] == [(side, side)] * 2
    assert np.abs(output.images[0] - output.images[1]).max() > 0  # two draws of noise around the same image


def _mixed_edits() -> tuple[list[str], list[OmniDiffusionSamplingParams], list[tuple]]:
    """Edits with different strengths and tasks (step mode runs them, and a text request, in shared forwards)."""
    mask = square_mask()
    cases = [("image", 0.5), ("image", 1.0), ("inpaint", 0.75), ("inpaint", 1.0)]
    prompts, requests, expected = [], [], []
    for i, (task, strength) in enumerate(cases):
        m = mask if task == "inpaint" else None
        prompts.append(PROMPTS[i])
        requests.append(params(image=noise_image(20 + i), mask_image=m, strength=strength, seed=30 + i))
        expected.append((PROMPTS[i], noise_image(20 + i), 30 + i, strength, m))
    return prompts, requests, expected


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_step_mode_edits_of_mixed_strengths_and_tasks_equal_the_stock_variants(family, request):
    path = request.getfixturevalue(f"tiny_{family}")
    prompts, requests, expected = _mixed_edits()
    prompts.append("a plain text request")
    requests.append(params(height=64, width=64, seed=1))
    with Omni(model=path, max_num_seqs=8, execution_mode="step") as omni:
        outputs = omni.generate(prompts, requests)
    for output, case in zip(outputs, expected, strict=False):
        assert output.error is None
        assert np.abs(np.asarray(output.images[0]) - stock(path, *case)).max() <= 2 / 255


def test_split_stages_encode_the_input_image_and_match_one_stage(tiny_flux):
    from vllm_omni.config import DeployConfig, StageDeployConfig

    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], max_num_seqs=4),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    prompts, requests, expected = _mixed_edits()
    with Omni(model=tiny_flux, deploy_config=deploy) as omni:
        outputs = omni.generate(prompts, requests)
    for output, case in zip(outputs, expected, strict=True):
        assert output.error is None
        assert np.abs(np.asarray(output.images[0]) - stock(tiny_flux, *case)).max() <= 2 / 255
