"""VAE tiling and slicing against stock diffusers with the same settings, alone and in a batch, in request and step
mode; and the pixel budget's batch sizes for mixed sizes, as the engine's batch histogram records them."""

import threading

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.runner import load_pipeline

pytestmark = pytest.mark.slow

SIZE = 128  # the tiny VAE's tiles are 64 px (its sample_size): 128 px is decoded in four overlapping tiles
PROMPTS = ["a red cube", "a blue sphere", "a green cone"]


def _stock(model: str, prompt: str, seed: int, tiling: bool, slicing: bool) -> np.ndarray:
    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    if tiling:
        pipeline.vae.enable_tiling()
    if slicing:
        pipeline.vae.enable_slicing()
    image = pipeline(
        prompt, height=SIZE, width=SIZE, num_inference_steps=2, generator=torch.Generator("cpu").manual_seed(seed)
    ).images[0]
    return np.asarray(image, dtype=np.int16)


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
        queued = threading.Event()
        held = engine.scheduler.call(queued.wait)  # pending calls run before any batch is formed
        try:
            futures = [omni.engine.add_request(f"budget-{i}", "a cat", p) for i, p in enumerate(params)]
        finally:
            queued.set()
        held.result(timeout=600)
        outputs = [f.result(timeout=600) for f in futures]
        counts = {size: n - before.get(size, 0) for size, n in _batch_counts(engine).items()}
    assert [o.error for o in outputs] == [None] * 8
    by_size = {s: [o.metrics["batch_size"] for o, size in zip(outputs, sizes) if size == s] for s in (32, 64)}
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
    return {b: cumulative[b] - (cumulative[a] if a is not None else 0) for a, b in zip([None, *bounds], bounds)}
