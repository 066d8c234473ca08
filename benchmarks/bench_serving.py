"""Served throughput and latency for several --max-num-seqs values, measured in one run.

    python benchmarks/bench_serving.py [--model DIR | --family flux] [--max-num-seqs 1,4]
        [--concurrency 4] [--rounds 10] [--size 32] [--steps 4] [--json out.json]

For each value N it starts a real `vllm serve MODEL --omni --max-num-seqs N`
server on 127.0.0.1, sends warm-up requests, then ``--rounds`` rounds of
``--concurrency`` simultaneous requests through the `openai` client, and reads
the batch sizes the server executed from its /metrics. The servers run one
after the other on the same machine; the ratios between them are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
import time

import httpx
import openai

from vllm_omni.testing.server import RemoteOmniServer
from vllm_omni.testing.tiny_models import make_tiny_model


def _batch_histogram(server: RemoteOmniServer) -> tuple[float, float]:
    """(executed batches, requests in them) from /metrics."""
    text = httpx.get(server.url_for("metrics")).text
    values = dict(re.findall(r'^vllm_omni:diffusion_batch_size_(count|sum)\{stage="0"\} (\S+)$', text, re.M))
    return float(values.get("count", 0)), float(values.get("sum", 0))


async def _round(client: openai.AsyncOpenAI, concurrency: int, size: int, steps: int, seed: int) -> list[float]:
    async def one(i: int) -> float:
        started = time.perf_counter()
        await client.images.generate(
            prompt=f"benchmark prompt {i}", size=f"{size}x{size}", response_format="b64_json",
            extra_body={"num_inference_steps": steps, "seed": seed + i},
        )  # fmt: skip
        return time.perf_counter() - started

    return list(await asyncio.gather(*(one(i) for i in range(concurrency))))


def bench_one(model: str, max_num_seqs: int, args) -> dict:
    server_args = ["--max-num-seqs", str(max_num_seqs), "--request-batch-max-wait-ms", str(args.wait_ms),
                   "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]  # fmt: skip
    with RemoteOmniServer(model, server_args) as server:

        async def run() -> tuple[list[float], list[float]]:
            async with openai.AsyncOpenAI(base_url=server.url_for("v1"), api_key="unused", max_retries=0) as client:
                for _ in range(args.warmup):
                    await _round(client, args.concurrency, args.size, args.steps, seed=0)
                rounds, latencies = [], []
                for r in range(args.rounds):
                    started = time.perf_counter()
                    latencies += await _round(client, args.concurrency, args.size, args.steps, seed=r * 1000)
                    rounds.append(time.perf_counter() - started)
                return rounds, latencies

        before = _batch_histogram(server)
        rounds, latencies = asyncio.run(run())
        after = _batch_histogram(server)
    batches, requests = after[0] - before[0], after[1] - before[1]
    round_s = statistics.median(rounds)
    quantiles = statistics.quantiles(latencies, n=10)
    return {
        "max_num_seqs": max_num_seqs,
        "round_wall_s_median": round(round_s, 4),
        "images_per_s": round(args.concurrency / round_s, 2),
        "latency_s_p50": round(statistics.median(latencies), 4),
        "latency_s_p90": round(quantiles[8], 4),
        "mean_executed_batch_size": round(requests / batches, 2) if batches else None,
        "server_exit_code": server.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="diffusers folder (default: build a tiny one of --family)")
    parser.add_argument("--family", default="flux", choices=["flux", "sd"])
    parser.add_argument("--max-num-seqs", default="1,4", help="comma-separated values to compare")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds per server")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=50.0, help="--request-batch-max-wait-ms for every server")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()

    model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(), args.family), args.family)
    runs = [bench_one(model, int(n), args) for n in args.max_num_seqs.split(",")]
    base = runs[0]["round_wall_s_median"]
    for run in runs:
        run["speedup_vs_first"] = round(base / run["round_wall_s_median"], 2)
    result = {
        "model": model, "concurrency": args.concurrency, "rounds": args.rounds, "size": args.size,
        "steps": args.steps, "wait_ms": args.wait_ms, "runs": runs,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
