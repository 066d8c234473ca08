"""The ceiling: the diffusers pipeline called directly, batch N vs N sequential batch-1 calls.

    python benchmarks/bench_offline.py --model DIR [--batches 1,2,4,8] [--shapes 32x32:4,64x64:4]
        [--reps 5] [--dtype auto] [--thread best|main|dedicated] [--json out.json]
    python benchmarks/bench_offline.py --model DIR --task edit [--strength 0.75] [--mask] --batches 4 --shapes 64x64:4
    python benchmarks/bench_offline.py --model DIR --worker --thread main|dedicated   # for batching_sweep.py

No server, no scheduler: one ``pipeline(prompt=[...N...], generator=[...N...])``
call per measurement, with the same device, dtype, shape, steps and PIL output
as the server uses. Request-level batching cannot beat it.

``--task edit``: the same for image-to-image edits (what ``bench_serving.py --task
edit`` posts): the stock variant built on the loaded pipeline's components
(``AutoPipelineForImage2Image.from_pipe``; with ``--mask``,
``AutoPipelineForInpainting.from_pipe``), one call with lists of N: the fixed
noise image of the shape's size (``common.edit_image``, and ``common.edit_mask``),
one generator each, at ``--strength``.

Which thread runs torch matters on the CPU: libgomp gives each thread that runs
torch ops its own OpenMP team, and once a process holds more OpenMP threads than
cores it throttles spin-waiting, so the first torch op on a second thread makes
every later forward slower. A fair ceiling therefore runs all torch work (import,
load and calls) on one thread: ``--thread main`` the main thread, ``--thread
dedicated`` one long-lived other thread, each in its own process. ``--thread
best`` (the default) runs both variants, each in a fresh process, and reports the
faster of the two per row: the fastest way this machine runs the pipeline.

``--worker`` loads the pipeline, prints ``ready {"vllm_omni": FILE, "threads": N}``, then
answers each stdin line ``N WxH:STEPS COUNT`` with the seconds that COUNT
batch-N calls took, so that the sweep can interleave ceiling calls with served
requests.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from common import EDIT_STRENGTH, PROMPTS, REPO, Script, Shape, edit_image, edit_mask, emit

THREADS = ("main", "dedicated")


def _on_one_thread(thread: str, work, *args):
    """``work(*args)`` on the main thread, or on one new thread (nothing else of torch runs on the main one)."""
    if thread == "main":
        return work(*args)
    result: list = []

    def target() -> None:
        try:
            result.append((True, work(*args)))
        except BaseException as exc:  # re-raised on the main thread
            result.append((False, exc))

    runner = threading.Thread(target=target, name="offline-pipeline")
    runner.start()
    runner.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _load(model: str, dtype: str, edit: Edit | None = None):
    # Imported here, on the thread that runs torch: the main thread of a dedicated-thread process never touches it.
    from vllm_omni.diffusion.pipeline.runner import load_pipeline, select_device, select_dtype

    device = select_device(None)
    pipeline = load_pipeline(model, select_dtype(dtype, device), device)
    if edit is None:
        return pipeline
    from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting

    # The stock variant on the same components (no weight copied), as the server builds its own.
    variant = (AutoPipelineForInpainting if edit.mask else AutoPipelineForImage2Image).from_pipe(pipeline)
    variant.set_progress_bar_config(disable=True)
    return variant


class Edit:
    """``--task edit``: each row's input image (and mask) and the strength; the inputs are made once per size."""

    def __init__(self, strength: float = EDIT_STRENGTH, mask: bool = False):
        self.strength, self.mask = strength, mask
        self._inputs: dict[tuple[int, int], tuple] = {}

    def call_args(self, pipeline, batch: int, width: int, height: int) -> dict:
        if (width, height) not in self._inputs:
            self._inputs[width, height] = (edit_image(width, height), edit_mask(width, height) if self.mask else None)
        image, mask = self._inputs[width, height]
        args = {"image": [image] * batch, "strength": self.strength}
        if mask is not None:
            args["mask_image"] = [mask] * batch
        if "height" in inspect.signature(pipeline.__call__).parameters:  # SD's image-to-image keeps its input's size
            args.update(height=height, width=width)
        return args


def _timed_call(pipeline, batch: int, width: int, height: int, steps: int, edit: Edit | None = None) -> float:
    import torch

    size = edit.call_args(pipeline, batch, width, height) if edit else {"height": height, "width": width}
    generators = [torch.Generator("cpu").manual_seed(i) for i in range(batch)]
    started = time.perf_counter()
    with torch.inference_mode():
        images = pipeline(
            prompt=(PROMPTS * batch)[:batch],
            num_inference_steps=steps,
            generator=generators,
            output_type="pil",
            **size,
        ).images
    elapsed = time.perf_counter() - started
    assert len(images) == batch and images[0].size == (width, height)
    return elapsed


