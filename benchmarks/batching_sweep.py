"""Batching efficiency sweep: served throughput at --max-num-seqs N against the offline batch-N ceiling.

    python benchmarks/batching_sweep.py [--name cpu-tiny-flux] [--family flux] [--model DIR]
        [--max-num-seqs 1,2,4,8] [--shapes 32x32:4,64x64:4] [--blocks 6] [--rounds 4]
    python benchmarks/batching_sweep.py --fast [--baseline /tmp/before]   # 64x64, 1 and 4 steps, N = 1,4,8
    python benchmarks/batching_sweep.py --fast --model MY_MODEL --shapes 512x512:4   # your own model and shape

Two bench_offline worker processes, started once for the whole sweep, hold the
same pipeline: one runs all torch work on its main thread and one runs it on one
dedicated thread (each call takes its batch size). For each N it starts
`vllm serve MODEL --omni --max-num-seqs N`, and for each shape it then alternates, ``--blocks`` times:
bench_serving at concurrency N for ``--rounds`` requests per client, then ``--rounds`` direct batch-N
pipeline calls in each worker. Blocks this short make the slow drifts of a
shared machine hit both sides alike. Writes benchmarks/results/<name>.json,
<name>.md (tables) and <name>.png (plot).

The ceiling is the fastest direct call: per shape and N, the better of the two
workers (all blocks). Batching efficiency = served images/s ÷ ceiling images/s.
Concurrency-1 overhead = served mean latency at N=1 ÷ the faster worker's mean
batch-1 call. The targets (efficiency ≥ 0.90 at N = 4 and 8, concurrency-1
overhead ≤ 1.10) are checked and reported, never an exit code.

``--baseline DIR`` runs every case a second time with servers and workers that
import vllm_omni from the checkout DIR (e.g. a ``git worktree`` of the commit
before a change), interleaved with the current code block by block, and reports
both side by side with the ratio current ÷ baseline. The baseline's server and
workers run with ``PYTHONPATH`` and the working directory set to its checkout,
and so do the current code's where this process does not import vllm_omni from
this checkout; else its workers are forks of the preloaded forkserver
(`common.Script`), and its server a preloaded one where the caller asked for
those (the tests). Where each took vllm_omni from is checked from outside
(``py-spy dump`` of the server, ``vllm_omni.__file__`` of the workers) and
recorded in the JSON.

On a CUDA machine, ``--family flux-bench --shapes 256x256:8,512x512:8`` builds
and serves a bigger random-weight Flux.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait

from bench_serving import run_benchmark
from common import REPO, Script, Shape, check_tree, cpu_seconds, imported_from, imports_ok, in_tree, runs_tree

from vllm_omni.testing.models.tiny import FAMILIES
from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = ("main", "dedicated")
EFFICIENCY_TARGET = 0.90
"""Served images/s ÷ ceiling images/s at N = 4 and 8."""
OVERHEAD_TARGET = 1.10
"""Concurrency-1 served mean latency ÷ the fastest direct batch-1 call."""
FAST = {
    "name": "cpu-tiny-flux-fast",
    "shapes": "64x64:1,64x64:4",
    "max_num_seqs": "1,4,8",
    "blocks": 4,
    "rounds": 6,
}
DEFAULT = {"name": "cpu-tiny-flux", "shapes": "32x32:4,64x64:4", "max_num_seqs": "1,2,4,8", "blocks": 6, "rounds": 4}


class OfflineWorker:
    """bench_offline.py --worker --thread THREAD: the same pipeline, called directly, in its own process, importing
    vllm_omni from the checkout ``tree`` (`common.Script`; ``fork=False``: a new interpreter, as a baseline's
    workers are). Starts loading at once; `wait_ready` waits for it."""

    def __init__(self, model: str, thread: str, tree: str, log_path: str, fork: bool = True):
        self.thread, self.log_path = thread, log_path
        argv = ["--model", model, "--worker", "--thread", thread]
        self.process = Script("bench_offline", argv, tree, log_path, fork=fork)
        self.info: dict = {}

    def wait_ready(self) -> dict:
        word, _, info = self.process.stdout.readline().partition(" ")
        if word != "ready":
            with open(self.log_path) as log:
                raise RuntimeError(f"bench_offline worker ({self.thread} thread) failed to start: {log.read()[-2000:]}")
        self.info = json.loads(info)
        return self.info

    def seconds(self, batch: int, shape: Shape, count: int) -> float:
        self.process.stdin.write(f"{batch} {shape} {count}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.wait()


class Variant:
    """One checkout under test: its two ceiling workers (for the whole sweep) and its server for the N at hand. The
    current code's are forks of processes that have imported the stack already where this process runs its checkout
    (`common.Script`, and a preloaded server where the caller asked for those: the tests); a baseline's are always
    new interpreters of its checkout (`in_tree`), as another checkout's must be, even when it is this one."""

    def __init__(self, label: str, tree: str):
        self.label, self.tree = label, tree
        self.fork = label == "current"
        self.server: RemoteOmniServer | None = None
        self.workers: dict[str, OfflineWorker] = {}
        self.imports: dict = {}


