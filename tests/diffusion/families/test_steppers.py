"""Steppers against the stock pipeline: requests that join a running batch at different step indices end
with the image (or video) the stock pipeline makes for them alone, within 2/255."""

import functools
import pickle

import diffusers
import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.steppers import SPLIT, SUPPORTED_PIPELINES, make_stepper, modular
from vllm_omni.diffusion.pipeline.components import DENOISERS, TEXT_ENCODERS
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams
from vllm_omni.testing.checks.steppers import run_joined

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def _load(path: str, scheduler: str | None = None):
    pipeline = DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    if scheduler is not None:
        pipeline.scheduler = getattr(diffusers, scheduler).from_config(pipeline.scheduler.config)
    return pipeline


def _params(**kwargs) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(output_type="np", **kwargs)


def _stock(pipeline, prompt: str, params: OmniDiffusionSamplingParams, seed: int) -> np.ndarray:
    """The stock pipeline, this request alone, called as the request-mode runner calls it."""
    n = params.num_outputs_per_prompt
    kwargs = dict(
        prompt=prompt,
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        guidance_scale=params.guidance_scale,
        output_type="np",
        generator=[torch.Generator("cpu").manual_seed(seed)] * n,
        **params.extra_args,
    )
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = params.negative_prompt
    if params.num_frames is not None:
        return np.asarray(pipeline(**kwargs, num_frames=params.num_frames, num_videos_per_prompt=n).frames)
    return np.asarray(pipeline(**kwargs, num_images_per_prompt=n).images)


def _check(pipeline, script) -> list[int]:
    """Returns the row count of each denoiser forward in step mode."""
    stepper = make_stepper(pipeline, CPU)
    rows: list[int] = []
    hook = stepper.denoiser.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(len(args[0] if args else next(iter(kwargs.values())))), with_kwargs=True
    )
    outputs, largest = run_joined(stepper, script)
    hook.remove()
    assert largest >= 3, "the script should make requests share forwards"
    for _, name, prompt, params, seed in script:
        got = np.asarray(outputs[name], dtype=np.float64)
        want = _stock(pipeline, prompt, params, seed)
        assert got.shape == want.shape, name
        worst = np.abs(np.round(got * 255) - np.round(want * 255)).max()
        assert worst <= 2, f"{name}: worst pixel difference {worst}/255 against the stock pipeline alone"
    return rows


def test_flux_joins_at_different_steps(tiny_flux):
    size = {"height": 64, "width": 64}
    _check(
        _load(tiny_flux),
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=8, guidance_scale=3.5, **size), 1),
            (3, "B", "a red car", _params(num_inference_steps=6, guidance_scale=3.5, **size), 2),
            (
                3,
                "C",
                "a blue house",
                _params(
                    num_inference_steps=8,
                    guidance_scale=3.5,
                    negative_prompt="a dog",
                    extra_args={"true_cfg_scale": 2.0},
                    **size,
                ),
                3,
            ),
            (
                5,
                "D",
                "a small tree",
                _params(num_inference_steps=4, guidance_scale=3.5, num_outputs_per_prompt=2, **size),
                4,
            ),
        ],
    )


@pytest.mark.parametrize(
    "scheduler",
    [
        None,
        "DDIMScheduler",
        "DPMSolverMultistepScheduler",
        "EulerAncestralDiscreteScheduler",
        "UniPCMultistepScheduler",
    ],
)
def test_stable_diffusion_schedulers_keep_their_semantics(tiny_sd, scheduler):
    """None is the model's own Euler; DPM++ and UniPC keep multistep history, Euler-a draws noise every step."""
    size = {"height": 64, "width": 64}
    _check(
        _load(tiny_sd, scheduler),
        [
            (
                0,
                "A",
                "a photo of a cat",
                _params(num_inference_steps=6, guidance_scale=7.5, negative_prompt="a dog", **size),
                1,
            ),
            (2, "B", "a red car", _params(num_inference_steps=5, guidance_scale=1.0, **size), 2),  # no CFG: 1 row
            (3, "C", "a blue house", _params(num_inference_steps=6, guidance_scale=4.0, **size), 3),
        ],
    )


