"""Step caching (``cache_backend``) against stock diffusers with the same cache config, each request alone: the
same images within 2/255 inside a batch of four different prompts, in request and step mode; the cache state
reset between requests; a request that opts out (``cache: false``) equal to the uncached pipeline; the skipped
computations counted in the engine's metric, the one ``/metrics`` exports. On the tiny model a skip moves the
image by a level at most, so the skip counts are the sharp check: a batch skips exactly what its requests skip
alone."""

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.config.cache import cache_hook_config
from vllm_omni.diffusion.pipeline.runner import load_pipeline
from vllm_omni.testing.checks.faults import run_together

pytestmark = pytest.mark.slow

PROMPTS = ["a red cube", "a blue sphere", "a green cone", "a cat on a mat"]
STEPS = 8
BACKENDS = {
    "first_block": {"threshold": 0.5},
    "taylorseer": {"cache_interval": 2, "disable_cache_before_step": 2},
    "magcache": {"mag_ratios": [1.0] * STEPS, "num_inference_steps": STEPS, "threshold": 0.5, "retention_ratio": 0.1},
    "pab": {"spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": [-1, 1001]},
}


def _stock(model: str, prompt: str, seed: int, backend: str | None, options: dict | None = None) -> np.ndarray:
    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    if backend is not None:
        pipeline.transformer.enable_cache(cache_hook_config(backend, options, lambda: pipeline.current_timestep))
    image = pipeline(
        prompt=prompt,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image, dtype=np.int16)


def _params(seed: int, cache: bool = True) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=STEPS, seed=seed, cache=cache)


def _skipped(omni: Omni) -> float:
    engine = omni.engine.stages[0].replicas[0].engine
    for metric in engine.metrics.registry.collect():
        if metric.name == "vllm_omni:cache_skipped_steps":
            return sum(s.value for s in metric.samples if s.name.endswith("_total"))
    raise AssertionError("no vllm_omni:cache_skipped_steps metric")


def _pixels(output) -> np.ndarray:
    assert output.error is None
    return np.asarray(output.images[0], dtype=np.int16)


@pytest.mark.parametrize(
    ("backend", "execution_mode"),
    [(b, mode) for mode in ("request", "step") for b in BACKENDS],
)
def test_each_backend_matches_stock_diffusers_alone_and_in_a_batch_of_four(tiny_flux, backend, execution_mode):
    options = BACKENDS[backend]
    want = [_stock(tiny_flux, prompt, seed, backend, options) for seed, prompt in enumerate(PROMPTS)]
    with Omni(
        tiny_flux, max_num_seqs=4, execution_mode=execution_mode, cache_backend=backend, cache_config=options
    ) as omni:
        alone, skipped_alone = [], []
        for seed, prompt in enumerate(PROMPTS):
            before = _skipped(omni)
            alone.append(omni.generate([prompt], [_params(seed)])[0])
            skipped_alone.append(_skipped(omni) - before)
        before = _skipped(omni)
        batched = run_together(omni, list(zip(PROMPTS, [_params(seed) for seed in range(4)], strict=True)), backend)
        skipped_batched = _skipped(omni) - before
        again = omni.generate(PROMPTS[:1], [_params(0)])[0]  # after the batch: its state starts empty again
        skipped_again = _skipped(omni) - before - skipped_batched
    assert [o.metrics["batch_size"] for o in batched] == [4.0] * 4
    # Each request makes the decisions it makes alone (the tiny model's image barely shows a skip, the count does).
    assert min(skipped_alone) > 0 and skipped_batched == sum(skipped_alone) and skipped_again == skipped_alone[0]
    first = alone[0]
    for output, expected in zip([*alone, *batched, again], [*want, *want, want[0]], strict=True):
        assert np.abs(_pixels(output) - expected).max() <= 2
    uncached = _stock(tiny_flux, PROMPTS[0], 0, None)
    assert np.abs(_pixels(first) - uncached).max() > 0  # the cache changed what was computed


@pytest.mark.parametrize(
    ("family", "backend"),
    [(f, b) for f in ("qwen_image", "flux2") for b in BACKENDS if (f, b) != ("flux2", "first_block")],
)
def test_a_modular_family_skips_per_request_in_step_mode(family, backend, request):
    """Qwen-Image and FLUX.2 [klein], stepped by their modular blocks (`vllm_omni.diffusion.families.steppers.modular`):
    in a batch of four, each request skips what it skips alone, and each image is stock diffusers' with the same cache
    config, alone."""
    model, options = request.getfixturevalue(f"tiny_{family}"), BACKENDS[backend]
    want = [_stock(model, prompt, seed, backend, options) for seed, prompt in enumerate(PROMPTS)]
    knobs = {"execution_mode": "step", "cache_backend": backend, "cache_config": options}
    with Omni(model, max_num_seqs=4, **knobs) as omni:
        skipped_alone = []
        for seed, prompt in enumerate(PROMPTS):
            before = _skipped(omni)
            assert np.abs(_pixels(omni.generate([prompt], [_params(seed)])[0]) - want[seed]).max() <= 2
            skipped_alone.append(_skipped(omni) - before)
        before = _skipped(omni)
        batched = run_together(omni, list(zip(PROMPTS, [_params(seed) for seed in range(4)], strict=True)), "modular")
        skipped_batched = _skipped(omni) - before
    assert [o.metrics["batch_size"] for o in batched] == [4.0] * 4
    assert min(skipped_alone) > 0 and skipped_batched == sum(skipped_alone)
    for output, expected in zip(batched, want, strict=True):
        assert np.abs(_pixels(output) - expected).max() <= 2


