"""The ceiling: the diffusers pipeline called directly, batch N vs N sequential batch-1 calls.

    python benchmarks/bench_offline.py --model DIR [--batches 1,2,4,8] [--shapes 32x32:4,64x64:4]
        [--reps 5] [--dtype auto] [--json out.json]
    python benchmarks/bench_offline.py --model DIR --worker   # for batching_sweep.py

No server, no scheduler: one ``pipeline(prompt=[...N...], generator=[...N...])``
call per measurement, with the same device, dtype, shape, steps and PIL output
as the server uses. Request-level batching cannot beat it. The calls run on one
long-lived thread, as in the server's engine: on this CPU a pipeline called from
the main thread measured up to 20 % slower than from another thread, which would
flatter the server.

``--worker`` loads the pipeline, prints ``ready``, then answers each stdin line
``N WxH:STEPS COUNT`` with the seconds that COUNT batch-N calls took, so that the
sweep can interleave ceiling calls with served requests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import PROMPTS, Shape, emit

from vllm_omni.diffusion.runner import load_pipeline, select_device, select_dtype

_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offline-pipeline")


def _call(pipeline, batch: int, width: int, height: int, steps: int) -> float:
    return _THREAD.submit(_timed_call, pipeline, batch, width, height, steps).result()


def _timed_call(pipeline, batch: int, width: int, height: int, steps: int) -> float:
    generators = [torch.Generator("cpu").manual_seed(i) for i in range(batch)]
    started = time.perf_counter()
    with torch.inference_mode():
        images = pipeline(
            prompt=(PROMPTS * batch)[:batch],
            height=height,
            width=width,
            num_inference_steps=steps,
            generator=generators,
            output_type="pil",
        ).images
    elapsed = time.perf_counter() - started
    assert len(images) == batch and images[0].size == (width, height)
    return elapsed


def run_offline(model: str, *, batches: list[int], shapes: list[Shape], reps: int = 5, dtype: str = "auto") -> dict:
    device = select_device(None)
    pipeline = load_pipeline(model, select_dtype(dtype, device), device)
    results = []
    for shape in shapes:
        width, height, steps = shape.width, shape.height, shape.steps
        _call(pipeline, 1, width, height, steps)  # warm-up
        for batch in batches:
            _call(pipeline, batch, width, height, steps)
            batched = statistics.median(_call(pipeline, batch, width, height, steps) for _ in range(reps))
            sequential = statistics.median(
                sum(_call(pipeline, 1, width, height, steps) for _ in range(batch)) for _ in range(max(1, reps // 2))
            )
            results.append(
                {
                    "shape": str(shape),
                    "batch": batch,
                    "batched_call_s": round(batched, 4),
                    "images_per_s": round(batch / batched, 3),
                    "sequential_batch1_calls_s": round(sequential, 4),
                    "speedup_vs_sequential": round(sequential / batched, 3),
                }
            )
    return {
        "model": model,
        "pipeline": type(pipeline).__name__,
        "device": str(device),
        "dtype": str(pipeline.dtype),
        "torch_threads": torch.get_num_threads(),
        "reps": reps,
        "results": results,
    }


def worker(model: str, dtype: str) -> None:
    device = select_device(None)
    pipeline = load_pipeline(model, select_dtype(dtype, device), device)
    print("ready", flush=True)
    for line in sys.stdin:
        batch, text, count = line.split()
        shape = Shape.parse(text)
        print(
            sum(_call(pipeline, int(batch), shape.width, shape.height, shape.steps) for _ in range(int(count))),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="diffusers folder")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--shapes", default="32x32:4", help="comma-separated WxH:STEPS")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--worker", action="store_true", help="serve timed calls over stdin/stdout")
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.dtype)
    result = run_offline(
        args.model,
        batches=[int(b) for b in args.batches.split(",")],
        shapes=[Shape.parse(s) for s in args.shapes.split(",")],
        reps=args.reps,
        dtype=args.dtype,
    )
    emit(result, args.json)


if __name__ == "__main__":
    main()
