"""Priority scheduling under a two-class open-loop load: fcfs against priority, in step and request mode, in one run.

    python benchmarks/priority.py [--load 0.8] [--background-steps 20] [--interactive-steps 4]
        [--interactive-share 0.25] [--background-requests 48] [--reps 3] [--modes step,request]
        [--policies fcfs,priority] [--quick] [--name cpu-tiny-priority]

One ``vllm serve`` per (execution mode, scheduling policy), tiny Flux 64x64, ``--max-num-seqs`` 4, all started
before any is measured. The capacity is the lower of the two fcfs servers' closed-loop background throughput
(concurrency 4, background requests only). Each rep then sends one arrival schedule to every server in turn (the
order rotating per rep, so a shared machine's drift hits all alike):

- background requests (``--background-steps`` steps, ``priority`` 1 where the policy is ``priority``): Poisson
  arrivals at ``--load`` × capacity;
- interactive requests (``--interactive-steps`` steps, ``priority`` 0, the default): Poisson arrivals at
  ``--interactive-share`` × the background rate, merged into the same schedule.

Under ``fcfs`` no request carries a ``priority`` (a non-zero one is refused there), so both classes wait in
arrival order. Per server and class: p50 and p90 of the client's end-to-end latency (HTTP round trip); per server
the total throughput (completed requests ÷ first send to last answer) and the preemptions the server counted
(``vllm_omni:num_preemptions_total``). Figures are medians over the reps. Writes ``results/<name>.json`` and
``.md``; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import numpy as np
from bench_serving import run_benchmark, scrape
from common import PROMPTS, Shape, publish
from step_batching import cached_model

from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
CLASSES = {"interactive": 0, "background": 1}
"""Each class's ``priority`` under the ``priority`` policy (lower first)."""


def schedule(args, capacity: float, seed: int) -> list[tuple[float, str]]:
    """(send time in s from the start, class), both classes' Poisson arrivals merged."""
    rng = random.Random(seed)
    rate = args.load * capacity
    arrivals = []
    for name, count, class_rate in (
        ("background", args.background_requests, rate),
        (
            "interactive",
            max(1, round(args.background_requests * args.interactive_share)),
            rate * args.interactive_share,
        ),
    ):
        at = 0.0
        for _ in range(count):
            at += rng.expovariate(class_rate)
            arrivals.append((at, name))
    return sorted(arrivals)


async def _send(session, url: str, body: dict) -> float:
    started = time.perf_counter()
    async with session.post(url, json=body) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {(await response.text())[:300]}")
    return time.perf_counter() - started


async def open_loop(server: RemoteOmniServer, policy: str, plan: list[tuple[float, str]], args, seed: int) -> dict:
    """One rep on one server: every request of ``plan`` at its time; latencies per class, throughput."""
    steps = {"background": args.background_steps, "interactive": args.interactive_steps}
    url = server.url_for("v1", "images", "generations")
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await scrape(session, server.base_url)

        async def one(i: int, at: float, name: str, start: float) -> tuple[str, float]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = {
                "prompt": PROMPTS[i % len(PROMPTS)],
                "size": f"{args.size}x{args.size}",
                "num_inference_steps": steps[name],
                "seed": seed + i,
                "response_format": "b64_json",
            }
            if policy == "priority":
                body["priority"] = CLASSES[name]
            return name, await _send(session, url, body)

        start = time.perf_counter()
        done = await asyncio.gather(*(one(i, at, name, start) for i, (at, name) in enumerate(plan)))
        wall = time.perf_counter() - start
        after = await scrape(session, server.base_url)
    preemptions = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "vllm_omni:num_preemptions_total")
    figures: dict = {"requests_per_s": len(done) / wall, "preemptions": int(preemptions)}
    for name in CLASSES:
        latencies = [1000 * s for n, s in done if n == name]
        figures[name] = {
            "count": len(latencies),
            "p50_ms": float(np.percentile(latencies, 50)),
            "p90_ms": float(np.percentile(latencies, 90)),
        }
    return figures


