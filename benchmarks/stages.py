"""Split pipelines: one ``diffusion`` stage against ``encode → denoise → decode`` under the same load, in one run.

    python benchmarks/stages.py --out-dir benchmarks/results --name cpu-tiny-stages
    python benchmarks/stages.py [--families flux,wan] [--deploys single,split,split-step] [--concurrency 32]
        [--num-requests 64] [--reps 3] [--steps 20] [--size WxH] [--frames 5] [--warmup 8]

Per family (tiny random-weight models built once into ``--model-dir``; flux: images, 64x64; wan: videos,
32x32, 5 frames; 20 steps) it starts every deploy through `AsyncOmni`, all in this process:

- ``single``: one ``diffusion`` stage, ``max_num_seqs 4``, request mode;
- ``split``: ``encode`` (max 16) → ``denoise`` (max 4, request mode) → ``decode`` (max 8);
- ``split-step``: the same, with the ``denoise`` stage in ``execution_mode: step``.

Each deploy is warmed up (``--warmup`` requests at once), then each rep runs every deploy in turn (the order
alternates per rep, so a shared machine's drift hits all alike) under the same closed loop: ``--concurrency``
workers submit ``--num-requests`` requests in all, each worker its next request as soon as its last one is
done; request i has its own prompt and seed i in every deploy and rep. Per deploy it records req/s and the p50
and p99 end-to-end latency (median over the reps; every rep kept in the JSON) and, per stage, from each output's
``metrics["stages"]`` (or ``metrics`` for a single stage), the batch size each request ran in (mean over the
requests; max over all reps) and the mean queue_ms and exec_ms (exec_ms: the wall time of the request's batch).
In step mode a request's batch_size is its mean batch over its denoising steps, and its exec_ms runs from its first
to its last step. All stages share this process's CPU: on a small machine they compete for the same cores.

It reports the ratios split / single for req/s, p50 and p99, and checks (never an exit code) that
each stage's largest observed batch is at most its own ``max_num_seqs`` and that under this load it reaches it.
Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np
from common import PROMPTS, Shape, publish
from step_batching import DEFAULT_SIZES, HERE, TASKS, _device, _ratio, cached_model

from vllm_omni import AsyncOmni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.outputs import RequestMetrics, StageMetrics

DEPLOYS = ("single", "split", "split-step")
SINGLE_MAX, ENCODE_MAX, DENOISE_MAX, DECODE_MAX = 4, 16, 4, 8


def deploy_config(deploy: str) -> DeployConfig:
    """The stages of ``deploy`` (one of `DEPLOYS`)."""
    if deploy == "single":
        return DeployConfig(stages=[StageDeployConfig(stage_id=0, stage_type="diffusion", max_num_seqs=SINGLE_MAX)])
    mode = "step" if deploy == "split-step" else "request"
    return DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode", max_num_seqs=ENCODE_MAX),
            StageDeployConfig(
                stage_id=1, stage_type="denoise", inputs=(0,), max_num_seqs=DENOISE_MAX, execution_mode=mode
            ),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=(1,), max_num_seqs=DECODE_MAX),
        ]
    )


def requests(count: int, shape: Shape, seed: int) -> list[tuple[str, OmniDiffusionSamplingParams]]:
    """``count`` (prompt, params): distinct prompts, seed ``seed + i``, the same in every deploy and rep."""
    return [
        (
            f"{PROMPTS[i % len(PROMPTS)]}, take {i}",
            OmniDiffusionSamplingParams(
                height=shape.height,
                width=shape.width,
                num_inference_steps=shape.steps,
                num_frames=shape.frames,
                seed=seed + i,
            ),
        )
        for i in range(count)
    ]


async def closed_loop(omni: AsyncOmni, work: list, concurrency: int) -> tuple[float, list[tuple[float, dict]]]:
    """Run ``work`` with ``concurrency`` workers; (wall seconds, [(e2e seconds, metrics)] in request order)."""
    results: list = [None] * len(work)
    pending = iter(range(len(work)))

    async def worker() -> None:
        for i in pending:
            prompt, params = work[i]
            started = time.perf_counter()
            outputs = [o async for o in omni.generate(prompt, params)]
            if len(outputs) != 1:
                raise RuntimeError(f"request {i} ended with {len(outputs)} outputs (aborted?)")
            results[i] = (time.perf_counter() - started, outputs[0].metrics)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(work)))))
    return time.perf_counter() - started, results


def stage_records(metrics: RequestMetrics) -> list[StageMetrics]:
    """One record per stage the request passed (a single stage's metrics are the output's own)."""
    return metrics.stages or [StageMetrics.of(0, "diffusion", metrics)]


def summarize_rep(wall: float, results: list[tuple[float, RequestMetrics]]) -> dict:
    latencies = [e2e for e2e, _ in results]
    per_stage: dict[int, list[dict]] = {}
    for _, metrics in results:
        for record in stage_records(metrics):
            per_stage.setdefault(record["stage_id"], []).append(record)
    return {
        "req_per_s": len(results) / wall,
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "stages": {
            sid: {
                "batch_mean": statistics.fmean(r["batch_size"] for r in records),
                "batch_max": max(r["batch_size"] for r in records),
                "queue_ms_mean": statistics.fmean(r["queue_ms"] for r in records),
                "exec_ms_mean": statistics.fmean(r["exec_ms"] for r in records),
            }
            for sid, records in sorted(per_stage.items())
        },
    }


def deploy_row(family: str, shape: Shape, deploy: str, config: DeployConfig, reps: list[dict]) -> dict:
    """One deploy's result: medians over the reps (max for the largest batch), every rep kept."""

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    stages = []
    for stage in config.stages:
        mine = [rep["stages"][stage.stage_id] for rep in reps]
        batch_max = max(s["batch_max"] for s in mine)
        stages.append(
            {
                "stage_id": stage.stage_id,
                "stage_type": stage.stage_type,
                "execution_mode": stage.execution_mode,
                "max_num_seqs": stage.max_num_seqs,
                "batch_mean": med([s["batch_mean"] for s in mine]),
                "batch_max": batch_max,
                "queue_ms_mean": med([s["queue_ms_mean"] for s in mine]),
                "exec_ms_mean": med([s["exec_ms_mean"] for s in mine]),
                "within_max": batch_max <= stage.max_num_seqs,
                "reaches_max": batch_max >= stage.max_num_seqs,
            }
        )
    return {
        "family": family,
        "shape": str(shape),
        "deploy": deploy,
        "req_per_s": med([r["req_per_s"] for r in reps]),
        "p50_ms": med([r["p50_ms"] for r in reps]),
        "p99_ms": med([r["p99_ms"] for r in reps]),
        "stages": stages,
        "reps": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "stages"}
            | {"stages": {sid: {k: round(v, 3) for k, v in s.items()} for sid, s in r["stages"].items()}}
            for r in reps
        ],
    }


