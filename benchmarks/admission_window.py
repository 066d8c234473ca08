"""The admission window against none: latency at concurrency 1 and throughput at concurrency 4, in one run.

    python benchmarks/admission_window.py [--baseline DIR] [--window-ms 50] [--request-batch-wait adaptive]
        [--blocks 5] [--quick]

One server per checkout and window (``--request-batch-max-wait-ms`` 0 and ``--window-ms``, the current checkout's
with ``--request-batch-wait``, ``adaptive`` by default; ``--max-num-seqs`` 4,
tiny Flux 64x64, 4 steps, request mode), all started before any is measured. Each block runs, on every server in
turn (the order rotating from block to block), bench_serving's closed loop at concurrency 1 (``--requests-1``
requests: mean latency) and at concurrency 4 (``--requests-4``: images/s, mean batch). Blocks this short make the
drifts of a shared machine hit every server alike; the figures are medians over blocks of per-block ratios.

The targets (issue 59, item 7; reported, never an exit code): with the window, latency at concurrency 1 within
1.05x of no window, and throughput at concurrency 4 within 0.97x of the window as it was before (``--baseline DIR``:
a checkout of that commit, e.g. a ``git worktree``, run interleaved with the current code). Writes
``results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor

from bench_serving import run_benchmark
from common import REPO, Shape, check_tree, imported_from, imports_ok, in_tree

from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = Shape.parse("64x64:4")
LATENCY_TARGET = 1.05
"""Mean latency at concurrency 1 with the window ÷ without it, same checkout."""
THROUGHPUT_TARGET = 0.97
"""Images/s at concurrency 4 with the window, current ÷ baseline."""


def _server(model: str, tree: str, window_ms: float, log_dir: str, label: str, wait: str | None) -> RemoteOmniServer:
    """A server of checkout ``tree``; ``wait``: its ``--request-batch-wait`` (``None``: a checkout without it)."""
    args = ["--max-num-seqs", "4", "--request-batch-max-wait-ms", str(window_ms)]
    args += ["--request-batch-wait", wait] if wait else []
    args += ["--max-image-pixels", str(SHAPE.width * SHAPE.height), "--disable-uvicorn-access-log"]
    server = RemoteOmniServer(model, args, log_path=os.path.join(log_dir, f"{label}.log"), cli=True)
    server.command = in_tree(server.command, tree)  # a real `vllm serve` of that checkout
    return server


def _measure(server: RemoteOmniServer, args) -> dict:
    """One block on one server: the closed loop at concurrency 1, then at 4."""

    def run(concurrency: int, requests: int) -> dict:
        return asyncio.run(
            run_benchmark(
                server.url_for(),
                shapes=[SHAPE],
                num_requests=requests,
                concurrency=concurrency,
                warmup=1,
                progress=False,
                rss_interval_s=None,
            )
        )

    one, four = run(1, args.requests_1), run(4, args.requests_4)
    return {
        "c1_latency_ms": 1000 * one["latency_mean_s"],
        "c1_mean_batch": one["server"]["mean_batch_size"],
        "c4_images_per_s": four["images_per_s"],
        "c4_mean_batch": four["server"]["mean_batch_size"],
        "c4_latency_ms": 1000 * four["latency_mean_s"],
    }


def _median(blocks: list[dict], key: str) -> float:
    return round(statistics.median(b[key] for b in blocks), 3)


def summarize(runs: dict[str, list[dict]], window: float, baseline: bool) -> dict:
    """Per server the medians over blocks, and the targets' ratios as medians of per-block ratios."""
    rows = {label: {k: _median(blocks, k) for k in blocks[0]} for label, blocks in runs.items()}
    blocks = range(len(runs[f"current-{window:g}"]))

    def ratio(num: str, den: str, key: str) -> float:
        return round(statistics.median(runs[num][i][key] / runs[den][i][key] for i in blocks), 3)

    checks = {"c1_latency_window_over_none": ratio(f"current-{window:g}", "current-0", "c1_latency_ms")}
    checks["c1_latency_target_met"] = checks["c1_latency_window_over_none"] <= LATENCY_TARGET
    if baseline:
        checks["baseline_c1_latency_window_over_none"] = ratio(f"baseline-{window:g}", "baseline-0", "c1_latency_ms")
        checks["c4_throughput_over_baseline_window"] = ratio(
            f"current-{window:g}", f"baseline-{window:g}", "c4_images_per_s"
        )
        checks["c4_throughput_target_met"] = checks["c4_throughput_over_baseline_window"] >= THROUGHPUT_TARGET
    return {"rows": rows, "checks": checks}