def test_a_request_that_opts_out_runs_every_block_beside_cached_ones(tiny_flux):
    options = BACKENDS["first_block"]
    with Omni(tiny_flux, max_num_seqs=2, cache_backend="first_block", cache_config=options) as omni:
        before = _skipped(omni)
        alone = omni.generate(PROMPTS[:1], [_params(0, cache=False)])[0]
        assert _skipped(omni) == before  # nothing was skipped for it
        mixed = run_together(omni, list(zip(PROMPTS[:2], [_params(0, cache=False), _params(1)], strict=True)), "mixed")
        assert _skipped(omni) > before
    assert np.abs(_pixels(alone) - _stock(tiny_flux, PROMPTS[0], 0, None)).max() <= 2
    assert np.abs(_pixels(mixed[0]) - _stock(tiny_flux, PROMPTS[0], 0, None)).max() <= 2
    assert np.abs(_pixels(mixed[1]) - _stock(tiny_flux, PROMPTS[1], 1, "first_block", options)).max() <= 2


def test_a_backend_that_diffusers_cannot_run_on_a_denoiser_is_refused_at_start_up(tiny_flux2):
    with pytest.raises(ValueError, match=r"cache_backend='first_block': diffusers 0.42's FirstBlockCache fails"):
        Omni(tiny_flux2, cache_backend="first_block", cache_config={"threshold": 0.5})


def test_first_block_on_a_one_block_model_is_refused_at_start_up_naming_the_count(tiny_ltx):
    with pytest.raises(ValueError, match="first_block needs two transformer blocks or more; this model has 1"):
        Omni(tiny_ltx, cache_backend="first_block", cache_config={"threshold": 0.5})


def test_a_denoiser_without_diffusers_cache_hooks_is_refused_at_start_up(tiny_sd):
    with pytest.raises(ValueError, match=r"cache_backend='first_block': UNet2DConditionModel has no diffusers cache"):
        Omni(tiny_sd, cache_backend="first_block")


CACHE_DIT = {"residual_diff_threshold": 0.5, "max_warmup_steps": 1, "Fn_compute_blocks": 1, "Bn_compute_blocks": 0}


def _stock_cache_dit(model: str, prompt: str, seed: int) -> np.ndarray:
    """cache-dit as its users call it: enabled on the whole pipeline, which refreshes its context every call."""
    import cache_dit

    pipeline = load_pipeline(model, torch.float32, torch.device("cpu"))
    cache_dit.enable_cache(pipeline, cache_config=cache_dit.DBCacheConfig(**CACHE_DIT))
    image = pipeline(
        prompt=prompt,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(seed),
    ).images[0]
    return np.asarray(image, dtype=np.int16)


def test_cache_dit_matches_stock_cache_dit_request_after_request(tiny_flux):
    """One request per call (max_num_seqs 1): each request equals stock cache-dit alone, the context starts fresh
    for each (the first prompt again skips what it skipped first), and an opted-out request skips nothing."""
    want = [_stock_cache_dit(tiny_flux, prompt, seed) for seed, prompt in enumerate(PROMPTS[:2])]
    with Omni(tiny_flux, cache_backend="cache_dit", cache_config=CACHE_DIT) as omni:
        outputs, skipped = [], []
        for seed in (0, 1, 0):
            before = _skipped(omni)
            outputs.append(omni.generate([PROMPTS[seed]], [_params(seed)])[0])
            skipped.append(_skipped(omni) - before)
        before = _skipped(omni)
        opted_out = omni.generate(PROMPTS[:1], [_params(0, cache=False)])[0]
        assert _skipped(omni) == before
    assert skipped[0] > 0 and skipped == [skipped[0], skipped[1], skipped[0]]
    for output, expected in zip(outputs, [want[0], want[1], want[0]], strict=True):
        assert np.abs(_pixels(output) - expected).max() <= 2
    assert np.abs(_pixels(opted_out) - _stock(tiny_flux, PROMPTS[0], 0, None)).max() <= 2


def test_cache_dit_blocks_to_compute_beyond_the_model_are_refused_at_start_up(tiny_flux):
    with pytest.raises(ValueError, match=r"Fn_compute_blocks 8 \+ Bn_compute_blocks 0 leave none of the 2 blocks"):
        Omni(tiny_flux, cache_backend="cache_dit")  # cache-dit's defaults compute the first 8 blocks