async def measure_family(family: str, args) -> list[dict]:
    task = TASKS[family]
    model = args.model or cached_model(args.model_dir, family)
    width, height = (int(v) for v in (args.size or DEFAULT_SIZES[task]).split("x"))
    shape = Shape(width, height, args.steps, frames=args.frames if task == "video" else None)
    work = requests(args.num_requests, shape, args.seed)
    warm_up = requests(args.warmup, shape, args.seed + args.num_requests)
    configs = {deploy: deploy_config(deploy) for deploy in args.deploys}
    omnis: dict[str, AsyncOmni] = {}
    reps: dict[str, list[dict]] = {deploy: [] for deploy in args.deploys}
    try:
        for deploy, config in configs.items():
            print(f"[{family} {shape}] starting {deploy}", flush=True)
            omnis[deploy] = AsyncOmni(model, deploy_config=config)
            if warm_up:
                await closed_loop(omnis[deploy], warm_up, len(warm_up))
        for rep in range(args.reps):
            for deploy in args.deploys if rep % 2 == 0 else args.deploys[::-1]:
                summary = summarize_rep(*await closed_loop(omnis[deploy], work, args.concurrency))
                reps[deploy].append(summary)
                batches = ", ".join(f"{s['batch_mean']:.2f}/{s['batch_max']:g}" for s in summary["stages"].values())
                print(
                    f"[{family} {shape}] rep {rep + 1} {deploy}: {summary['req_per_s']:.3f} req/s, e2e p50/p99 "
                    f"{summary['p50_ms']:.0f}/{summary['p99_ms']:.0f} ms, batch mean/max per stage {batches}",
                    flush=True,
                )
    finally:
        for omni in omnis.values():
            omni.shutdown()
    return [deploy_row(family, shape, deploy, configs[deploy], reps[deploy]) for deploy in args.deploys]


def ratios(rows: list[dict]) -> list[dict]:
    """Per family and split deploy: its req/s, p50 and p99 over the single stage's."""
    found = []
    for row in rows:
        single = next((r for r in rows if r["family"] == row["family"] and r["deploy"] == "single"), None)
        if single and row["deploy"] != "single":
            found.append(
                {
                    "family": row["family"],
                    "deploy": row["deploy"],
                    "req_per_s": _ratio(row["req_per_s"], single["req_per_s"]),
                    "p50": _ratio(row["p50_ms"], single["p50_ms"]),
                    "p99": _ratio(row["p99_ms"], single["p99_ms"]),
                }
            )
    return found


