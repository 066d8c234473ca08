"""Batching efficiency sweep: served throughput at --max-num-seqs N against the offline batch-N ceiling.

    python benchmarks/batching_sweep.py [--name cpu-tiny-flux] [--family flux] [--model DIR]
        [--max-num-seqs 1,2,4,8] [--shapes 32x32:4,64x64:4] [--blocks 6] [--rounds 4]

For each N it starts `vllm serve MODEL --omni --max-num-seqs N` and a
bench_offline worker process holding the same pipeline. For each shape it then
alternates, ``--blocks`` times: bench_serving at concurrency N for ``--rounds``
requests per client, then ``--rounds`` direct batch-N pipeline calls. Blocks
this short make the slow drifts of a shared machine hit both sides alike.
Writes benchmarks/results/<name>.json, <name>.md (table) and <name>.png (plot).

Batching efficiency = served images/s ÷ offline batch-N images/s (all blocks).
Concurrency-1 overhead = served mean latency at N=1 ÷ mean direct batch-1 call.
On a CUDA machine, ``--family flux-bench --shapes 256x256:8,512x512:8`` builds
and serves a bigger random-weight Flux.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile

from bench_serving import run_benchmark
from common import Shape

from vllm_omni.testing.server import RemoteOmniServer
from vllm_omni.testing.tiny_models import FAMILIES, make_tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))


class OfflineWorker:
    """bench_offline.py --worker: the same pipeline, called directly, in its own process."""

    def __init__(self, model: str):
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "bench_offline.py"), "--model", model, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("bench_offline worker failed to start")

    def seconds(self, batch: int, shape: Shape, count: int) -> float:
        self.process.stdin.write(f"{batch} {shape} {count}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def measure(model: str, n: int, shapes: list[Shape], args) -> list[dict]:
    """Interleaved served and offline blocks for every shape at N."""
    server_args = [
        "--max-num-seqs",
        str(n),
        "--request-batch-max-wait-ms",
        str(args.wait_ms),
        "--max-waiting-requests",
        str(max(64, 2 * n)),
        "--max-image-pixels",
        str(max(s.width * s.height for s in shapes)),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]
    rows = []
    worker = OfflineWorker(model)
    try:
        with RemoteOmniServer(model, server_args) as server:
            for shape in shapes:
                worker.seconds(n, shape, 2)  # warm-up
                served_s = offline_s = 0.0
                served_images, latencies, blocks, server_views = 0, [], [], []
                for block in range(args.blocks):
                    run = asyncio.run(
                        run_benchmark(
                            server.base_url,
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
                            f"{run['failed']} requests failed at N={n} {shape}: {run['failed_statuses']}"
                        )
                    seconds = worker.seconds(n, shape, args.rounds)
                    served_s, served_images = served_s + run["duration_s"], served_images + run["completed"]
                    offline_s += seconds
                    latencies += run["latencies_s"]
                    server_views.append(run["server"])
                    blocks.append(round((run["images_per_s"]) / (n * args.rounds / seconds), 3))
                latencies.sort()
                served_ips, ceiling_ips = served_images / served_s, n * args.rounds * args.blocks / offline_s
                rows.append(
                    {
                        "shape": str(shape),
                        "n": n,
                        "served_images_per_s": round(served_ips, 3),
                        "ceiling_images_per_s": round(ceiling_ips, 3),
                        "efficiency": round(served_ips / ceiling_ips, 3),
                        "efficiency_per_block": blocks,
                        "latency_mean_s": round(sum(latencies) / len(latencies), 4),
                        "latency_p50_s": latencies[len(latencies) // 2],
                        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                        "ceiling_batch_call_s": round(offline_s / (args.rounds * args.blocks), 4),
                        "server_mean_batch_size": server_views[-1]["mean_batch_size"],
                        "server_mean_queue_wait_ms": server_views[-1]["mean_queue_wait_ms"],
                        "server_peak_rss_mb": max(v["peak_rss_mb"] for v in server_views),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        if server.returncode != 0:
            raise RuntimeError(f"server for N={n} exited with {server.returncode}")
    finally:
        worker.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| shape | N | served img/s | ceiling img/s | efficiency | per-block range | "
        "served latency p50 / p99 (s) | ceiling batch call (s) | server mean batch | server queue wait (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spread = f"{min(r['efficiency_per_block']):.2f}–{max(r['efficiency_per_block']):.2f}"
        lines.append(
            f"| {r['shape']} | {r['n']} | {r['served_images_per_s']:.2f} | {r['ceiling_images_per_s']:.2f} | "
            f"**{r['efficiency']:.2f}** | {spread} | {r['latency_p50_s']:.3f} / {r['latency_p99_s']:.3f} | "
            f"{r['ceiling_batch_call_s']:.3f} | {r['server_mean_batch_size']} | {r['server_mean_queue_wait_ms']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
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


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="cpu-tiny-flux", help="results/<name>.{json,md,png}")
    parser.add_argument("--model", help="diffusers folder (default: build one of --family)")
    parser.add_argument("--family", default="flux", choices=sorted(FAMILIES))
    parser.add_argument("--max-num-seqs", default="1,2,4,8")
    parser.add_argument("--shapes", default="32x32:4,64x64:4", help="comma-separated WxH:STEPS")
    parser.add_argument("--blocks", type=int, default=6, help="served/offline alternations per shape and N")
    parser.add_argument("--rounds", type=int, default=4, help="requests per client, and offline calls, per block")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds per shape")
    parser.add_argument("--wait-ms", type=float, default=100.0, help="--request-batch-max-wait-ms of the servers")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args()

    model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(), args.family), args.family)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    rows = [row for n in args.max_num_seqs.split(",") for row in measure(model, int(n), shapes, args)]
    overhead = {r["shape"]: round(r["latency_mean_s"] / r["ceiling_batch_call_s"], 3) for r in rows if r["n"] == 1}
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    summary = {
        "name": args.name,
        "model": model,
        "family": args.family,
        "device": _device(),
        "shapes": args.shapes,
        "wait_ms": args.wait_ms,
        "blocks": args.blocks,
        "rounds": args.rounds,
        "rows": rows,
        "concurrency1_latency_over_direct_call": overhead,
    }
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"{table(rows)}\n\nConcurrency-1 mean latency ÷ direct batch-1 call: {overhead}\n")
    plot(rows, base + ".png", f"{args.name} ({summary['device']})")
    print(table(rows))
    print(f"concurrency-1 latency / direct call: {overhead}")
    print(f"wrote {base}.json, {base}.md, {base}.png")


if __name__ == "__main__":
    main()