def test_wan_videos_join_at_different_steps(tiny_wan):
    video = {"height": 32, "width": 32, "num_frames": 5}
    _check(
        _load(tiny_wan),
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=6, guidance_scale=5.0, **video), 1),
            (2, "B", "a red car", _params(num_inference_steps=4, guidance_scale=1.0, **video), 2),
            (
                2,
                "C",
                "a blue house",
                _params(num_inference_steps=6, guidance_scale=3.0, negative_prompt="a dog", **video),
                3,
            ),
        ],
    )


@pytest.mark.parametrize("family", ["tiny_sd3", "tiny_sdxl"])
def test_sd3_and_sdxl_join_at_different_steps(family, request):
    size = {"height": 64, "width": 64}
    _check(
        _load(request.getfixturevalue(family)),
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=6, guidance_scale=5.0, **size), 1),
            (2, "B", "a red car", _params(num_inference_steps=5, guidance_scale=1.0, **size), 2),
            (
                3,
                "C",
                "a blue house",
                _params(num_inference_steps=4, guidance_scale=3.0, negative_prompt="a dog", **size),
                3,
            ),
        ],
    )


def test_keys_separate_what_cannot_share_a_forward(tiny_flux):
    stepper = make_stepper(_load(tiny_flux), CPU)
    key = functools.partial(stepper.key, stepper.card)  # keys read only the model's card, not the pipeline
    base = _params(height=64, width=64, num_inference_steps=4, guidance_scale=3.5)
    assert key(base) == key(base.model_copy(update={"num_inference_steps": 20, "guidance_scale": 7.0}))
    assert key(base) != key(base.model_copy(update={"width": 32}))
    assert key(base) != key(base.model_copy(update={"extra_args": {"max_sequence_length": 128}}))


def test_split_stage_keys_are_text_shaped_and_latent_shaped(tiny_flux):
    stepper = make_stepper(_load(tiny_flux), CPU, SPLIT)
    encode_key = functools.partial(stepper.encode_key, stepper.card)
    decode_key = functools.partial(stepper.decode_key, stepper.card)
    base = _params(height=64, width=64, num_inference_steps=4, guidance_scale=3.5)
    # Encode batches prompts whatever their size, steps or guidance; not different text lengths or negative rows.
    assert encode_key(base) == encode_key(
        base.model_copy(update={"height": 32, "num_inference_steps": 20, "guidance_scale": 7.0})
    )
    true_cfg = base.model_copy(update={"negative_prompt": "blurry", "extra_args": {"true_cfg_scale": 2.0}})
    for other in (base.model_copy(update={"extra_args": {"max_sequence_length": 128}}), true_cfg):
        assert encode_key(base) != encode_key(other)
    # Decode batches latents of one shape, whatever their prompt, steps or guidance.
    assert decode_key(base) == decode_key(true_cfg.model_copy(update={"num_inference_steps": 9}))
    assert decode_key(base) != decode_key(base.model_copy(update={"width": 32}))
    assert decode_key(base) != decode_key(base.model_copy(update={"output_type": "pil"}))


def test_unsupported_pipelines_and_arguments_are_refused(tiny_sd):
    pipeline = _load(tiny_sd)
    img2img = diffusers.StableDiffusionImg2ImgPipeline(**pipeline.components)
    with pytest.raises(ValueError, match="does not support StableDiffusionImg2ImgPipeline") as excinfo:
        make_stepper(img2img, CPU)
    assert all(name in str(excinfo.value) for name in SUPPORTED_PIPELINES)
    assert "--execution-mode request" in str(excinfo.value)
    with pytest.raises(
        ValueError, match="a split pipeline .* does not support StableDiffusionImg2ImgPipeline"
    ) as split:
        make_stepper(img2img, CPU, SPLIT)
    assert "stage_type: diffusion" in str(split.value)
    stepper = make_stepper(pipeline, CPU)
    expected = r"'clip_skip' is not supported .* \(supported: eta, guidance_rescale\)"
    with pytest.raises(SamplingParamsError, match=expected):
        stepper.check_params(stepper.card, _params(extra_args={"clip_skip": 1}))


