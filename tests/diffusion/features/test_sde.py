"""Stochastic sampling for RL rollouts (diffusion/features/sde.py): the step of each ``sde_type`` against its formula,
the settings' checks, the window, and through `Omni` the trajectory: batched equals alone, request mode equals step
mode and split stages, on every flow-matching family, and a refusal where the scheduler is not flow matching."""

import math

import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.features.sde import SdeSampler, SdeSettings, log_prob, transition
from vllm_omni.errors import SamplingParamsError

pytestmark = pytest.mark.slow


def _settings(**extra) -> SdeSettings:
    return SdeSettings.of(OmniDiffusionSamplingParams(extra_args=extra))


@pytest.mark.parametrize("sigma", [1.0, 0.8])
def test_flow_grpo_step_is_the_formula_of_the_issue(sigma):
    torch.manual_seed(0)
    x, v, sigma_next, sigma_max, a = torch.randn(2, 3, 4), torch.randn(2, 3, 4), 0.6, 0.9, 0.7
    settings = _settings(sde_type="sde", noise_level=a, logprobs=True)
    mean, std = transition(settings, x, v, sigma, sigma_next, sigma_max)
    delta = sigma_next - sigma
    s = a * math.sqrt(sigma / (1 - (sigma_max if sigma == 1.0 else sigma)))
    expected = x * (1 + s**2 * delta / (2 * sigma)) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * delta
    torch.testing.assert_close(mean, expected, rtol=1e-6, atol=1e-6)
    assert float(std) == pytest.approx(s * math.sqrt(-delta), rel=1e-6)
    sample = mean + std * torch.randn_like(mean)
    density = torch.distributions.Normal(mean, std).log_prob(sample)  # the Gaussian's own log-density
    torch.testing.assert_close(log_prob(settings, sample, mean, std), density.mean(dim=(1, 2)))


def test_cps_and_dance_sde_steps_are_their_papers_formulas():
    torch.manual_seed(1)
    x, v, sigma, sigma_next, a = torch.randn(2, 5), torch.randn(2, 5), 0.7, 0.5, 0.4
    mean, std = transition(_settings(sde_type="cps", noise_level=a), x, v, sigma, sigma_next, 0.9)
    cps_std = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v
    torch.testing.assert_close(mean, x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - cps_std**2))
    assert float(std) == pytest.approx(cps_std)
    sample = mean + 0.1
    torch.testing.assert_close(log_prob(_settings(sde_type="cps"), sample, mean, std), torch.full([2], -0.01))
    mean, std = transition(_settings(sde_type="dance_sde", noise_level=a), x, v, sigma, sigma_next, 0.9)
    delta = sigma_next - sigma
    score = -(x - x0 * (1 - sigma)) / sigma**2
    torch.testing.assert_close(mean, x + delta * v - 0.5 * a**2 * score * delta)
    assert float(std) == pytest.approx(a * math.sqrt(-delta))


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_noise_level_zero_is_the_euler_step(sde_type):
    x, v = torch.randn(1, 8), torch.randn(1, 8)
    mean, std = transition(_settings(sde_type=sde_type, noise_level=0.0), x, v, 0.75, 0.5, 0.9)
    torch.testing.assert_close(mean, x + (0.5 - 0.75) * v)
    assert float(std) == 0.0


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"sde_type": "ode"}, "sde_type"),
        ({"noise_level": -0.1}, "noise_level"),
        ({"sde_type": "cps", "noise_level": 1.5}, "noise_level"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"sde_window_size": 0}, "sde_window_size"),
        ({"sde_window_range": [0, 4]}, "sde_window_range"),
        ({"sde_window_size": 3, "sde_window_range": [2, 4]}, "sde_window_range"),
    ],
)
def test_bad_settings_name_their_key(extra, key):
    with pytest.raises(SamplingParamsError) as error:
        _settings(**extra)
    assert error.value.param == f"extra_args.{key}"


def test_the_window_is_drawn_in_its_range_and_the_trajectory_holds_it():
    settings = _settings(sde_window_size=2, sde_window_range=[1, 5], logprobs=True)
    starts = set()
    for seed in range(40):
        sampler = SdeSampler(settings, torch.Generator().manual_seed(seed), steps=6)
        assert len(sampler.window) == 2 and 1 <= sampler.window.start <= 3
        starts.add(sampler.window.start)
        sigmas = torch.linspace(1.0, 0.0, 7)
        x = torch.randn(1, 4)
        for index in range(6):
            taken = sampler.step(x, torch.randn(1, 4), 1000 * sigmas[index], sigmas, index)
            assert (taken is None) == (index not in sampler.window)
            x = x if taken is None else taken
        trajectory = sampler.trajectory()
        assert trajectory.latents.shape == (1, 3, 4) and trajectory.log_probs.shape == (1, 2)
        assert trajectory.timesteps.tolist() == pytest.approx([1000 * float(sigmas[i]) for i in sampler.window])
    assert starts == {1, 2, 3}


def _params(seed: int, **extra) -> OmniDiffusionSamplingParams:
    sde = {"sde_type": "sde", "noise_level": 0.8, "logprobs": True, "sde_window_size": 2, "sde_window_range": [0, 4]}
    return OmniDiffusionSamplingParams(
        height=32, width=32, num_inference_steps=5, seed=seed, guidance_scale=4.0, extra_args=sde | extra
    )


def _close(a, b, tol=1e-5):
    assert (a is None) == (b is None)
    if a is not None:
        assert (a - b).abs().max().item() <= tol


def _same_trajectory(one, other):
    for name in ("trajectory_latents", "trajectory_timesteps", "trajectory_sigmas", "trajectory_log_probs"):
        _close(getattr(one, name), getattr(other, name))
    assert one.prompt_embeds.keys() == other.prompt_embeds.keys()
    for key in one.prompt_embeds:
        _close(one.prompt_embeds[key], other.prompt_embeds[key])


