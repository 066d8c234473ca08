"""VAE tiling and slicing against stock diffusers with the same settings, alone and in a batch, in request and step
mode; the pixel budget's batch sizes for mixed sizes, as the engine's batch histogram records them; and
out-of-memory splitting with the memory knobs and a step cache on."""

import functools

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.testing.checks.faults import run_together

pytestmark = pytest.mark.slow

SIZE = 128  # the tiny VAE's tiles are 64 px (its sample_size): 128 px is decoded in four overlapping tiles
PROMPTS = ["a red cube", "a blue sphere", "a green cone"]


@functools.cache
def _stock_pipeline(model: str, tiling: bool, slicing: bool):
    """One stock pipeline per VAE setting for the module (a stock call leaves its pipeline as it found it)."""
    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    if tiling:
        pipeline.vae.enable_tiling()
    if slicing:
        pipeline.vae.enable_slicing()
    return pipeline


@functools.cache
def _stock(model: str, prompt: str, seed: int, tiling: bool, slicing: bool) -> np.ndarray:
    """The stock image of ``prompt`` and ``seed`` (deterministic: made once, for request and step mode alike)."""
    image = _stock_pipeline(model, tiling, slicing)(
        prompt, height=SIZE, width=SIZE, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(seed)
    ).images[0]
    pixels = np.asarray(image, dtype=np.int16)
    pixels.flags.writeable = False
    return pixels


@pytest.mark.parametrize("execution_mode", ["request", "step"])
@pytest.mark.parametrize(("tiling", "slicing"), [(True, False), (False, True)])
def test_vae_tiling_and_slicing_match_stock_diffusers_alone_and_batched(tiny_sd, execution_mode, tiling, slicing):
    params = [OmniDiffusionSamplingParams(height=SIZE, width=SIZE, num_inference_steps=2, seed=s) for s in (1, 2, 3)]
    with Omni(tiny_sd, max_num_seqs=3, execution_mode=execution_mode, vae_tiling=tiling, vae_slicing=slicing) as omni:
        vae = omni.engine.stages[0].replicas[0].engine.runner.pipeline.vae
        assert (vae.use_tiling, vae.use_slicing) == (tiling, slicing)
        batched = omni.generate(PROMPTS, params)
        alone = omni.generate(PROMPTS[:1], params[:1])
    assert max(o.metrics["batch_size"] for o in batched) > 1
    for output, prompt, p in zip(batched + alone, PROMPTS + PROMPTS[:1], params + params[:1], strict=True):
        want = _stock(tiny_sd, prompt, p.seed, tiling, slicing)
        assert np.abs(np.asarray(output.images[0], dtype=np.int16) - want).max() <= 2
    if tiling:  # the knob changes the decode: tiles blend at their seams
        untiled = _stock(tiny_sd, PROMPTS[0], 1, tiling=False, slicing=False)
        assert np.abs(np.asarray(alone[0].images[0], dtype=np.int16) - untiled).max() > 2


@pytest.mark.parametrize("execution_mode", ["request", "step"])
def test_the_pixel_budget_sizes_batches_of_mixed_sizes(tiny_flux, execution_mode):
    """max_num_seqs 4 and a budget of two 64x64 images: four 64x64 requests run two at a time, four 32x32 four at
    a time. All eight are queued while the engine thread is held in an engine call, so the sizes are the policy's."""
    sizes = [64] * 4 + [32] * 4
    params = [
        OmniDiffusionSamplingParams(height=s, width=s, num_inference_steps=2, seed=i) for i, s in enumerate(sizes)
    ]
    with Omni(tiny_flux, max_num_seqs=4, max_batch_pixels=2 * 64 * 64, execution_mode=execution_mode) as omni:
        engine = omni.engine.stages[0].replicas[0].engine
        before = _batch_counts(engine)
        outputs = run_together(omni, [("a cat", p) for p in params], "budget")
        counts = {size: n - before.get(size, 0) for size, n in _batch_counts(engine).items()}
    assert [o.error for o in outputs] == [None] * 8
    by_size = {
        s: [o.metrics["batch_size"] for o, size in zip(outputs, sizes, strict=True) if size == s] for s in (32, 64)
    }
    assert max(by_size[64]) <= 2 and max(by_size[32]) <= 4
    if execution_mode == "request":
        assert by_size == {64: [2, 2, 2, 2], 32: [4, 4, 4, 4]}
        assert {size: n for size, n in counts.items() if n} == {2: 2, 4: 1}  # batches of 2, 2 and 4
    else:  # a forward at a time: none above the budget, and the 32x32 ones ran side by side
        assert max(size for size, n in counts.items() if n) <= 4 and sum(counts.values()) > 0