def _measure(
    model: str, batches: list[int], shapes: list[Shape], reps: int, dtype: str, edit: Edit | None = None
) -> dict:
    import torch

    import vllm_omni

    pipeline = _load(model, dtype, edit)
    results = []
    for shape in shapes:
        call = (shape.width, shape.height, shape.steps, edit)
        _timed_call(pipeline, 1, *call)  # warm-up
        for batch in batches:
            _timed_call(pipeline, batch, *call)
            batched = statistics.median(_timed_call(pipeline, batch, *call) for _ in range(reps))
            sequential = statistics.median(
                sum(_timed_call(pipeline, 1, *call) for _ in range(batch)) for _ in range(max(1, reps // 2))
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
    task = {"task": "image"} if edit is None else {"task": "edit", "strength": edit.strength, "mask": edit.mask}
    return {
        "model": model,
        **task,
        "pipeline": type(pipeline).__name__,
        "device": str(pipeline.device),
        "dtype": str(pipeline.dtype),
        "torch_threads": torch.get_num_threads(),
        "vllm_omni": vllm_omni.__file__,
        "process_threads": len(os.listdir("/proc/self/task")),
        "reps": reps,
        "results": results,
    }


def run_offline(
    model: str,
    *,
    batches: list[int],
    shapes: list[Shape],
    reps: int = 5,
    dtype: str = "auto",
    thread: str = "main",
    edit: Edit | None = None,
) -> dict:
    """Measure in this process, all torch work on ``thread`` (``main`` or ``dedicated``). Use it in a process where
    torch has run on no other thread, or the numbers are those of the slow path. ``edit``: image-to-image edits
    (``--task edit``) instead of generation."""
    result = _on_one_thread(thread, _measure, model, batches, shapes, reps, dtype, edit)
    return result | {"thread": thread}


def run_best(
    model: str,
    *,
    batches: list[int],
    shapes: list[Shape],
    reps: int = 5,
    dtype: str = "auto",
    edit: Edit | None = None,
) -> dict:
    """Each thread variant in a fresh process of this script (`common.Script`: one after the other, this checkout's
    vllm_omni); per row the faster variant (lower batched call)."""
    variants = {}
    for thread in THREADS:
        argv = ["--model", model, "--thread", thread, "--batches", ",".join(map(str, batches))]
        argv += ["--shapes", ",".join(map(str, shapes)), "--reps", str(reps), "--dtype", dtype]
        if edit is not None:
            argv += ["--task", "edit", "--strength", str(edit.strength), *(["--mask"] if edit.mask else [])]
        with tempfile.NamedTemporaryFile("r", prefix=f"bench-offline-{thread}-", suffix=".log") as log:
            script = Script("bench_offline", argv, REPO, log.name)
            output = script.stdout.read()
            if code := script.wait():
                raise RuntimeError(f"bench_offline.py --thread {thread} exited with {code}: {log.read()[-3000:]}")
        variants[thread] = json.loads(output)
    first = variants[THREADS[0]]
    results = []
    for rows in zip(*(variants[t]["results"] for t in THREADS), strict=True):
        best = min(range(len(THREADS)), key=lambda i: rows[i]["batched_call_s"])
        row = dict(rows[best]) | {"thread": THREADS[best]}
        row["batched_call_s_by_thread"] = {t: r["batched_call_s"] for t, r in zip(THREADS, rows, strict=True)}
        results.append(row)
    keep = ("model", "task", "strength", "mask", "pipeline", "device", "dtype", "torch_threads", "vllm_omni", "reps")
    keep = tuple(key for key in keep if key in first)
    threads = {t: variants[t]["process_threads"] for t in THREADS}
    return {key: first[key] for key in keep} | {"thread": "best", "process_threads": threads, "results": results}


def _serve(model: str, dtype: str) -> None:
    import vllm_omni

    pipeline = _load(model, dtype)
    _timed_call(pipeline, 1, 32, 32, 1)
    # The process's threads once torch has run: one OpenMP team (torch's threads) plus the Python threads.
    print("ready", json.dumps({"vllm_omni": vllm_omni.__file__, "threads": len(os.listdir("/proc/self/task"))}))
    sys.stdout.flush()
    for line in sys.stdin:
        batch, text, count = line.split()
        shape = Shape.parse(text)
        seconds = sum(
            _timed_call(pipeline, int(batch), shape.width, shape.height, shape.steps) for _ in range(int(count))
        )
        print(seconds, flush=True)


def worker(model: str, dtype: str, thread: str = "main") -> None:
    """Load, then answer timing requests on stdin, all torch work on ``thread``."""
    _on_one_thread(thread, _serve, model, dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="diffusers folder")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--shapes", default="32x32:4", help="comma-separated WxH:STEPS")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument(
        "--thread",
        choices=["best", *THREADS],
        default="best",
        help="the thread that runs all torch work; best: each in a fresh process, the faster per row",
    )
    parser.add_argument(
        "--task", choices=["image", "edit"], default="image", help="generation, or image-to-image edits (img2img)"
    )
    parser.add_argument("--strength", type=float, default=EDIT_STRENGTH, help="edit: how far the image is noised")
    parser.add_argument("--mask", action="store_true", help="edit: inpainting with common.edit_mask")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--worker", action="store_true", help="serve timed calls over stdin/stdout")
    args = parser.parse_args(argv)
    if args.worker:
        if args.task != "image":
            parser.error("--worker times generation only")
        return worker(args.model, args.dtype, "dedicated" if args.thread == "best" else args.thread)
    kwargs = dict(
        batches=[int(b) for b in args.batches.split(",")],
        shapes=[Shape.parse(s) for s in args.shapes.split(",")],
        reps=args.reps,
        dtype=args.dtype,
        edit=Edit(args.strength, args.mask) if args.task == "edit" else None,
    )
    if args.thread == "best":
        result = run_best(args.model, **kwargs)
    else:
        result = run_offline(args.model, thread=args.thread, **kwargs)
    emit(result, args.json)


if __name__ == "__main__":
    main()