PROMPTS = ["a red cube", "a blue sphere", "a green cone"]


def _rollouts(model: str, mode: str, **extra):
    with Omni(model=model, max_num_seqs=4, execution_mode=mode) as omni:
        batched = omni.generate(PROMPTS, [_params(seed, **extra) for seed in (11, 12, 13)])
        alone = omni.generate(PROMPTS[1], _params(12, **extra))[0]
        plain = omni.generate(PROMPTS[1], OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=5))[0]
    for output in [*batched, alone, plain]:
        assert output.error is None, output.error
    assert plain.trajectory_latents is None and plain.prompt_embeds is None
    return batched, alone


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("sd3", {}),
        ("flux", {}),
        ("wan", {"sde_type": "dance_sde"}),
        ("qwen_image", {}),  # stepped by its modular blocks
        ("z_image", {"sde_type": "cps"}),  # modular blocks, guided
        ("flux2", {"sde_type": "dance_sde"}),
    ],
)
def test_a_trajectory_does_not_depend_on_the_batch_or_the_mode(request, family, extra):
    model = request.getfixturevalue(f"tiny_{family}")
    by_mode = {mode: _rollouts(model, mode, **extra) for mode in ("request", "step")}
    for batched, alone in by_mode.values():
        _same_trajectory(batched[1], alone)
        first = batched[0]
        assert first.trajectory_latents.shape[:2] == (1, 3) and first.trajectory_log_probs.shape == (1, 2)
        assert torch.isfinite(first.trajectory_log_probs).all()
        assert not torch.equal(batched[0].trajectory_latents, batched[1].trajectory_latents)
    for request_output, step_output in zip(by_mode["request"][0], by_mode["step"][0], strict=True):
        _same_trajectory(request_output, step_output)
    if family == "sd3":  # classifier-free guidance: the negative rows' inputs too, as the pipeline takes them
        assert set(by_mode["request"][1].prompt_embeds) == {
            "prompt_embeds",
            "pooled_prompt_embeds",
            "negative_prompt_embeds",
            "negative_pooled_prompt_embeds",
        }


@pytest.mark.parametrize("family", ["sd3", "qwen_image"])
def test_split_stages_hand_the_trajectory_to_the_final_output(request, family):
    model = request.getfixturevalue(f"tiny_{family}")
    from vllm_omni.config import DeployConfig, StageDeployConfig

    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode"),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], max_num_seqs=4),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1]),
        ]
    )
    with Omni(model=model, deploy_config=deploy) as omni:
        split = omni.generate(PROMPTS[1], _params(12))[0]
    with Omni(model=model) as omni:
        whole = omni.generate(PROMPTS[1], _params(12))[0]
    _same_trajectory(split, whole)


def test_without_logprobs_the_trajectory_has_no_log_probs_and_the_same_latents(tiny_sd3):
    with Omni(model=tiny_sd3) as omni:
        with_logprobs, without = omni.generate([PROMPTS[0]] * 2, [_params(5), _params(5, logprobs=False)])
    assert without.trajectory_log_probs is None
    _close(with_logprobs.trajectory_latents, without.trajectory_latents)


def test_a_model_whose_scheduler_is_not_flow_matching_refuses_stochastic_sampling(tiny_sd):
    with Omni(model=tiny_sd) as omni, pytest.raises(SamplingParamsError) as error:
        omni.generate("a cat", OmniDiffusionSamplingParams(extra_args={"sde_type": "sde"}))
    assert error.value.param == "extra_args.sde_type" and "FlowMatchEulerDiscreteScheduler" in str(error.value)


def test_qwen_image_edits_sample_stochastically_in_request_mode(tiny_qwen_edit):
    """A pipeline without a stepper (Qwen-Image-Edit) steps the same scheduler: its request-mode call samples
    stochastically, batched equal to alone."""
    from PIL import Image

    images = [Image.new("RGB", (64, 64), (230, 20, 20)), Image.new("RGB", (64, 64), (20, 20, 230))]

    def edit(seed, image):
        sde = {"sde_type": "cps", "noise_level": 0.5, "logprobs": True}
        return OmniDiffusionSamplingParams(
            height=64, width=64, num_inference_steps=3, seed=seed, image=[image], extra_args=sde
        )

    # A batch starts once full: the two requests share one call whatever the machine's speed.
    with Omni(model=tiny_qwen_edit, max_num_seqs=2, request_batch_max_wait_ms=600_000) as omni:
        batched = omni.generate(["make it red", "add a hat"], [edit(1, images[0]), edit(2, images[1])])
    with Omni(model=tiny_qwen_edit, max_num_seqs=1) as omni:
        alone = omni.generate("add a hat", edit(2, images[1]))[0]
    assert [o.metrics.batch_size for o in batched] == [2, 2]
    _same_trajectory(batched[1], alone)
    assert batched[1].trajectory_latents.shape[1] == 4 and "prompt_embeds" in batched[1].prompt_embeds


def test_inpainting_refuses_stochastic_sampling(tiny_sd3):
    """Inpainting blends the kept image back after each step: a recorded transition's result would not be the next
    step's input, so the log-probs could not be recomputed from the trajectory."""
    from vllm_omni.testing.checks.edits import noise_image, square_mask

    params = OmniDiffusionSamplingParams(
        height=32, width=32, image=[noise_image(0, 32)], mask_image=square_mask(32), extra_args={"logprobs": True}
    )
    with Omni(model=tiny_sd3) as omni, pytest.raises(SamplingParamsError) as error:
        omni.generate("a cat", params)
    assert error.value.param == "extra_args.logprobs" and "mask_image" in str(error.value)