def render(summary: dict) -> str:
    lines = [
        f"# Admission window: {summary['name']} ({summary['device']})",
        "",
        f"tiny Flux {SHAPE}, --max-num-seqs 4, request mode; {summary['blocks']} blocks, medians over blocks.",
        "",
        "| checkout | window | c=1 latency ms | c=1 mean batch | c=4 images/s | c=4 mean batch | c=4 latency ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in summary["rows"].items():
        tree, window = label.rsplit("-", 1)
        lines.append(
            f"| {tree} | {window} ms | {row['c1_latency_ms']:.1f} | {row['c1_mean_batch']} | "
            f"{row['c4_images_per_s']:.2f} | {row['c4_mean_batch']} | {row['c4_latency_ms']:.1f} |"
        )
    lines += ["", "| check | value |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in summary["checks"].items()]
    return "\n".join(lines) + "\n"


def _start(servers: dict[str, RemoteOmniServer], stack: contextlib.ExitStack, trees: dict[str, str]) -> dict:
    with ThreadPoolExecutor(len(servers)) as pool:  # they start side by side
        starts = {label: pool.submit(server.__enter__) for label, server in servers.items()}
    for server in servers.values():
        stack.push(server.__exit__)
    imports = {}
    for label, start in starts.items():
        start.result()
        seen = imported_from(servers[label].process.pid)
        imports[label] = {"server": seen, "ok": imports_ok(seen, trees[label.rsplit("-", 1)[0]])}
        if imports[label]["ok"] is False:
            raise RuntimeError(f"{label} does not run its checkout: {imports[label]}")
    return imports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="cpu-admission-window")
    parser.add_argument("--model", help="diffusers folder (default: the tiny Flux, built once)")
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".tiny-models"))
    parser.add_argument("--window-ms", type=float, default=50.0)
    parser.add_argument(
        "--request-batch-wait",
        choices=("window", "adaptive"),
        default="adaptive",
        help="the current checkout's policy (the baseline's is its own, before the knob: the whole window)",
    )
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--requests-1", type=int, default=16, help="requests per block at concurrency 1")
    parser.add_argument("--requests-4", type=int, default=32, help="requests per block at concurrency 4")
    parser.add_argument("--baseline", help="checkout whose vllm_omni also runs, interleaved (the code before)")
    parser.add_argument("--quick", action="store_true", help="smoke: 1 block of 4 and 8 requests")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.requests_1, args.requests_4 = 1, 4, 8

    from step_batching import cached_model

    model = os.path.abspath(args.model) if args.model else cached_model(args.model_dir, "flux")
    trees = {"current": check_tree(REPO)} | ({"baseline": check_tree(args.baseline)} if args.baseline else {})
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="admission-window-") as log_dir, contextlib.ExitStack() as stack:
        servers = {
            f"{tree}-{window:g}": _server(
                model,
                path,
                window,
                log_dir,
                f"{tree}-{window:g}",
                args.request_batch_wait if tree == "current" else None,
            )
            for tree, path in trees.items()
            for window in (0.0, args.window_ms)
        }
        imports = _start(servers, stack, trees)
        labels = list(servers)
        for block in range(args.blocks):
            for label in labels[block % len(labels) :] + labels[: block % len(labels)]:
                runs.setdefault(label, []).append(_measure(servers[label], args))
                print(f"block {block} {label}: {json.dumps(runs[label][-1])}", flush=True)
    import torch

    summary = {
        "name": args.name,
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        "model": model,
        "window_ms": args.window_ms,
        "request_batch_wait": args.request_batch_wait,
        "blocks": args.blocks,
        "requests": {"c1": args.requests_1, "c4": args.requests_4},
        "trees": trees,
        "imports": imports,
        "runs": runs,
        **summarize(runs, args.window_ms, "baseline" in trees),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, args.name)
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    markdown = render(summary)
    with open(base + ".md", "w") as f:
        f.write(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