def test_z_image_steps_through_its_modular_blocks_one_forward_per_step(tiny_z_image):
    """Z-Image's denoiser takes a list of rows (any text lengths), so every running request, its guided rows
    included, shares one forward per engine step; guidance on (scale 2: the guider's 3), off (0) and two outputs."""
    size = {"height": 64, "width": 64}
    rows = _check(
        _load(tiny_z_image),
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=5, guidance_scale=2.0, **size), 1),
            (1, "B", "a red car on a long road", _params(num_inference_steps=4, guidance_scale=0.0, **size), 2),
            (
                2,
                "C",
                "a house",
                _params(num_inference_steps=3, guidance_scale=1.5, num_outputs_per_prompt=2, **size),
                3,
            ),
        ],
    )
    assert rows == [2, 3, 7, 7, 7], "one forward per engine step: A's 2 rows, then B's 1, then C's 4"


def test_qwen_image_steps_through_its_modular_blocks(tiny_qwen_image, monkeypatch):
    """Qwen-Image guides with true_cfg_scale and a negative prompt, and its blocks rescale the guided prediction to
    the conditional one's norm. Its text embeddings are as long as each prompt and come with a mask, so the rows of
    different prompts share a forward padded to the longest (as the stock pipeline pads a batch of prompts). The
    requests whose guiders act alike (A and B) run its loop's sub-blocks once as one group, their rows at their own
    timesteps."""
    pipeline = _load(tiny_qwen_image)
    passes = _denoiser_block_passes(pipeline, monkeypatch)
    size = {"height": 64, "width": 64}
    cfg = {"negative_prompt": "blurry", "extra_args": {"true_cfg_scale": 3.0}}
    rows = _check(
        pipeline,
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=4, **cfg, **size), 1),
            (1, "B", "a red car on a long and winding road", _params(num_inference_steps=3, **cfg, **size), 2),
            (1, "C", "a red car", _params(num_inference_steps=3, **size), 3),
        ],
    )
    assert rows == [2, 5, 5, 5], "one forward per engine step: A's 2 rows, then B's 2 and C's 1"
    assert passes == [1, 1] + [2, 1, 2, 1] * 3, "per step, a pass to record and one to answer: A and B as one group"


def test_one_unguided_group_runs_its_sub_blocks_once_per_step(tiny_qwen_image, monkeypatch):
    """Requests that form one group whose guider makes one denoiser call (Qwen-Image without a negative prompt) run
    the loop's sub-blocks once per step, the call answered by its forward as it is made; their loop inputs are put
    together when the group changes, not at every step."""
    pipeline = _load(tiny_qwen_image)
    passes = _denoiser_block_passes(pipeline, monkeypatch)
    joins, original = [], modular._Joined.__init__

    def counted(self, states):
        joins.append(len(states))
        original(self, states)

    monkeypatch.setattr(modular._Joined, "__init__", counted)
    size = {"height": 64, "width": 64}
    rows = _check(
        pipeline,
        [
            (0, "A", "a photo of a cat", _params(num_inference_steps=4, **size), 1),
            (1, "B", "a red car on a long and winding road", _params(num_inference_steps=3, **size), 2),
            (1, "C", "a red car", _params(num_inference_steps=3, **size), 3),
        ],
    )
    assert rows == [1, 3, 3, 3] and passes == rows, "one pass and one forward per engine step"
    assert joins == [1, 3], "A's inputs at its first step, A's, B's and C's once for their three steps"