def _server(model: str, mode: str, policy: str, log_dir: str, args) -> RemoteOmniServer:
    server_args = [
        *("--execution-mode", mode, "--scheduling-policy", policy, "--max-num-seqs", str(args.n)),
        *("--max-waiting-requests", "1024", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"),
    ]
    return RemoteOmniServer(model, server_args, log_path=os.path.join(log_dir, f"{mode}-{policy}.log"))


def capacity_of(servers: dict[str, RemoteOmniServer], args) -> dict[str, float]:
    """Each fcfs server's closed-loop background throughput (req/s) at concurrency N (after a warm-up)."""
    shape = Shape(args.size, args.size, args.background_steps)
    found = {}
    for label, server in servers.items():
        if label.endswith("fcfs") or not any(k.endswith("fcfs") for k in servers):
            run = asyncio.run(
                run_benchmark(
                    server.base_url,
                    shapes=[shape],
                    num_requests=args.capacity_requests,
                    concurrency=args.n,
                    warmup=1,
                    progress=False,
                    rss_interval_s=None,
                )
            )
            found[label] = run["requests_per_s"]
            print(f"capacity {label}: {found[label]:.3f} req/s", flush=True)
    return found


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per server the medians over reps."""
    rows = {}
    for label, reps in runs.items():
        row = {
            "requests_per_s": round(statistics.median(r["requests_per_s"] for r in reps), 3),
            "preemptions": statistics.median(r["preemptions"] for r in reps),
        }
        for name in CLASSES:
            row[name] = {k: round(statistics.median(r[name][k] for r in reps), 1) for k in ("p50_ms", "p90_ms")}
        rows[label] = row
    return rows


def render(summary: dict) -> str:
    a = summary["config"]
    lines = [
        f"# Priority scheduling, two classes: {summary['name']} ({summary['device']})",
        "",
        f"tiny Flux {a['size']}x{a['size']}, --max-num-seqs {a['n']}; background {a['background_steps']} steps at "
        f"{a['load']:.0%} of {summary['capacity_requests_per_s']:.2f} req/s, interactive {a['interactive_steps']} "
        f"steps at {a['interactive_share']} x that rate; {a['background_requests']} background requests per rep, "
        f"{a['reps']} reps, medians (load average {summary['load_at_start']} at start, {summary['load_at_end']} at "
        "end).",
        "",
        "| mode | policy | interactive p50 / p90 (ms) | background p50 / p90 (ms) | total req/s | preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in summary["rows"].items():
        mode, policy = label.split("-")
        i, b = row["interactive"], row["background"]
        lines.append(
            f"| {mode} | {policy} | {i['p50_ms']:.0f} / {i['p90_ms']:.0f} | {b['p50_ms']:.0f} / {b['p90_ms']:.0f} | "
            f"{row['requests_per_s']:.2f} | {row['preemptions']:g} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="cpu-tiny-priority")
    parser.add_argument("--model", help="diffusers folder (default: the tiny Flux, built once)")
    parser.add_argument("--model-dir", default=os.path.join(os.path.dirname(HERE), ".tiny-models"))
    parser.add_argument("--modes", default="step,request")
    parser.add_argument("--policies", default="fcfs,priority")
    parser.add_argument("--n", type=int, default=4, help="--max-num-seqs and the capacity run's concurrency")
    parser.add_argument("--size", type=int, default=64, help="image side")
    parser.add_argument("--load", type=float, default=0.8, help="background rate ÷ capacity")
    parser.add_argument("--background-steps", type=int, default=20)
    parser.add_argument("--interactive-steps", type=int, default=4)
    parser.add_argument("--interactive-share", type=float, default=0.25, help="interactive rate ÷ background rate")
    parser.add_argument("--background-requests", type=int, default=48, help="per rep")
    parser.add_argument("--capacity-requests", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke: 32x32, 2 and 1 steps, 4 requests, 1 rep")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.background_steps, args.interactive_steps = 32, 2, 1
        args.background_requests, args.capacity_requests, args.reps = 4, 4, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = os.path.abspath(args.model) if args.model else cached_model(args.model_dir, "flux")
    labels = [(m, p) for m in args.modes.split(",") for p in args.policies.split(",")]
    load_at_start, runs = round(os.getloadavg()[0], 1), {}
    with tempfile.TemporaryDirectory(prefix="priority-") as log_dir, contextlib.ExitStack() as stack:
        servers = {f"{m}-{p}": _server(model, m, p, log_dir, args) for m, p in labels}
        with ThreadPoolExecutor(len(servers)) as pool:  # they start side by side
            starts = [pool.submit(server.__enter__) for server in servers.values()]
        for server, started in zip(servers.values(), starts, strict=True):
            stack.push(server.__exit__)
            started.result()
        capacities = capacity_of(servers, args)
        capacity = min(capacities.values())
        order = list(servers)
        for rep in range(args.reps):
            plan = schedule(args, capacity, seed=rep)
            for label in order[rep % len(order) :] + order[: rep % len(order)]:
                figures = asyncio.run(open_loop(servers[label], label.split("-")[1], plan, args, seed=1000 * rep))
                runs.setdefault(label, []).append(figures)
                print(f"rep {rep} {label}: {figures} (load {os.getloadavg()[0]:.1f})", flush=True)
    import torch

    summary = {
        "name": args.name,
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        "model": model,
        "config": {k: v for k, v in vars(args).items() if k not in ("out_dir", "model_dir")},
        "capacities": capacities,
        "capacity_requests_per_s": capacity,
        "load_at_start": load_at_start,
        "load_at_end": round(os.getloadavg()[0], 1),
        "runs": runs,
        "rows": summarize(runs),
    }
    publish(summary, render(summary), args.out_dir, args.name)


if __name__ == "__main__":
    main()
