"""Split pipelines: encode → denoise → decode stages, each with its own scheduler, batch key and max_num_seqs."""

import asyncio
import json
import pickle

import numpy as np
import pytest
import torch

from vllm_omni import AsyncOmni, Omni, OmniDiffusionSamplingParams, RequestAbortedError
from vllm_omni.config import DeployConfig, StageDeployConfig

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def three_stage(encode: dict | None = None, denoise: dict | None = None, decode: dict | None = None) -> DeployConfig:
    return DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode", **(encode or {})),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], **(denoise or {})),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1], **(decode or {})),
        ]
    )


def _pixels(output) -> np.ndarray:
    items = output.videos or output.images
    return np.round(np.asarray(items, dtype=np.float64) * 255)


def _requests(family: str) -> tuple[list[str], list[OmniDiffusionSamplingParams]]:
    """Requests that differ in what each stage keys on: outputs per prompt, negative prompts, steps, guidance."""
    size = dict(height=32, width=32, output_type="np")
    if family == "wan":
        size |= {"num_frames": 5}
    variants = [
        dict(num_inference_steps=4, guidance_scale=3.5),
        dict(num_inference_steps=3, guidance_scale=3.5, num_outputs_per_prompt=2),
        dict(num_inference_steps=4, guidance_scale=1.0),
        dict(num_inference_steps=5, guidance_scale=5.0, negative_prompt="blurry"),
    ]
    if family == "flux":  # Flux's negative rows come with true CFG
        variants[3]["extra_args"] = {"true_cfg_scale": 2.0}
    params = [OmniDiffusionSamplingParams(seed=i, **size, **variants[i % 4]) for i in range(8)]
    return [f"prompt number {i}" for i in range(8)], params


@pytest.mark.parametrize("family", ["flux", "wan", "sd", "sdxl", "sd3"])
@pytest.mark.parametrize("denoise_mode", ["request", "step"])
def test_three_stages_make_what_one_stage_makes(family, denoise_mode, request):
    if denoise_mode == "step" and family not in ("flux", "wan"):
        pytest.skip("step mode of the other families is covered by the step-engine tests")
    model = request.getfixturevalue(f"tiny_{family}")
    prompts, params = _requests(family)
    with Omni(model=model, max_num_seqs=1) as omni:
        single = omni.generate(prompts, params)
    deploy = three_stage({"max_num_seqs": 16}, {"max_num_seqs": 4, "execution_mode": denoise_mode}, {"max_num_seqs": 8})
    with Omni(model=model, deploy_config=deploy) as omni:
        split = omni.generate(prompts, params)
    for one, three, p in zip(single, split, params, strict=True):
        assert three.error is None
        assert _pixels(three).shape == _pixels(one).shape == (p.num_outputs_per_prompt, *_pixels(one).shape[1:])
        worst = np.abs(_pixels(three) - _pixels(one)).max()
        assert worst <= 2, f"{family} seed {p.seed}: worst pixel difference {worst}/255"
        assert three.metrics["seed"] == one.metrics["seed"] == p.seed
        stages = three.metrics["stages"]
        assert [(s["stage_id"], s["stage_type"]) for s in stages] == [(0, "encode"), (1, "denoise"), (2, "decode")]
        assert three.metrics["batch_size"] == stages[1]["batch_size"]
        assert three.metrics["queue_ms"] == pytest.approx(sum(s["queue_ms"] for s in stages))


def _batch_histogram(omni, stage: int) -> dict[str, float]:
    """``le`` bound → cumulative count of the stage's ``vllm_omni:batch_num_requests`` observations."""
    (families,) = omni.engine.stages[stage].collect_metrics()
    (family,) = [f for f in families if f.name == "vllm_omni:batch_num_requests"]
    return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}


def _largest_batch(histogram: dict[str, float]) -> float:
    total = histogram["+Inf"]
    return min(float(le) for le, count in histogram.items() if count == total)


def test_each_stage_batches_up_to_its_own_max_num_seqs_under_load(tiny_flux):
    # encode 4, denoise 2, decode 3: a burst of 12 requests. The admission waits let the first batch of
    # each stage fill (requests reach a stage one batch at a time).
    deploy = three_stage(
        {"max_num_seqs": 4, "request_batch_max_wait_ms": 300},
        {"max_num_seqs": 2},
        {"max_num_seqs": 3, "request_batch_max_wait_ms": 1500},
    )
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=6)
    with Omni(model=tiny_flux, deploy_config=deploy) as omni:
        outputs = omni.generate([f"prompt {i}" for i in range(12)], [params] * 12)
        histograms = [_batch_histogram(omni, stage) for stage in range(3)]
    assert [o.error for o in outputs] == [None] * 12
    observed = [[o.metrics["stages"][stage]["batch_size"] for o in outputs] for stage in range(3)]
    assert [max(sizes) for sizes in observed] == [4, 2, 3], observed
    # The same from each stage's own Prometheus histogram (the bounds 1, 2, 4 bracket 3 at stage 2).
    assert [_largest_batch(h) for h in histograms] == [4.0, 2.0, 4.0]
    assert histograms[2]["2.0"] < histograms[2]["+Inf"]  # some decode batch was larger than 2