def _denoiser_block_passes(pipeline, monkeypatch) -> list[int]:
    """The rows of each pass of the modular stepper's denoiser block, from now on."""
    denoiser_block = type(make_stepper(pipeline, CPU).predict_blocks[-1])
    passes, original = [], denoiser_block.__call__

    def counted(self, components, block_state, i, t):
        passes.append(len(block_state.latents))
        return original(self, components, block_state, i, t)

    monkeypatch.setattr(denoiser_block, "__call__", counted)
    return passes


@pytest.mark.parametrize(
    ("family", "call", "calls"),
    [
        ("tiny_qwen_image", {"extra_args": {"true_cfg_scale": 3.0}}, 2),  # the prompts, then the negative prompts
        ("tiny_flux2", {"guidance_scale": 1.0, "num_outputs_per_prompt": 2}, 1),
    ],
    ids=["qwen-image", "flux2"],
)
def test_modular_prompts_of_one_encode_key_are_encoded_in_one_call(family, call, calls, request):
    """The prompts of one encode key go through the family's text-encoder blocks in one call, and each request gets
    what it gets alone: Qwen-Image's embeddings as long as the longest prompt, the rest masked out."""
    pipeline = _load(request.getfixturevalue(family))
    stepper = make_stepper(pipeline, CPU)
    prompts = ["a photo of a cat", "a red car on a long and winding road", "a house"]
    params = [_params(height=32, width=32, negative_prompt=n, **call) for n in ("blurry", "dark, grainy and low", "x")]
    encoder_calls = []
    hook = pipeline.text_encoder.register_forward_hook(lambda *_: encoder_calls.append(1))
    with torch.inference_mode():
        together = stepper.encode(prompts, params)
        hook.remove()
        alone = [stepper.encode([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert len(encoder_calls) == calls
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.blocks is not None and theirs.blocks is not None and mine.blocks.keys() == theirs.blocks.keys()
        for name, want in theirs.blocks.items():
            got = mine.blocks[name]
            if not isinstance(want, torch.Tensor):
                assert got is want is None, name
                continue
            length = want.shape[1]
            torch.testing.assert_close(got[:, :length], want, atol=1e-5, rtol=1e-5, msg=name)
            if f"{name}_mask" in mine.blocks:  # the padding to a longer prompt is masked out
                assert not mine.blocks[f"{name}_mask"][:, length:].any(), name


@pytest.mark.parametrize(
    ("family", "size", "cfg"),
    [
        ("tiny_z_image", {"height": 64, "width": 64, "guidance_scale": 2.0}, {}),
        (
            "tiny_qwen_image",
            {"height": 64, "width": 64},
            {"negative_prompt": "blurry", "extra_args": {"true_cfg_scale": 3.0}},
        ),
        ("tiny_flux2", {"height": 32, "width": 32, "guidance_scale": 1.0}, {}),  # decoder reads latent_ids
        # Its loop takes negative embeddings even unguided: the encode stage makes them for every request.
        ("tiny_ltx", {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 1.0}, {}),
        ("tiny_hunyuan_video15", {"height": 32, "width": 32, "num_frames": 5}, {}),
    ],
    ids=["z-image", "qwen-image", "flux2", "ltx", "hunyuan-video-1.5"],
)
def test_modular_split_stages_equal_step_mode(family, size, cfg, request):
    """The encode stage (no denoiser) runs the family's text-encoder blocks; what they made, pickled as to a Ray
    replica, starts the request in a denoise stage (no text encoders): the images of one stage in step mode."""
    path = request.getfixturevalue(family)
    size = size | {"num_inference_steps": 3}
    script = [(0, "A", "a photo of a cat", _params(**size, **cfg), 1), (1, "B", "a red car", _params(**size), 2)]
    want, _ = run_joined(make_stepper(_load(path), CPU), script)
    encoder = make_stepper(load_pipeline(path, torch.float32, CPU, DENOISERS), CPU, SPLIT)
    denoiser = make_stepper(load_pipeline(path, torch.float32, CPU, TEXT_ENCODERS), CPU, SPLIT)

    def begin(prompt: str, params: OmniDiffusionSamplingParams, seed: int):
        conditioning = pickle.loads(pickle.dumps(encoder.encode([prompt], [params])[0]))
        assert conditioning.blocks and "prompt_embeds" in conditioning.blocks
        return denoiser.start(conditioning, params, seed)

    got, _ = run_joined(denoiser, script, begin)
    for _, name, _, _, _ in script:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def _step_to_the_end(stepper, states) -> list:
    with torch.inference_mode():
        while not all(state.done for state in states):
            running = [state for state in states if not state.done]
            stepper.advance(running, stepper.predict(running))
        return stepper.decode(states)


@pytest.mark.parametrize(
    ("family", "call"),
    [
        ("tiny_z_image", {"height": 64, "width": 64, "guidance_scale": 2.0}),
        (
            "tiny_qwen_image",
            {"height": 64, "width": 64, "negative_prompt": "blurry", "extra_args": {"true_cfg_scale": 3.0}},
        ),
        ("tiny_qwen_image", {"height": 64, "width": 64}),
        ("tiny_flux2", {"height": 32, "width": 32, "guidance_scale": 1.0}),
        ("tiny_ltx", {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 1.0}),
        ("tiny_hunyuan_video15", {"height": 32, "width": 32, "num_frames": 5}),
    ],
    ids=["z-image", "qwen-image-guided", "qwen-image", "flux2", "ltx", "hunyuan-video-1.5"],
)
def test_modular_requests_started_together_equal_each_started_alone(family, call, request, monkeypatch):
    """The blocks before the loop run once for the requests of one start key, and each request starts, steps and
    decodes to the same output as when it is started alone; one with other steps starts alone. Split stages too:
    encodings pickled as to a Ray replica (no value shared by identity any more) start together the same way."""
    stepper = make_stepper(_load(request.getfixturevalue(family)), CPU)
    prompts = ["a photo of a cat", "a red car on a long and winding road", "a house", "a blue bird"]
    params = [_params(num_inference_steps=3, **call) for _ in prompts[:3]] + [_params(num_inference_steps=2, **call)]
    seeds = [1, 2, 3, 4]
    block = type(stepper.start_blocks[-1])
    runs, original = [], block.__call__
    monkeypatch.setattr(block, "__call__", lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    with torch.inference_mode():
        conditionings = stepper.encode(prompts[:3], params[:3]) + stepper.encode(prompts[3:], params[3:])
        stepper.start_all(conditionings, params, seeds)  # its first group also starts a request alone
        runs.clear()
        together = stepper.start_all(conditionings, params, seeds)
        assert len(runs) == 2, "the three requests of one key in one run, the other alone"
        pickled = pickle.loads(pickle.dumps(conditionings))
        split = stepper.start_all(pickled, params, seeds)
        alone = [stepper.start(c, q, seed) for c, q, seed in zip(conditionings, params, seeds, strict=True)]
    for mine, theirs in zip(together, alone, strict=True):
        assert torch.equal(mine.latents, theirs.latents) and torch.equal(mine.timesteps, theirs.timesteps)
    want = _step_to_the_end(stepper, alone)
    for got in (_step_to_the_end(stepper, together), _step_to_the_end(stepper, split)):
        for mine, theirs in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_a_modular_stepper_leaves_the_familys_blocks_as_diffusers_runs_them(tiny_qwen_image):
    """The stepper stops its copy of the loop block at the first step; diffusers' block classes share their
    sub-blocks, so a pipeline of the same family built after it must still run its loop."""
    from vllm_omni.diffusion.families.steppers.modular import modular_blocks

    pipeline = _load(tiny_qwen_image)
    make_stepper(pipeline, CPU).prepare("a cat", _params(height=64, width=64, num_inference_steps=2), 1)
    modular = modular_blocks(pipeline).init_pipeline()
    modular.update_components(**{k: v for k, v in pipeline.components.items() if v is not None})
    state = modular(prompt="a cat", height=64, width=64, num_inference_steps=2, output_type="np")
    assert np.asarray(state.get("images")).shape == (1, 64, 64, 3)


@pytest.mark.parametrize(
    ("family", "call", "calls"),
    [
        ("tiny_qwen_image", {}, 1),
        ("tiny_flux2", {"guidance_scale": 1.0}, 1),  # its decoder reads per-row latent_ids: concatenated
        ("tiny_ltx", {"guidance_scale": 1.0, "num_frames": 9}, 3),  # its decoder draws per request: each alone
        ("tiny_hunyuan_video15", {"num_frames": 5}, 3),  # its VAE takes one video per call
    ],
    ids=["qwen-image", "flux2", "ltx", "hunyuan-video-1.5"],
)
def test_requests_that_finish_together_are_decoded_in_one_call(family, call, calls, request):
    pipeline = _load(request.getfixturevalue(family))
    stepper = make_stepper(pipeline, CPU)
    outputs = (1, 1) if "hunyuan" in family else (1, 2)  # its blocks make one output per prompt
    params = [_params(height=32, width=32, num_inference_steps=2, num_outputs_per_prompt=n, **call) for n in outputs]
    states = [stepper.prepare(p, q, seed) for p, q, seed in (("a cat", params[0], 1), ("a red car", params[1], 2))]
    states.append(stepper.prepare("a blue house", params[0], 3))
    decoder_calls = []
    hook = pipeline.vae.decoder.register_forward_hook(lambda *_: decoder_calls.append(1))
    with torch.inference_mode():
        together = stepper.decode(states)
        hook.remove()
        alone = [stepper.decode([state])[0] for state in states]
    assert len(decoder_calls) == calls and [len(items) for items in together] == [1, outputs[1], 1]
    for mine, theirs in zip(together, alone, strict=True):
        assert np.abs(np.asarray(mine, dtype=np.float64) - np.asarray(theirs)).max() <= 1e-5


def test_modular_families_refuse_what_their_blocks_are_not_run_for(tiny_z_image):
    from vllm_omni.diffusion.engine.roles import DiffusionRole
    from vllm_omni.diffusion.families.steppers import ModularStepper

    pipeline = _load(tiny_z_image)
    assert isinstance(make_stepper(pipeline, CPU), ModularStepper)
    admission = DiffusionRole.admission("step", ModelCard.of(pipeline))
    with pytest.raises(SamplingParamsError, match="image is not supported by ZImagePipeline in execution_mode"):
        admission.admit(_params(height=64, width=64, image=[Image.new("RGB", (64, 64))]))


def test_hunyuan_video_15_in_step_mode_refuses_more_than_one_output_per_prompt(tiny_hunyuan_video15):
    from vllm_omni.diffusion.engine.roles import DiffusionRole

    admission = DiffusionRole.admission("step", ModelCard.of(_load(tiny_hunyuan_video15)))
    admission.admit(_params(height=32, width=32, num_frames=5))
    with pytest.raises(SamplingParamsError, match="num_outputs_per_prompt must be 1 for HunyuanVideo15Pipeline") as e:
        admission.admit(_params(height=32, width=32, num_frames=5, num_outputs_per_prompt=2))
    assert e.value.param == "num_outputs_per_prompt"


@pytest.mark.parametrize(
    ("family", "call"),
    [
        ("tiny_flux2", {"guidance_scale": 1.0}),  # step-distilled [klein]: its blocks have no guider
        ("tiny_ltx", {"guidance_scale": 1.0, "num_frames": 9}),  # unguided: its loop still takes negatives
        ("tiny_ltx", {"guidance_scale": 3.0, "num_frames": 9, "negative_prompt": "blurry"}),
        ("tiny_hunyuan_video15", {"num_frames": 5}),  # guided by its own guider component
    ],
    ids=["flux2", "ltx", "ltx-cfg", "hunyuan-video-1.5"],
)
def test_more_modular_families_join_at_different_steps(family, call, request):
    """FLUX.2 [klein] (its decoder reads the latents' position ids), LTX (it reads num_frames) and HunyuanVideo 1.5,
    two requests joining one step apart, each equal to its stock pipeline alone."""
    pipeline = _load(request.getfixturevalue(family))
    params = _params(height=32, width=32, num_inference_steps=3, **call)
    stepper = make_stepper(pipeline, CPU)
    outputs, largest = run_joined(stepper, [(0, "A", "a cat", params, 1), (1, "B", "a red car", params, 2)])
    assert largest == 2
    video = "num_frames" in call
    for name, prompt, seed in (("A", "a cat", 1), ("B", "a red car", 2)):
        out = pipeline(
            prompt=[prompt],
            height=32,
            width=32,
            num_inference_steps=3,
            generator=[torch.Generator("cpu").manual_seed(seed)],
            output_type="np",
            **call,
        )
        want = np.asarray(out.frames if video else out.images)[0]
        worst = np.abs(np.round(np.asarray(outputs[name][0], dtype=np.float64) * 255) - np.round(want * 255)).max()
        assert worst <= 2, f"{family} {name}: worst pixel difference {worst}/255"


@pytest.mark.parametrize(
    ("family", "call"),
    [
        ("tiny_z_image", {"height": 64, "width": 64, "guidance_scale": 2.0}),
        # (The tiny Qwen-Image's pixels move by under 1/255 for such an adapter: the bar could not tell them apart.)
        ("tiny_flux2", {"height": 32, "width": 32, "guidance_scale": 1.0}),
        ("tiny_ltx", {"height": 32, "width": 32, "num_frames": 9, "guidance_scale": 1.0}),
    ],
    ids=["z-image", "flux2", "ltx"],
)
def test_modular_families_step_requests_with_different_adapters_in_one_forward(family, call, tmp_path, request):
    """Per-row LoRA through the modular stepper: requests with adapter a at 0.8, adapter b and none share each
    step's forward, and each equals the stock pipeline with its adapters alone."""
    model = request.getfixturevalue(family)
    from vllm_omni.diffusion.lora.adapters import LoraAdapters
    from vllm_omni.sampling_params import LoraSelection
    from vllm_omni.testing.models.lora import stock_lora_images, write_random_lora

    files = {name: write_random_lora(model, str(tmp_path / name), seed=seed) for name, seed in (("a", 1), ("b", 2))}
    pipeline = load_pipeline(model, torch.float32, CPU)
    stepper = make_stepper(pipeline, CPU)
    stepper.lora = LoraAdapters(pipeline, max_loras=2, max_lora_rank=4)
    for name, path in files.items():
        stepper.lora.load(name, path)
    call = call | {"num_inference_steps": 3}
    weights = {"A": {"a": 0.8}, "B": {"b": 1.0}, "C": {}}
    script = [
        (0, "A", "a cat", _params(**call, lora=[LoraSelection(name="a", scale=0.8)]), 1),
        (1, "B", "a dog", _params(**call, lora=[LoraSelection(name="b")]), 2),
        (1, "C", "a cow", _params(**call), 3),
    ]
    outputs, largest = run_joined(stepper, script)
    assert largest == 3
    for _, name, prompt, _, seed in script:
        adapters = {k: files[k] for k in weights[name]}
        stock = stock_lora_images(model, adapters, weights[name], prompt, seed=seed, output_type="np", **call)
        want = np.asarray(stock.frames if "num_frames" in call else stock.images)
        assert np.abs(np.asarray(outputs[name][0]) - want[0]).max() * 255 <= 2, name
    plain = stock_lora_images(model, {}, {}, "a cat", seed=1, output_type="np", **call)
    plain = np.asarray(plain.frames if "num_frames" in call else plain.images)[0]
    assert np.abs(np.asarray(outputs["A"][0]) - plain).max() * 255 > 10, "adapter a does not change the image"