def _batch_counts(engine) -> dict[int, float]:
    """Batches (request mode) or forwards (step mode) so far by number of requests, from the engine's
    ``vllm_omni:batch_num_requests`` histogram, the one ``/metrics`` exports."""
    cumulative = {}
    for metric in engine.metrics.registry.collect():
        if metric.name == "vllm_omni:batch_num_requests":
            for sample in metric.samples:
                if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                    le = int(float(sample.labels["le"]))
                    cumulative[le] = cumulative.get(le, 0) + sample.value
    bounds = sorted(cumulative)
    return {
        b: cumulative[b] - (cumulative[a] if a is not None else 0)
        for a, b in zip([None, *bounds], bounds, strict=False)
    }


@pytest.mark.parametrize("execution_mode", ["request", "step"])
def test_out_of_memory_splitting_still_works_with_the_memory_knobs_and_a_step_cache(tiny_flux, execution_mode):
    """Four requests with VAE tiling and slicing, a pixel budget that holds all four and first-block caching; the
    denoiser runs out of memory above two requests from the second step on, after the first request of the forward
    has run its part (the cache runs the denoiser once per request): the retry must find every request's cache
    state as it was before the failed forward. Each
    image equals the same request run alone on the same engine."""
    params = [OmniDiffusionSamplingParams(height=SIZE, width=SIZE, num_inference_steps=6, seed=s) for s in range(4)]
    prompts = [*PROMPTS, "a yellow torus"]
    knobs = dict(vae_tiling=True, vae_slicing=True, max_batch_pixels=4 * SIZE * SIZE)
    cache = dict(cache_backend="taylorseer", cache_config={"cache_interval": 2, "disable_cache_before_step": 1})
    with Omni(tiny_flux, max_num_seqs=4, execution_mode=execution_mode, **knobs, **cache) as omni:
        transformer = omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer
        forward = {"rows": 0, "parts": 0, "large": 0}

        def on_forward(module, args, kwargs):
            rows = kwargs["hidden_states"].shape[0]
            forward.update(rows=rows, parts=0, large=forward["large"] + (rows > 2))

        def on_first_block(module, args, kwargs):  # one call per request of the forward
            forward["parts"] += 1
            if forward["rows"] > 2 and forward["large"] >= 2 and forward["parts"] == 2:  # from the second step on
                raise torch.OutOfMemoryError("simulated: out of memory above 2 requests")

        handles = [
            transformer.register_forward_pre_hook(on_forward, with_kwargs=True),
            transformer.transformer_blocks[0].register_forward_pre_hook(on_first_block, with_kwargs=True),
        ]
        splits, skipped = _engine_count("oom_batch_splits"), _engine_count("cache_skipped_steps")
        together = run_together(omni, list(zip(prompts, params, strict=True)), "oom")
        assert _engine_count("oom_batch_splits") > splits
        for handle in handles:
            handle.remove()
        skipped_together = _engine_count("cache_skipped_steps") - skipped
        alone = [omni.generate([prompt], [p])[0] for prompt, p in zip(prompts, params, strict=True)]
        skipped_alone = _engine_count("cache_skipped_steps") - skipped - skipped_together
    assert [o.error for o in together + alone] == [None] * 8
    # The same cache decisions as alone (a tiny model's image barely shows them): a retry that found a request's
    # state moved, or emptied, would skip a different number of computations.
    assert skipped_together == skipped_alone > 0
    if execution_mode == "request":
        assert [o.metrics["batch_size"] for o in together] == [2, 2, 2, 2]
    for batched, single in zip(together, alone, strict=True):
        diff = np.abs(np.asarray(batched.images[0], dtype=np.int16) - np.asarray(single.images[0], dtype=np.int16))
        assert diff.max() <= 2


def _engine_count(counter: str) -> float:
    return REGISTRY.get_sample_value(f"vllm_omni:{counter}_total", {"stage": "0", "replica": "0"}) or 0.0