def _server_args(n: int, shapes: list[Shape], wait_ms: float) -> list[str]:
    return [
        "--max-num-seqs",
        str(n),
        "--request-batch-max-wait-ms",
        str(wait_ms),
        "--max-waiting-requests",
        str(max(64, 2 * n)),
        "--max-image-pixels",
        str(max(s.width * s.height for s in shapes)),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]


def _start_workers(variants: list[Variant], model: str, args, stack: contextlib.ExitStack) -> None:
    """Start every variant's ceiling workers, once: they take the batch size with each call, and they load while the
    first servers start."""
    for variant in variants:
        for thread in THREADS:
            log = os.path.join(args.log_dir, f"worker-{variant.label}-{thread}.log")
            worker = OfflineWorker(model, thread, variant.tree, log, fork=variant.fork)
            stack.callback(worker.close)
            variant.workers[thread] = worker


def _start(variants: list[Variant], model: str, n: int, shapes: list[Shape], args, stack: contextlib.ExitStack):
    """Start every variant's server for N; check imports (the workers' once they are ready)."""
    for variant in variants:
        log = os.path.join(args.log_dir, f"server-{variant.label}-n{n}.log")
        # Else a real `vllm serve` process, whose command `in_tree` rewrites to run the variant's checkout.
        preload = variant.fork and runs_tree(variant.tree)
        variant.server = RemoteOmniServer(model, _server_args(n, shapes, args.wait_ms), log_path=log, cli=not preload)
        if not variant.server.preloaded:
            variant.server.command = in_tree(variant.server.command, variant.tree)
    with ThreadPoolExecutor(len(variants)) as pool:  # the servers start side by side
        starts = [pool.submit(variant.server.__enter__) for variant in variants]
        wait(starts)
    for variant in variants:
        stack.push(variant.server.__exit__)  # stops a server even if another one failed to start
    for start in starts:
        start.result()
    for variant in variants:
        workers = {thread: worker.info or worker.wait_ready() for thread, worker in variant.workers.items()}
        seen = imported_from(variant.server.process.pid)
        variant.imports = {"tree": variant.tree, "server": seen, "server_ok": imports_ok(seen, variant.tree)}
        variant.imports["workers"] = workers
        expected = os.path.join(os.path.realpath(variant.tree), "vllm_omni", "__init__.py")
        wrong = [t for t, w in workers.items() if os.path.realpath(w["vllm_omni"]) != expected]
        if variant.imports["server_ok"] is False or wrong:
            raise RuntimeError(f"{variant.label} does not run {variant.tree}: {variant.imports}")
        print(f"N={n} {variant.label}: imports {json.dumps(variant.imports)}", flush=True)