def check_lines(rows: list[dict], concurrency: int) -> list[str]:
    """Per stage: FAIL when its largest batch exceeds its max_num_seqs; PASS when it reaches it; BOUNDED when the
    load could not hand it that many at once (fewer requests in flight, or an upstream stage that hands on at
    most its own max_num_seqs at a time while this stage is idle); NOT REACHED otherwise."""
    lines = []
    for row in rows:
        for index, s in enumerate(row["stages"]):
            why = "" if s["reaches_max"] else " (never reached)" if s["within_max"] else " (exceeded!)"
            upstream = row["stages"][index - 1] if index else None
            bounded = True
            if not s["reaches_max"] and concurrency < s["max_num_seqs"]:
                why += f"; only {concurrency} requests are in flight"
            elif not s["reaches_max"] and upstream and upstream["max_num_seqs"] < s["max_num_seqs"]:
                why += (
                    f"; stage {upstream['stage_id']} ({upstream['stage_type']}) hands on at most "
                    f"{upstream['max_num_seqs']} at once"
                )
            else:
                bounded = False
            if not s["within_max"]:
                verdict = "FAIL"
            else:
                verdict = "PASS" if s["reaches_max"] else "BOUNDED" if bounded else "NOT REACHED"
            lines.append(
                f"{verdict}: {row['family']} {row['deploy']} stage {s['stage_id']} ({s['stage_type']}): largest "
                f"batch {s['batch_max']:g} vs max_num_seqs {s['max_num_seqs']}{why}"
            )
    return lines


def tables(result: dict) -> str:
    lines = [
        "| family | deploy | req/s (median) | req/s per rep | e2e p50 (ms) | e2e p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per_rep = ", ".join(f"{rep['req_per_s']:.2f}" for rep in r["reps"])
        lines.append(
            f"| {r['family']} {r['shape']} | {r['deploy']} | {r['req_per_s']:.3f} | {per_rep} "
            f"| {r['p50_ms']:.0f} | {r['p99_ms']:.0f} |"
        )
    lines += [
        "",
        "| family | deploy | stage | max_num_seqs | batch mean / max | queue ms mean | exec ms mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        for s in r["stages"]:
            mode = " (step)" if s["stage_type"] in ("diffusion", "denoise") and s["execution_mode"] == "step" else ""
            lines.append(
                f"| {r['family']} | {r['deploy']} | {s['stage_id']} {s['stage_type']}{mode} | {s['max_num_seqs']} "
                f"| {s['batch_mean']:.2f} / {s['batch_max']:g} | {s['queue_ms_mean']:.1f} | {s['exec_ms_mean']:.1f} |"
            )
    lines.append("")
    for q in result["ratios"]:
        lines.append(
            f"- {q['family']} {q['deploy']} / single: req/s **{q['req_per_s']}x**, p50 {q['p50']}x, p99 {q['p99']}x"
        )
    lines += [f"- {line}" for line in result["checks"]]
    config = result["config"]
    lines.append("")
    lines.append(
        f"{result['device']}; closed loop: {config['concurrency']} workers, {config['num_requests']} requests per "
        f"rep, {config['reps']} reps (deploys interleaved), medians; largest batch: over all reps. batch: requests "
        "per call of the stage (step mode: a request's mean batch over its denoising steps); exec ms: the wall "
        "time of the request's batch (step mode: from its first to its last step, other requests' steps included)."
    )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="flux,wan", help="comma-separated: flux (images), wan (videos)")
    parser.add_argument("--deploys", default=",".join(DEPLOYS), help=f"comma-separated, of {', '.join(DEPLOYS)}")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop workers")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per (deploy, rep)")
    parser.add_argument("--reps", type=int, default=3, help="runs per deploy, interleaved; medians")
    parser.add_argument("--warmup", type=int, default=8, help="requests at once per deploy before measuring")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per request")
    parser.add_argument("--size", help="WxH (default: 64x64 for images, 32x32 for videos)")
    parser.add_argument("--frames", type=int, default=5, help="frames per video (video families)")
    parser.add_argument("--seed", type=int, default=0, help="request i has seed SEED + i")
    parser.add_argument("--model", help="diffusers folder (one family only; default: build the tiny one)")
    parser.add_argument(
        "--model-dir",
        default=os.path.join(os.path.dirname(HERE), ".tiny-models"),
        help="where the tiny models are built, once",
    )
    parser.add_argument("--out-dir", help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="stages")
    args = parser.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.deploys = [d for d in args.deploys.split(",") if d]
    if unknown := [f for f in args.families if TASKS.get(f) is None]:
        parser.error(f"unknown families {unknown}; choose from {sorted(TASKS)}")
    if unknown := [d for d in args.deploys if d not in DEPLOYS]:
        parser.error(f"unknown deploys {unknown}; choose from {', '.join(DEPLOYS)}")
    if args.model and len(args.families) != 1:
        parser.error("--model is one family's: give exactly one in --families")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    rows = [row for family in args.families for row in asyncio.run(measure_family(family, args))]
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            k: getattr(args, k)
            for k in (
                "families",
                "deploys",
                "concurrency",
                "num_requests",
                "reps",
                "warmup",
                "steps",
                "size",
                "frames",
                "seed",
            )
        },
        "rows": rows,
        "ratios": ratios(rows),
        "checks": check_lines(rows, args.concurrency),
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
