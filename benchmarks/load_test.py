"""Bounded load test: every request ends with an image or an explicit 429/503 envelope; none is lost.

    python benchmarks/load_test.py [--model DIR] [--requests 1000] [--concurrency 32]
        [--max-num-seqs 4] [--max-waiting-requests 16] [--backoff-ms 200] [--json out.json]

Starts `vllm serve MODEL --omni` (the tiny Flux model unless ``--model``), warms
it up, then sends ``--requests`` requests from ``--concurrency`` clients, each
with a timeout. It counts images, 429/503 envelopes, other answers and lost
requests (no answer in time, or a broken connection), and compares the server's
RSS after the run with its RSS after warm-up. Exit code 1 if a request got
anything but an image or a 429/503 envelope, if one was lost, or if RSS grew by
more than ``--max-rss-growth``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import tempfile
import time

import aiohttp
from bench_serving import scrape
from common import emit

from vllm_omni.testing.models.tiny import make_tiny_model
from vllm_omni.testing.processes.server import RemoteOmniServer

BODY = {"prompt": "load test", "size": "32x32", "num_inference_steps": 2, "response_format": "b64_json"}


async def _one(session: aiohttp.ClientSession, url: str, seed: int, timeout_s: float) -> str:
    try:
        async with session.post(url, json=BODY | {"seed": seed}, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body = await r.json(content_type=None)
    except (asyncio.TimeoutError, aiohttp.ClientError):
        return "lost"
    if r.status == 200 and body.get("data") and body["data"][0].get("b64_json"):
        return "image"
    if r.status in (429, 503) and set(body.get("error", {})) == {"message", "type", "param", "code"}:
        return f"rejected_{r.status}"
    return f"other_{r.status}"


async def _rss(session: aiohttp.ClientSession, base_url: str) -> float:
    return (await scrape(session, base_url)).get(("process_resident_memory_bytes", ()), 0.0)


async def run_load(
    base_url: str, *, requests: int, concurrency: int, warmup: int, timeout_s: float, backoff_s: float
) -> dict:
    url = f"{base_url}/v1/images/generations"
    async with aiohttp.ClientSession() as session:
        for start in range(0, warmup, concurrency):
            await asyncio.gather(*(_one(session, url, -1 - i, timeout_s) for i in range(start, start + concurrency)))
        rss_warm = await _rss(session, base_url)
        outcomes: collections.Counter = collections.Counter()
        pending = list(range(requests))

        async def client() -> None:
            while pending:
                outcome = await _one(session, url, pending.pop(), timeout_s)
                outcomes[outcome] += 1
                if outcome.startswith("rejected"):
                    await asyncio.sleep(backoff_s)  # as a well-behaved client does after a 429/503

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        rss_after = await _rss(session, base_url)
    return {
        "requests": requests,
        "concurrency": concurrency,
        "answered": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "images": outcomes["image"],
        "rejected": outcomes["rejected_429"] + outcomes["rejected_503"],
        "lost": outcomes["lost"],
        "unexpected": sum(v for k, v in outcomes.items() if k.startswith("other_")),
        "duration_s": round(duration, 2),
        "rss_after_warmup_mb": round(rss_warm / 2**20, 1),
        "rss_after_run_mb": round(rss_after / 2**20, 1),
        "rss_growth": round(rss_after / rss_warm - 1, 4) if rss_warm else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="diffusers folder (default: build the tiny Flux model)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=64, help="requests before the RSS baseline")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="a request unanswered by then is lost")
    parser.add_argument("--backoff-ms", type=float, default=200.0, help="a client's pause after a 429/503")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-waiting-requests", type=int, default=16)
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)

    model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(), "flux"), "flux")
    server_args = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-waiting-requests",
        str(args.max_waiting_requests),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]
    with RemoteOmniServer(model, server_args) as server:
        result = asyncio.run(
            run_load(
                server.base_url,
                requests=args.requests,
                concurrency=args.concurrency,
                warmup=args.warmup,
                timeout_s=args.timeout_s,
                backoff_s=args.backoff_ms / 1000,
            )
        )
    result["server_exit_code"] = server.returncode
    result["ok"] = (
        result["answered"] == args.requests
        and result["lost"] == 0
        and result["unexpected"] == 0
        and result["rss_growth"] is not None
        and result["rss_growth"] <= args.max_rss_growth
        and server.returncode == 0
    )
    emit(result, args.json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
