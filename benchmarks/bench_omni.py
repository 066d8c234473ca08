"""Batched vs sequential generation through the Python API (`Omni`), measured as ratios in one run.

    python benchmarks/bench_omni.py [--model DIR | --family flux] [--size 32]
        [--steps 4] [--batch 4] [--reps 5] [--json out.json]

Two engines on the same model run side by side, alternating each repetition:
one with max_num_seqs = N (its admission wait gathers the N prompts into one
batch) and one with max_num_seqs = 1, which runs the same N prompts one after
the other, as a server without batching would. The medians of the wall time for
all N images and their ratio are printed as JSON.
"""

import argparse
import os
import resource
import statistics
import tempfile
import time

import torch
from common import PROMPTS, emit

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.models.tiny import make_tiny_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="diffusers folder (default: build a tiny one of --family)")
    parser.add_argument("--family", default="flux", choices=["flux", "sd"])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)

    model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(), args.family), args.family)
    prompts = (PROMPTS * args.batch)[: args.batch]
    params = OmniDiffusionSamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps, seed=0)
    batched, sequential = [], []
    with (
        Omni(model=model, max_num_seqs=args.batch, request_batch_max_wait_ms=1000) as batching,
        Omni(model=model, max_num_seqs=1) as one_by_one,
    ):
        for omni in (batching, one_by_one):
            omni.generate(prompts, params)  # warm-up
        for _ in range(args.reps):
            started = time.perf_counter()
            outputs = batching.generate(prompts, params)
            batched.append(time.perf_counter() - started)
            assert all(o.metrics["batch_size"] == args.batch for o in outputs)
            started = time.perf_counter()
            outputs = one_by_one.generate(prompts, params)
            sequential.append(time.perf_counter() - started)
            assert all(o.metrics["batch_size"] == 1 for o in outputs)

    batched_s, sequential_s = statistics.median(batched), statistics.median(sequential)
    result = {
        "model": model,
        "size": args.size,
        "steps": args.steps,
        "batch": args.batch,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "batched_s": round(batched_s, 4),
        "sequential_s": round(sequential_s, 4),
        "speedup_batched_vs_sequential": round(sequential_s / batched_s, 2),
        "batched_images_per_s": round(args.batch / batched_s, 2),
        "sequential_images_per_s": round(args.batch / sequential_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