def _row(variant: Variant, shape: Shape, n: int, blocks: list[dict], args) -> dict:
    """One variant's figures for a shape and N from its blocks. Each block pairs a served run with the direct calls
    made right after it, so the headline figures are medians over blocks of per-block ratios: a burst of other
    load on the shared machine spoils one block, not the result. The totals over all blocks are kept too."""
    calls = n * args.rounds
    for b in blocks:
        b["ceiling_images_per_s"] = {t: calls / s for t, s in b["offline_s"].items()}
        b["best_call_s"] = min(b["offline_s"].values()) / args.rounds
        b["efficiency"] = b["served_images_per_s"] / max(b["ceiling_images_per_s"].values())
        b["overhead"] = b["latency_mean_s"] / b["best_call_s"]
    offline_s = {t: sum(b["offline_s"][t] for b in blocks) for t in THREADS}
    ceiling_total = {t: calls * len(blocks) / s for t, s in offline_s.items()}
    best = max(ceiling_total, key=ceiling_total.get)
    served_total = sum(b["served_images"] for b in blocks) / sum(b["served_s"] for b in blocks)
    latencies = sorted(x for b in blocks for x in b["latencies"])
    views = [b["server"] for b in blocks]
    return {
        "shape": str(shape),
        "n": n,
        "variant": variant.label,
        # medians over blocks (the headline)
        "served_images_per_s": round(statistics.median([b["served_images_per_s"] for b in blocks]), 3),
        "ceiling_images_per_s": round(statistics.median([max(b["ceiling_images_per_s"].values()) for b in blocks]), 3),
        "efficiency": round(statistics.median([b["efficiency"] for b in blocks]), 3),
        "efficiency_per_block": [round(b["efficiency"], 3) for b in blocks],
        "ceiling_batch_call_s": round(statistics.median([b["best_call_s"] for b in blocks]), 4),
        "latency_over_best_call": round(statistics.median([b["overhead"] for b in blocks]), 3),
        # totals over all blocks
        "served_images_per_s_total": round(served_total, 3),
        "ceiling_images_per_s_by_thread": {t: round(v, 3) for t, v in ceiling_total.items()},
        "ceiling_thread": best,
        "efficiency_total": round(served_total / ceiling_total[best], 3),
        "ceiling_batch_call_s_by_thread": {t: round(s / (args.rounds * len(blocks)), 4) for t, s in offline_s.items()},
        "latency_mean_s": round(sum(latencies) / len(latencies), 4),
        "latency_p50_s": latencies[len(latencies) // 2],
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "server_mean_batch_exec_ms": round(statistics.median([v["mean_batch_exec_ms"] or 0 for v in views]), 2),
        "server_mean_batch_size": views[-1]["mean_batch_size"],
        "server_mean_queue_wait_ms": views[-1]["mean_queue_wait_ms"],
        "server_peak_rss_mb": max(v["peak_rss_mb"] for v in views),
        "blocks": [
            {
                "served_images_per_s": round(b["served_images_per_s"], 3),
                "latency_mean_s": round(b["latency_mean_s"], 4),
                "ceiling_call_s_by_thread": {t: round(s / args.rounds, 4) for t, s in b["offline_s"].items()},
                "server_mean_batch_exec_ms": b["server"]["mean_batch_exec_ms"],
            }
            for b in blocks
        ],
    }


def measure(model: str, n: int, shapes: list[Shape], args, variants: list[Variant]) -> tuple[list[dict], dict]:
    """Interleaved served and offline blocks for every shape at N, for every variant."""
    rows = []
    with contextlib.ExitStack() as stack:
        _start(variants, model, n, shapes, args, stack)
        pids = [os.getpid()] + [v.server.process.pid for v in variants]
        pids += [w.process.pid for v in variants for w in v.workers.values()]
        for shape in shapes:
            blocks: dict[str, list[dict]] = {v.label: [] for v in variants}
            started, (ours, machine) = time.perf_counter(), cpu_seconds(pids)
            for variant in variants:
                for worker in variant.workers.values():
                    worker.seconds(n, shape, 2)  # warm-up
            for block in range(args.blocks):
                order = variants if block % 2 == 0 else variants[::-1]  # who goes first alternates
                for variant in order:
                    run = asyncio.run(
                        run_benchmark(
                            variant.server.base_url,
                            shapes=[shape],
                            num_requests=n * args.rounds,
                            concurrency=n,
                            warmup=args.warmup if block == 0 else 0,
                            seed=block * 10_000,
                            progress=False,
                        )
                    )
                    if run["failed"]:
                        raise RuntimeError(
                            f"{run['failed']} requests failed at N={n} {shape} ({variant.label}): "
                            f"{run['failed_statuses']} {run['errors']}"
                        )
                    blocks[variant.label].append(
                        {
                            "served_s": run["duration_s"],
                            "served_images": run["completed"],
                            "served_images_per_s": run["images_per_s"],
                            "latencies": run["latencies_s"],
                            "latency_mean_s": run["latency_mean_s"],
                            "server": run["server"],
                            "offline_s": {},
                        }
                    )
                for variant in order:
                    for thread in THREADS if block % 2 == 0 else THREADS[::-1]:
                        seconds = variant.workers[thread].seconds(n, shape, args.rounds)
                        blocks[variant.label][-1]["offline_s"][thread] = seconds
            ours_after, machine_after = cpu_seconds(pids)
            other_cores = ((machine_after - machine) - (ours_after - ours)) / (time.perf_counter() - started)
            for variant in variants:
                rows.append(
                    _row(variant, shape, n, blocks[variant.label], args) | {"other_cores": round(other_cores, 2)}
                )
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "blocks"}), flush=True)
    for variant in variants:
        if variant.server.returncode != 0:
            raise RuntimeError(f"{variant.label} server for N={n} exited with {variant.server.returncode}")
    return rows, {v.label: v.imports for v in variants}


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, per shape, for the rows of one variant; checked, never an exit code."""
    checks = []
    for r in rows:
        if r["n"] in (4, 8):
            checks.append(
                {
                    "target": f"efficiency {r['shape']} N={r['n']}",
                    "value": r["efficiency"],
                    "limit": f">= {EFFICIENCY_TARGET}",
                    "pass": r["efficiency"] >= EFFICIENCY_TARGET,
                }
            )
        if r["n"] == 1:
            overhead = r["latency_over_best_call"]
            checks.append(
                {
                    "target": f"concurrency-1 latency / fastest direct call {r['shape']}",
                    "value": overhead,
                    "limit": f"<= {OVERHEAD_TARGET}",
                    "pass": overhead <= OVERHEAD_TARGET,
                }
            )
    return checks


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | N | served img/s | ceiling img/s | efficiency | per-block range | all blocks: served / ceiling "
        "(main / dedicated thread) img/s | served latency p50 / p99 (s) | fastest batch call (s) | "
        "server batch exec (ms) | server mean batch | server queue wait (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f"{min(r['efficiency_per_block']):.2f}–{max(r['efficiency_per_block']):.2f}"
        by_thread = " / ".join(f"{r['ceiling_images_per_s_by_thread'][t]:.2f}" for t in THREADS)
        lines.append(
            f"| {r['shape']} | {r['n']} | {r['served_images_per_s']:.2f} | {r['ceiling_images_per_s']:.2f} | "
            f"**{r['efficiency']:.2f}** | {spread} | {r['served_images_per_s_total']:.2f} / ({by_thread}) | "
            f"{r['latency_p50_s']:.3f} / {r['latency_p99_s']:.3f} | {r['ceiling_batch_call_s']:.4f} | "
            f"{r['server_mean_batch_exec_ms']} | {r['server_mean_batch_size']} | {r['server_mean_queue_wait_ms']} |"
        )
    return "\n".join(lines)


def comparison(rows: list[dict], baseline_rows: list[dict]) -> list[dict]:
    """Current vs baseline per shape and N. The ratio current ÷ baseline is the median over blocks of the
    per-block ratio (in each block the two ran back to back), except for the efficiency (both shown)."""
    base = {(r["shape"], r["n"]): r for r in baseline_rows}
    out = []
    for r in rows:
        b = base[(r["shape"], r["n"])]
        entry = {"shape": r["shape"], "n": r["n"]}
        for key in ("served_images_per_s", "latency_mean_s", "server_mean_batch_exec_ms"):
            ratios = [x[key] / y[key] for x, y in zip(r["blocks"], b["blocks"], strict=True) if x[key] and y[key]]
            entry[key] = {
                "current": r[key],
                "baseline": b[key],
                "ratio": round(statistics.median(ratios), 3) if ratios else None,
            }
        for key in ("efficiency", "ceiling_images_per_s", "latency_over_best_call"):
            entry[key] = {"current": r[key], "baseline": b[key]}
        out.append(entry)
    return out


def comparison_table(entries: list[dict]) -> str:
    lines = [
        "| shape | N | served img/s current / baseline (ratio) | efficiency current / baseline | "
        "latency mean (s) current / baseline (ratio) | server batch exec (ms) current / baseline (ratio) | "
        "ceiling img/s current / baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| {e['shape']} | {e['n']} | {_pair(e, 'served_images_per_s')} | {_pair(e, 'efficiency')} | "
            f"{_pair(e, 'latency_mean_s', 4)} | {_pair(e, 'server_mean_batch_exec_ms', 1)} | "
            f"{_pair(e, 'ceiling_images_per_s')} |"
        )
    return "\n".join(lines)


def _pair(entry: dict, key: str, digits: int = 2) -> str:
    """``entry[key]``'s current / baseline, and their ratio where it has one."""
    v = entry[key]
    text = f"{v['current']:.{digits}f} / {v['baseline']:.{digits}f}"
    return f"{text} ({v['ratio']:.2f})" if v.get("ratio") is not None else text


