"""Where a request's time goes inside the pipeline, per family, and what timing it costs.

    python benchmarks/component_timings.py       # the published run: results/cpu-tiny-component-timings.{json,md}
    python benchmarks/component_timings.py [--families flux,sd3,wan] [--size 64x64] [--steps 4] [--frames 5]
        [--requests 16] [--reps 5] [--quick] [--out-dir DIR] [--name NAME]

Overhead: tiny Flux at ``--size`` and ``--steps`` with ``component_timings`` on and off, one engine each
(`AsyncOmni`, request mode, ``max_num_seqs 1``) in a worker process of its own (`engine_workers`), the same
``--requests`` requests one after another, ``--reps`` reps alternating which goes first; the figure is the median
over reps of on ÷ off requests per second, against the target of ≥ 0.99 (timings cost at most 1 %). Reported,
never an exit code.

Breakdown: Flux from the "on" engine's runs; each other family from one engine of its own, ``--requests``
requests one after another. Each component's share is the sum of its
``vllm_omni:component_seconds`` over the sum of ``vllm_omni:batch_execution_time_seconds`` (the engine's time on
the batches), both read from the engine's own registry before and after. ``denoise`` holds the steps; the
``denoise_step`` row is the mean step, and the rest of the execution (scheduler set-up, latents, the output's
hand-back) is ``other``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
from common import PROMPTS, publish
from engine_workers import Worker
from step_batching import HERE, _device, cached_model

COMPONENTS = (
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "vae_encode",
    "denoise",
    "denoise_step",
    "preview",
    "vae_decode",
    "postprocess",
)
"""The components a breakdown reads, in the order they run (`vllm_omni.diffusion.pipeline.timings`)."""
TARGET = 0.99


def engine_sums(omni, variant: str) -> np.ndarray:
    """The engine's seconds and observations per component, then its batch execution seconds (a worker's
    ``report``: the run's figures get the difference)."""
    engine = omni.engine.stages[0].replicas[0].engine
    seconds, counts, execution = dict.fromkeys(COMPONENTS, 0.0), dict.fromkeys(COMPONENTS, 0.0), 0.0
    for family in engine.metrics.collect():
        for sample in family.samples:
            if sample.name == "vllm_omni:component_seconds_sum":
                seconds[sample.labels["component"]] = sample.value
            elif sample.name == "vllm_omni:component_seconds_count":
                counts[sample.labels["component"]] = sample.value
            elif sample.name == "vllm_omni:batch_execution_time_seconds_sum":
                execution = sample.value
    return np.array([*seconds.values(), *counts.values(), execution])


def breakdown(sums: np.ndarray) -> dict:
    """Each component's mean ms per request and share of the execution time."""
    n = len(COMPONENTS)
    seconds, counts, execution = sums[:n], sums[n : 2 * n], sums[-1]
    requests = counts[COMPONENTS.index("denoise")]
    rows = {}
    for name, total, count in zip(COMPONENTS, seconds, counts, strict=True):
        if count:
            mean = total / count if name == "denoise_step" else total / requests
            share = None if name == "denoise_step" else round(total / execution, 4)
            rows[name] = {"ms": round(1000 * mean, 2), "share": share}
    timed = sum(total for name, total in zip(COMPONENTS, seconds, strict=True) if name != "denoise_step")
    rows["other"] = {"ms": round(1000 * (execution - timed) / requests, 2), "share": round(1 - timed / execution, 4)}
    return {"execution_ms": round(1000 * execution / requests, 2), "components": rows}


def sequential(requests: int, params: dict) -> list[list[tuple[str, dict]]]:
    """One client sending ``requests`` requests one after another."""
    return [[(PROMPTS[i % len(PROMPTS)], {**params, "seed": i}) for i in range(requests)]]


def run(args: argparse.Namespace) -> dict:
    width, height = map(int, args.size.split("x"))
    base = {"width": width, "height": height, "num_inference_steps": args.steps}
    result = {"config": vars(args) | {"device": _device()}, "breakdown": {}, "overhead": {}}

    # Flux: timings on and off, whose "on" runs also give its breakdown.
    workers = {"on": Worker("on", report=engine_sums), "off": Worker("off", report=engine_sums)}
    try:
        model = cached_model(args.model_dir, "flux")
        for variant, worker in workers.items():
            worker.start(model, {"max_num_seqs": 1, "component_timings": variant == "on"})
        for worker in workers.values():
            worker.answer()
            worker.run("warm", sequential(2, base))
        reps, sums = [], 0
        for rep in range(args.reps):
            order = ("on", "off") if rep % 2 == 0 else ("off", "on")
            figures = {v: workers[v].run(v, sequential(args.requests, base)) for v in order}
            reps.append({v: figures[v]["req_per_s"] for v in order})
            sums = sums + figures["on"]["report"]
    finally:
        for worker in workers.values():
            worker.close()
    ratio = statistics.median(r["on"] / r["off"] for r in reps)
    result["overhead"] = {"reps": reps, "on_over_off": round(ratio, 4), "target": TARGET, "met": ratio >= TARGET}
    if "flux" in args.families.split(","):
        result["breakdown"]["flux"] = breakdown(sums)

    for family in (f for f in args.families.split(",") if f != "flux"):
        params = base | ({"num_frames": args.frames} if family == "wan" else {})
        worker = Worker(family, report=engine_sums)
        try:
            worker.start(cached_model(args.model_dir, family), {"max_num_seqs": 1})
            worker.answer()
            worker.run("warm", sequential(2, params))
            result["breakdown"][family] = breakdown(worker.run("measure", sequential(args.requests, params))["report"])
        finally:
            worker.close()
    return result


def markdown(result: dict) -> str:
    lines = ["| family | component | ms per request | share of execution |", "|---|---|---|---|"]
    for family, found in result["breakdown"].items():
        for name, row in found["components"].items():
            share = "" if row["share"] is None else f"{100 * row['share']:.1f} %"
            label = f"{name} (mean step)" if name == "denoise_step" else name
            lines.append(f"| {family} | {label} | {row['ms']} | {share} |")
        lines.append(f"| {family} | **execution** | {found['execution_ms']} | 100 % |")
    overhead = result["overhead"]
    lines += [
        "",
        "| timings on ÷ off (req/s, median of reps) | target | met |",
        "|---|---|---|",
        f"| {overhead['on_over_off']} | ≥ {overhead['target']} | {'yes' if overhead['met'] else 'no'} |",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="flux,sd3,wan", help="comma-separated tiny families to break down")
    parser.add_argument("--size", default="64x64", help="WxH of every request")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps of every request")
    parser.add_argument("--frames", type=int, default=5, help="frames of a video family's requests")
    parser.add_argument("--requests", type=int, default=48, help="requests per measurement")
    parser.add_argument("--reps", type=int, default=7, help="reps of the on/off comparison")
    parser.add_argument("--quick", action="store_true", help="smoke: flux only, 2 requests, 2 reps")
    parser.add_argument(
        "--model-dir", default=os.path.join(os.path.dirname(HERE), ".tiny-models"), help="where tiny models are built"
    )
    parser.add_argument("--out-dir", default=f"{HERE}/results", help="where <name>.json and .md go")
    parser.add_argument("--name", default="cpu-tiny-component-timings", help="results/<name>.{json,md}")
    args = parser.parse_args(argv)
    if args.quick:
        args.families, args.requests, args.reps = "flux", 2, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    publish(result, markdown(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
