"""Step-level continuous batching against request-level batching: queue wait, throughput and latency under load.

    python benchmarks/step_batching.py [--name cpu-tiny-step] [--families flux[,wan]] [--modes request,step]
        [--loads 0.5,0.8,0.95] [--num-requests 48] [--max-num-seqs 4] [--steps 20] [--size 64x64] [--quick]

For each family it builds the tiny random-weight model once (``--model-dir``,
default ``.tiny-models/``; flux: images, 64x64; wan: videos, 32x32, 5 frames),
then starts one ``vllm serve MODEL --omni --max-num-seqs N --execution-mode
MODE`` server per mode, kept up for the whole family, and

1. measures each server in a closed loop at concurrency N (after a warm-up),
   ``--capacity-reps`` times, interleaved, keeping the best run; the
   request-mode figure is the **capacity** (completed requests/s);
2. for every load L (fraction of the capacity) runs bench_serving with Poisson
   arrivals at ``L × capacity`` req/s against each mode in turn, ``--reps``
   times: each rep has its own arrival schedule, the same for both modes, and
   the order of the modes alternates, so slow drifts of a shared machine hit
   both alike.

Per (family, mode, load), as the median over the reps, it records client req/s, end-to-end latency
mean/p50/p90, the server's queue wait (arrival → the engine starts on the
request: mean, and p90 estimated from the histogram buckets) and mean batch
size (requests per pipeline call in request mode, per denoising step in step
mode). The targets, at 80 % load: request-mode mean queue wait ÷ step-mode
≥ 8, step req/s ÷ request req/s ≥ 0.95, step p90 e2e ÷ request p90 e2e ≤ 1.0.
They are reported (pass/fail), never turned into an exit code.
Writes benchmarks/results/<name>.json, <name>.md (table) and <name>.png (plot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time

from bench_serving import run_benchmark
from common import Shape

from vllm_omni.codec.families import SPEECH_FAMILIES
from vllm_omni.testing.models.tiny import make_tiny_model
from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = {
    "flux": "image",
    "sd": "image",
    "flux-bench": "image",
    "wan": "video",
    "qwen-image": "image",
    "z-image": "image",
}
DEFAULT_SIZES = {"image": "64x64", "video": "32x32"}
TARGET_LOAD = 0.8
TARGETS = (  # (key, description, comparison, threshold)
    ("queue_wait_request_over_step", "request mean queue wait / step mean queue wait", ">=", 8.0),
    ("throughput_step_over_request", "step req/s / request req/s", ">=", 0.95),
    ("p90_e2e_step_over_request", "step p90 e2e / request p90 e2e", "<=", 1.0),
)


def cached_model(model_dir: str, family: str) -> str:
    """The tiny ``family`` model under ``model_dir`` (a diffusers folder, a transformers one for ``llm``, or a
    speech family's ``talker/`` and ``codec/``), built (atomically) the first time."""
    path = os.path.abspath(os.path.join(model_dir, family))
    built = "config.json" if family == "llm" else "model_index.json"
    if family in SPEECH_FAMILIES:
        built = os.path.join("talker", "config.json")
    if not os.path.isfile(os.path.join(path, built)):
        os.makedirs(model_dir, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=model_dir, prefix=f".{family}-")
        make_tiny_model(scratch, family)
        try:
            os.rename(scratch, path)
        except OSError:  # another run built it meanwhile
            shutil.rmtree(scratch, ignore_errors=True)
    return path


def start_server(model: str, mode: str, args, log_dir: str) -> RemoteOmniServer:
    """A started ``vllm serve MODEL --omni --execution-mode MODE`` server; its log is kept in ``log_dir``."""
    server_args = [
        "--execution-mode",
        mode,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        "--max-waiting-requests",
        str(max(64, args.num_requests + args.max_num_seqs)),
    ]
    log_path = os.path.join(log_dir, f"{os.path.basename(model)}-{mode}.log")
    try:
        return RemoteOmniServer(model, server_args, log_path=log_path).__enter__()
    except RuntimeError:
        with open(log_path) as f:
            raise RuntimeError(f"the {mode} server did not start; its log ends:\n{f.read()[-3000:]}") from None


def _bench(server: RemoteOmniServer, shape: Shape, task: str, args, **load) -> dict:
    run = asyncio.run(
        run_benchmark(server.base_url, shapes=[shape], task=task, progress=False, poll_ms=args.poll_ms, **load)
    )
    if run["failed"]:
        print(f"  WARNING: {run['failed']} requests failed: {run['failed_statuses']} {run['errors'][:2]}", flush=True)
    return run


def _row(family: str, task: str, shape: Shape, mode: str, load: float, rate: float, run: dict) -> dict:
    server = run["server"]
    return {
        "family": family,
        "task": task,
        "shape": str(shape),
        "mode": mode,
        "load": load,
        "request_rate": round(rate, 4),
        "completed": run["completed"],
        "failed": run["failed"],
        "duration_s": run["duration_s"],
        "requests_per_s": run["requests_per_s"],
        "latency_mean_s": run["latency_mean_s"],
        "latency_p50_s": run["latency_p50_s"],
        "latency_p90_s": run["latency_p90_s"],
        "latency_p99_s": run["latency_p99_s"],
        "queue_wait_mean_ms": server["mean_queue_wait_ms"],
        "queue_wait_p90_ms_est": server["p90_queue_wait_ms_est"],
        "mean_batch_size": server["mean_batch_size"],
        "executed_batches": server["executed_batches"],
        "mean_batch_exec_ms": server["mean_batch_exec_ms"],
        "peak_rss_mb": server["peak_rss_mb"],
    }


def measure_family(family: str, args, log_dir: str) -> tuple[dict, list[dict]]:
    task = TASKS[family]
    model = args.model or cached_model(args.model_dir, family)
    width, height = (int(v) for v in (args.size or DEFAULT_SIZES[task]).split("x"))
    shape = Shape(width, height, args.steps, frames=args.frames if task == "video" else None)
    n = args.max_num_seqs
    servers, closed_loop = {}, {}
    info = {"family": family, "task": task, "model": model, "shape": str(shape)}
    try:
        for mode in args.modes:
            print(f"[{family}] starting the {mode}-mode server", flush=True)
            servers[mode] = start_server(model, mode, args, log_dir)
        # A shared machine's noise only ever slows a run down, so the best of a few interleaved closed-loop
        # runs is the closest estimate of what each mode can do.
        for rep in range(args.capacity_reps):
            for mode in args.modes:
                run = _bench(
                    servers[mode],
                    shape,
                    task,
                    args,
                    num_requests=args.capacity_requests,
                    concurrency=n,
                    warmup=args.warmup if rep == 0 else 0,
                )
                print(
                    f"[{family}] {mode}: closed loop at concurrency {n}: {run['requests_per_s']:.3f} req/s", flush=True
                )
                if mode not in closed_loop or run["requests_per_s"] > closed_loop[mode]["requests_per_s"]:
                    closed_loop[mode] = {
                        "requests_per_s": run["requests_per_s"],
                        "latency_mean_s": run["latency_mean_s"],
                        "mean_batch_size": run["server"]["mean_batch_size"],
                        "failed": run["failed"],
                    }
        capacity = closed_loop["request" if "request" in closed_loop else args.modes[0]]["requests_per_s"]
        info |= {"capacity_requests_per_s": capacity, "closed_loop": closed_loop}
        rows = []
        for index, load in enumerate(args.loads):
            rate = load * capacity
            runs = {mode: [] for mode in args.modes}
            for rep in range(args.reps):  # each rep its own arrival schedule, the same for both modes
                for mode in args.modes if (index + rep) % 2 == 0 else args.modes[::-1]:
                    run = _bench(
                        servers[mode],
                        shape,
                        task,
                        args,
                        num_requests=args.num_requests,
                        request_rate=rate,
                        warmup=0,
                        seed=args.seed + rep,
                    )
                    runs[mode].append(_row(family, task, shape, mode, load, rate, run))
                    r = runs[mode][-1]
                    print(
                        f"[{family}] load {load:.0%} {mode} (rep {rep + 1}): {r['requests_per_s']:.3f} req/s, queue "
                        f"wait {r['queue_wait_mean_ms']} ms (p90~{r['queue_wait_p90_ms_est']}), e2e mean/p90 "
                        f"{r['latency_mean_s']}/{r['latency_p90_s']} s, mean batch {r['mean_batch_size']}",
                        flush=True,
                    )
            rows += [_median_row(mode_runs) for mode_runs in runs.values()]
    finally:
        for mode, server in servers.items():
            if server.stop() != 0:
                print(f"WARNING: the {family} {mode}-mode server exited with {server.returncode}", flush=True)
    order = {m: i for i, m in enumerate(args.modes)}
    rows.sort(key=lambda r: (r["load"], order[r["mode"]]))
    return info, rows


def _median_row(runs: list[dict]) -> dict:
    """One row for a (mode, load) point: the median over its reps of every number (each rep kept under ``reps``)."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("load", "request_rate"):
            values = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.median(values) if values else None
    return row | {"reps": runs}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def ratios(rows: list[dict]) -> list[dict]:
    """Per (family, load) with both modes: the three ratios the targets use."""
    found = []
    for family, load in dict.fromkeys((r["family"], r["load"]) for r in rows):
        by_mode = {r["mode"]: r for r in rows if (r["family"], r["load"]) == (family, load)}
        if {"request", "step"} <= set(by_mode):
            request, step = by_mode["request"], by_mode["step"]
            found.append(
                {
                    "family": family,
                    "load": load,
                    "queue_wait_request_over_step": _ratio(request["queue_wait_mean_ms"], step["queue_wait_mean_ms"]),
                    "throughput_step_over_request": _ratio(step["requests_per_s"], request["requests_per_s"]),
                    "p90_e2e_step_over_request": _ratio(step["latency_p90_s"], request["latency_p90_s"]),
                }
            )
    return found


def targets(ratio_rows: list[dict], families: list[str]) -> list[dict]:
    """Pass/fail per target and family at the load nearest 80 % (``None`` when a mode is missing)."""
    found = []
    for family in families:
        mine = [r for r in ratio_rows if r["family"] == family]
        at = min(mine, key=lambda r: abs(r["load"] - TARGET_LOAD)) if mine else None
        for key, description, op, threshold in TARGETS:
            value = at[key] if at else None
            ok = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
            found.append(
                {
                    "family": family,
                    "load": at["load"] if at else None,
                    "target": key,
                    "description": description,
                    "op": op,
                    "threshold": threshold,
                    "value": value,
                    "pass": ok,
                }
            )
    return found


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| family | load | mode | req/s | queue wait mean / p90~ (ms) | e2e mean / p90 (ms) | mean batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e2e = " / ".join(_ms(None if r[k] is None else 1000 * r[k]) for k in ("latency_mean_s", "latency_p90_s"))
        lines.append(
            f"| {r['family']} {r['shape']} | {r['load']:.0%} | {r['mode']} | {r['requests_per_s']:.2f} | "
            f"{_ms(r['queue_wait_mean_ms'])} / {_ms(r['queue_wait_p90_ms_est'])} | {e2e} | {r['mean_batch_size']} |"
        )
    return "\n".join(lines)


def target_lines(found: list[dict]) -> list[str]:
    lines = []
    for t in found:
        verdict = {True: "PASS", False: "FAIL", None: "n/a (needs both modes)"}[t["pass"]]
        load = f"{t['load']:.0%}" if t["load"] is not None else "–"
        lines.append(
            f"{t['family']} @ {load} load: {t['description']} = {t['value']} "
            f"(target {t['op']} {t['threshold']}): {verdict}"
        )
    return lines


def plot(rows: list[dict], families: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(families), 2, figsize=(11, 4.2 * len(families)), squeeze=False)
    colors = {"request": "tab:blue", "step": "tab:orange"}
    for (queue, latency), family in zip(axes, families, strict=True):
        mine = [r for r in rows if r["family"] == family]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            points = sorted((r for r in mine if r["mode"] == mode), key=lambda r: r["load"])
            loads = [100 * r["load"] for r in points]
            color = colors.get(mode)
            queue.plot(loads, [r["queue_wait_mean_ms"] for r in points], "o-", color=color, label=f"{mode} mean")
            latency.plot(loads, [1000 * r["latency_mean_s"] for r in points], "o-", color=color, label=f"{mode} mean")
            latency.plot(loads, [1000 * r["latency_p90_s"] for r in points], "^--", color=color, label=f"{mode} p90")
        shape = mine[0]["shape"] if mine else ""
        queue.set_title(f"{family} {shape}: server queue wait")
        queue.set_ylabel("mean queue wait (ms)")
        latency.set_title(f"{family} {shape}: end-to-end latency")
        latency.set_ylabel("latency (ms)")
        waits = [r["queue_wait_mean_ms"] for r in mine]
        if waits and all(w is not None and w > 0 for w in waits) and max(waits) >= 10 * min(waits):
            queue.set_yscale("log")  # the modes differ by an order of magnitude
        else:
            queue.set_ylim(bottom=0)
        latency.set_ylim(bottom=0)
        for axis in (queue, latency):
            axis.set_xlabel("load (% of request-mode closed-loop capacity)")
            axis.grid(alpha=0.3, which="both")
            axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="cpu-tiny-step", help="results/<name>.{json,md,png}")
    parser.add_argument("--families", default="flux", help=f"comma-separated, of {sorted(TASKS)}")
    parser.add_argument("--modes", default="request,step", help="comma-separated execution modes")
    parser.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of the request-mode capacity")
    parser.add_argument("--num-requests", type=int, default=48, help="requests per (mode, load) point")
    parser.add_argument("--capacity-requests", type=int, help="requests of each closed-loop run (default 8 × N)")
    parser.add_argument("--capacity-reps", type=int, default=3, help="closed-loop runs per mode; the best counts")
    parser.add_argument(
        "--reps", type=int, default=3, help="runs per (mode, load), each with its own arrivals; medians"
    )
    parser.add_argument("--max-num-seqs", type=int, default=4, help="N: --max-num-seqs and closed-loop concurrency")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per request")
    parser.add_argument("--size", help="WxH (default: 64x64 for images, 32x32 for videos)")
    parser.add_argument("--frames", type=int, default=5, help="frames per video (video families)")
    parser.add_argument("--warmup", type=int, default=2, help="closed-loop warm-up rounds per server")
    parser.add_argument("--seed", type=int, default=0, help="arrival schedule and request seeds")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="video job polling interval")
    parser.add_argument("--model", help="diffusers folder to serve (one family only; default: build it)")
    parser.add_argument(
        "--model-dir",
        default=os.path.join(os.path.dirname(HERE), ".tiny-models"),
        help="where the tiny models are built, once",
    )
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke defaults: 32x32, 4 steps, 6 requests per point, load 0.8, 1 warm-up round, 1 capacity run",
    )
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(size="32x32", steps=4, num_requests=6, loads="0.8", warmup=1, capacity_reps=1, reps=1)
    args = parser.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    args.modes = [m for m in args.modes.split(",") if m]
    args.loads = [float(x) for x in args.loads.split(",")]
    args.capacity_requests = args.capacity_requests or 8 * args.max_num_seqs
    if unknown := [f for f in args.families if f not in TASKS]:
        parser.error(f"unknown families {unknown}; choose from {sorted(TASKS)}")
    if unknown := [m for m in args.modes if m not in ("request", "step")]:
        parser.error(f"unknown modes {unknown}; choose from request, step")
    if args.model and len(args.families) != 1:
        parser.error("--model serves one family: give exactly one in --families")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    infos, rows = [], []
    with tempfile.TemporaryDirectory(prefix="step-batching-logs-") as log_dir:
        for family in args.families:
            info, family_rows = measure_family(family, args, log_dir)
            infos.append(info)
            rows += family_rows
    found_ratios = ratios(rows)
    found_targets = targets(found_ratios, args.families)
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    summary = {
        "name": args.name,
        "device": _device(),
        "wall_s": round(time.perf_counter() - started, 1),
        "config": {
            "families": args.families,
            "modes": args.modes,
            "loads": args.loads,
            "num_requests": args.num_requests,
            "capacity_requests": args.capacity_requests,
            "capacity_reps": args.capacity_reps,
            "reps": args.reps,
            "max_num_seqs": args.max_num_seqs,
            "steps": args.steps,
            "size": args.size,
            "frames": args.frames,
            "warmup": args.warmup,
            "seed": args.seed,
            "poll_ms": args.poll_ms,
            "quick": args.quick,
        },
        "families": infos,
        "rows": rows,
        "ratios": found_ratios,
        "targets": found_targets,
    }
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    capacity_lines = [
        f"{i['family']} {i['shape']}: capacity {i['capacity_requests_per_s']:.3f} req/s (request mode, closed loop at "
        f"concurrency {args.max_num_seqs}); closed loop per mode: "
        + ", ".join(f"{m} {c['requests_per_s']:.3f} req/s" for m, c in i["closed_loop"].items())
        for i in infos
    ]
    notes = [
        "queue wait: the server's arrival → engine starts the request (p90~: estimated from histogram buckets);",
        "mean batch: requests per pipeline call (request mode) or per denoising step (step mode).",
    ]
    with open(base + ".md", "w") as f:
        f.write(table(rows) + "\n\n")
        f.write("".join(f"- {line}\n" for line in capacity_lines + target_lines(found_targets)))
        f.write("\n" + " ".join(notes) + "\n")
    plot(rows, args.families, base + ".png", f"{args.name} ({summary['device']}, --max-num-seqs {args.max_num_seqs})")
    print(table(rows))
    print("\n".join(capacity_lines + target_lines(found_targets)))
    print(f"took {summary['wall_s']} s; wrote {base}.json, {base}.md, {base}.png")


if __name__ == "__main__":
    main()