def targets_table(checks: dict[str, list[dict]]) -> str:
    labels = list(checks)
    lines = [
        f"| target | limit | {' | '.join(labels)} |",
        f"|---|---|{'---|' * len(labels)}",
    ]
    for i, check in enumerate(checks[labels[0]]):
        cells = []
        for label in labels:
            c = checks[label][i]
            cells.append(f"{c['value']:.3f} {'PASS' if c['pass'] else 'FAIL'}")
        lines.append(f"| {check['target']} | {check['limit']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str, baseline_rows: list[dict] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for shape in sorted({r["shape"] for r in rows}):
        mine = [r for r in rows if r["shape"] == shape]
        ns = [r["n"] for r in mine]
        line = throughput.plot(ns, [r["served_images_per_s"] for r in mine], "o-", label=f"served {shape}")[0]
        throughput.plot(
            ns,
            [r["ceiling_images_per_s"] for r in mine],
            "s--",
            color=line.get_color(),
            label=f"offline ceiling {shape}",
        )
        if theirs := [r for r in baseline_rows if r["shape"] == shape]:
            throughput.plot(
                [r["n"] for r in theirs],
                [r["served_images_per_s"] for r in theirs],
                "x:",
                color=line.get_color(),
                label=f"served {shape}, baseline",
            )
        latency.plot(ns, [r["latency_p50_s"] * 1000 for r in mine], "o-", color=line.get_color(), label=f"p50 {shape}")
        latency.plot(ns, [r["latency_p99_s"] * 1000 for r in mine], "^:", color=line.get_color(), label=f"p99 {shape}")
    for axis, ylabel in ((throughput, "images / s"), (latency, "latency (ms)")):
        axis.set_xlabel("N = --max-num-seqs = concurrency = offline batch")
        axis.set_ylabel(ylabel)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sorted({r["n"] for r in rows}), labels=[str(n) for n in sorted({r["n"] for r in rows})])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    throughput.set_title("Throughput: served vs offline batch ceiling")
    latency.set_title("Served request latency")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render(summary: dict) -> str:
    """The Markdown tables of a sweep's JSON summary."""
    rows, baseline_rows = summary["rows"], summary.get("baseline_rows", [])
    markdown = f"{table(rows)}\n\nConcurrency-1 mean latency ÷ fastest direct batch-1 call: {_overheads(rows)}\n"
    if baseline_rows:
        markdown += (
            f"\nBaseline ({summary['trees']['baseline']}):\n\n{table(baseline_rows)}\n\n"
            f"Concurrency-1 mean latency ÷ fastest direct batch-1 call: {_overheads(baseline_rows)}\n"
            f"\nCurrent vs baseline (ratio current ÷ baseline):\n\n{comparison_table(summary['comparison'])}\n"
        )
    markdown += f"\nTargets (checked, never an exit code):\n\n{targets_table(summary['targets'])}\n"
    everything = rows + baseline_rows
    if busy := sorted({(r["n"], r["shape"], r["other_cores"]) for r in everything if r["other_cores"] >= 0.1}):
        where = ", ".join(f"N={n} {shape}: {cores:.2f}" for n, shape, cores in busy)
        markdown += f"\n**The machine was not quiet**: other processes used CPU cores meanwhile ({where}).\n"
    return markdown


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def _overheads(rows: list[dict]) -> dict[str, float]:
    return {r["shape"]: r["latency_over_best_call"] for r in rows if r["n"] == 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help=f"the fast case: {FAST}, unless given explicitly")
    parser.add_argument("--name", help=f"results/<name>.{{json,md,png}} (default {DEFAULT['name']})")
    parser.add_argument("--model", help="diffusers folder (default: build one of --family)")
    parser.add_argument("--family", default="flux", choices=sorted(FAMILIES))
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".tiny-models"), help="where tiny models are built")
    parser.add_argument("--max-num-seqs", help=f"comma-separated N (default {DEFAULT['max_num_seqs']})")
    parser.add_argument("--shapes", help=f"comma-separated WxH:STEPS (default {DEFAULT['shapes']})")
    parser.add_argument("--blocks", type=int, help="served/offline alternations per shape and N")
    parser.add_argument("--rounds", type=int, help="requests per client, and offline calls, per block")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds per shape")
    parser.add_argument("--wait-ms", type=float, default=100.0, help="--request-batch-max-wait-ms of the servers")
    parser.add_argument("--baseline", help="checkout whose vllm_omni the same cases also run with, interleaved")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    for key, value in (FAST if args.fast else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from step_batching import cached_model

    model = os.path.abspath(args.model) if args.model else cached_model(args.model_dir, args.family)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    trees = [("current", check_tree(REPO))] + ([("baseline", check_tree(args.baseline))] if args.baseline else [])
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    all_rows, imports = [], {}
    variants = [Variant(label, tree) for label, tree in trees]
    with tempfile.TemporaryDirectory(prefix="batching-sweep-") as args.log_dir, contextlib.ExitStack() as workers:
        _start_workers(variants, model, args, workers)
        for n in args.max_num_seqs.split(","):
            rows_n, imports[f"N={n}"] = measure(model, int(n), shapes, args, variants)
            all_rows += rows_n
    rows = [r for r in all_rows if r["variant"] == "current"]
    baseline_rows = [r for r in all_rows if r["variant"] == "baseline"]
    checks = {"current": targets(rows)} | ({"baseline": targets(baseline_rows)} if baseline_rows else {})
    summary = {
        "name": args.name,
        "model": model,
        "family": args.family,
        "device": _device(),
        "shapes": args.shapes,
        "max_num_seqs": args.max_num_seqs,
        "wait_ms": args.wait_ms,
        "blocks": args.blocks,
        "rounds": args.rounds,
        "trees": dict(trees),
        "imports": imports,
        "rows": rows,
        "concurrency1_latency_over_direct_call": _overheads(rows),
        "targets": checks,
    }
    if baseline_rows:
        summary["baseline_rows"] = baseline_rows
        summary["baseline_concurrency1_latency_over_direct_call"] = _overheads(baseline_rows)
        summary["comparison"] = comparison(rows, baseline_rows)
    markdown = render(summary)
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    plot(rows, base + ".png", f"{args.name} ({summary['device']})", baseline_rows)
    print(markdown)
    print(f"wrote {base}.json, {base}.md, {base}.png")


if __name__ == "__main__":
    # SIGTERM (e.g. `kill PID` of a run started with nohup, which ignores SIGINT) stops the servers and workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