def test_a_stage_override_changes_only_that_stage(tiny_flux):
    deploy = three_stage({"max_num_seqs": 4, "request_batch_max_wait_ms": 300}, {"max_num_seqs": 4}, {})
    with Omni(model=tiny_flux, deploy_config=deploy, stage_overrides={"1": {"max_num_seqs": 2}}) as omni:
        resolved = [(s.max_num_seqs, s.provenance["max_num_seqs"]) for s in omni.stage_configs]
        assert resolved == [(4, "deploy_yaml"), (2, "stage_override"), (1, "default")]
        params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=4)
        outputs = omni.generate([f"prompt {i}" for i in range(8)], [params] * 8)
    observed = [max(o.metrics["stages"][stage]["batch_size"] for o in outputs) for stage in range(3)]
    assert observed == [4, 2, 1]


async def test_progress_and_abort_follow_the_request_through_the_stages(tiny_flux):
    async with AsyncOmni(model=tiny_flux, deploy_config=three_stage()) as omni:
        engine = omni.engine
        long = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=500, seed=0)
        task = asyncio.create_task(_collect(omni, "long", long, "long"))
        deadline = asyncio.get_running_loop().time() + 60
        while (found := engine.progress("long")) is None or found[1] == 0.0:
            assert asyncio.get_running_loop().time() < deadline, found
            await asyncio.sleep(0.02)
        assert found[0] == "running" and 0 < found[1] < 1  # its denoising progress, from the denoise stage
        assert await omni.abort("long") is True
        assert await asyncio.wait_for(task, 60) == []
        assert engine.progress("long") is None
        # Every stage is free again and serves.
        short = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2)
        (output,) = await _collect(omni, "after", short)
        assert output.error is None and len(output.metrics["stages"]) == 3
    with (
        pytest.raises(RequestAbortedError),  # the same abort through the future API, while still encoding
        Omni(model=tiny_flux, deploy_config=three_stage()) as sync,
    ):
        future = sync.engine.add_request("x", "p", long)
        assert sync.engine.abort("x") is True
        future.result(60)


async def _collect(omni, prompt, params, request_id=None):
    return [out async for out in omni.generate(prompt, params, request_id=request_id)]


def test_a_pipeline_without_a_split_fails_before_loading(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises(ValueError) as excinfo:
        Omni(model=str(tmp_path), deploy_config=three_stage())
    message = str(excinfo.value)
    assert "stage 0 (encode): WanImageToVideoPipeline cannot be split into encode / denoise / decode stages" in message
    for splittable in ("FluxPipeline", "WanPipeline", "StableDiffusionPipeline", "StableDiffusionXLPipeline"):
        assert splittable in message
    assert "stage_type: diffusion" in message


def test_payloads_pass_between_inline_stages_without_copies(tiny_flux):
    deploy = three_stage({"max_num_seqs": 2, "request_batch_max_wait_ms": 2000})
    with Omni(model=tiny_flux, deploy_config=deploy) as omni:
        stages = omni.engine.stages
        params = omni.engine.admit(
            OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=1)
        ).params
        futures = [stages[0].replicas[0].submit(f"probe-{i}", f"prompt {i}", params) for i in range(2)]
        first, second = (future.result(60).payload for future in futures)
        # Each request's rows are a view of its batch's one encoder output, and the denoise stage (same device
        # and dtype) uses those very tensors.
        embeds = first.cond["encoder_hidden_states"]
        shared = second.cond["encoder_hidden_states"].untyped_storage()
        assert shared.data_ptr() == embeds.untyped_storage().data_ptr() and shared.nbytes() == 2 * embeds.nbytes
        stepper = stages[1].replicas[0].engine.role.stepper
        assert stepper.on_device(first.cond)["encoder_hidden_states"] is embeds
        latents = stages[1].replicas[0].submit("probe-d", "prompt 0", params, first).result(60).payload
        assert stepper.on_device({"x": latents.latents})["x"] is latents.latents
        # Pickled (to a Ray replica), a request's tensors carry only its own rows.
        pickled = pickle.loads(pickle.dumps(first))
        assert pickled.cond["encoder_hidden_states"].untyped_storage().nbytes() == embeds.nbytes
        assert torch.equal(pickled.cond["encoder_hidden_states"], embeds)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_stages_may_run_in_different_dtypes(family, request):
    """Payloads are moved to the next stage's device and dtype (here: a bfloat16 encoder and VAE around a
    float32 denoiser)."""
    deploy = three_stage({"dtype": "bfloat16"}, {"dtype": "float32"}, {"dtype": "bfloat16"})
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=0, output_type="np")
    if family == "wan":
        params = params.model_copy(update={"num_frames": 5})
    with Omni(model=request.getfixturevalue(f"tiny_{family}"), deploy_config=deploy) as omni:
        (output,) = omni.generate(["a red car"], params)
    assert output.error is None
    pixels = _pixels(output)
    assert np.isfinite(pixels).all() and pixels.std() > 0


def test_split_stages_refuse_what_the_split_cannot_run(tiny_flux):
    with Omni(model=tiny_flux, deploy_config=three_stage()) as omni:
        with pytest.raises(ValueError, match=r"extra_args key 'joint_attention_kwargs' is not supported by Flux"):
            omni.generate("p", OmniDiffusionSamplingParams(extra_args={"joint_attention_kwargs": {}}))
        # Defaults come from the denoise stage, which holds the denoiser and the VAE.
        completed = omni.engine.admit(OmniDiffusionSamplingParams(seed=0)).params
        with Omni(model=tiny_flux) as single:
            assert completed == single.engine.admit(OmniDiffusionSamplingParams(seed=0)).params
