"""Audio generation: served audio-seconds per second at --max-num-seqs N against the offline ceiling.

    python benchmarks/audio.py [--name cpu-tiny-stable-audio] [--family stable-audio] [--model DIR]
        [--max-num-seqs 1,4] [--steps 8] [--audio-length 1.0] [--guidance-scale 7.0] [--blocks 4] [--rounds 3]
        [--threads main,dedicated]

The ceiling is the stock diffusers pipeline (``StableAudioPipeline`` for Stable Audio, loaded on the server's device
and dtype) called directly with the same work: one call of N prompts with N generators, the same steps, clip length
and guidance, ``output_type="np"`` as the server asks. It runs in worker processes of this script
(``--worker --thread main|dedicated``: all torch work on the main thread, or on one other thread; the faster is
the ceiling, as in batching_sweep.py, since which thread runs torch matters on a CPU).

For each N it starts ``vllm serve MODEL --omni --max-num-seqs N``, then alternates ``--blocks`` times: N clients
posting ``POST /v1/audio/generate`` (``response_format`` pcm, the cheapest to encode) in a closed loop,
``--rounds`` requests each, then ``--rounds`` batch-N calls in each ceiling worker. Audio-seconds per second =
requests × ``--audio-length`` ÷ wall time (each answer's length is checked against it). The ratio served ÷
ceiling is the median over blocks of each block's ratio, so that a burst of other load on a shared machine spoils
one block, not the result. Writes benchmarks/results/<name>.json and <name>.md.
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

import aiohttp
from bench_offline import _on_one_thread
from bench_serving import scrape, server_view
from common import PROMPTS, REPO, Script, add_model_arguments, cpu_seconds, in_tree, publish

from vllm_omni.testing.processes.server import RemoteOmniServer

HERE = os.path.dirname(os.path.abspath(__file__))
AUDIO_FAMILIES = ("stable-audio", "stable-audio-3", "longcat-audio", "ace-step")
THREADS = ("main", "dedicated")


def _stock_call(pipeline, batch: int, args) -> float:
    """Seconds of one stock call for ``batch`` prompts, one generator each, after checking its clips' length."""
    import torch

    from vllm_omni.diffusion.families.model_card import ModelCard

    audio = ModelCard.of(pipeline).audio
    clip = audio.call_args(args.audio_length, 0.0)  # the family's own clip arguments
    started = time.perf_counter()
    with torch.inference_mode():
        audios = pipeline(
            prompt=(PROMPTS * batch)[:batch],
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            generator=[torch.Generator("cpu").manual_seed(i) for i in range(batch)],
            output_type="np",
            **clip,
        ).audios
    elapsed = time.perf_counter() - started
    assert len(audios) == batch and abs(audios[0].shape[-1] - args.audio_length * audio.sample_rate) <= 1
    return elapsed


def _serve_worker(args) -> None:
    import vllm_omni
    from vllm_omni.diffusion.pipeline.runner import load_pipeline, select_device, select_dtype

    device = select_device(None)
    pipeline = load_pipeline(args.model, select_dtype("auto", device), device)
    pipeline.set_progress_bar_config(disable=True)
    _stock_call(pipeline, 1, args)  # warm-up
    print("ready", json.dumps({"pipeline": type(pipeline).__name__, "vllm_omni": vllm_omni.__file__}), flush=True)
    for line in sys.stdin:
        batch, count = map(int, line.split())
        print(sum(_stock_call(pipeline, batch, args) for _ in range(count)), flush=True)


class Ceiling:
    """A ``--worker`` process of this checkout (`common.Script`): the stock pipeline, loaded once; ``seconds(N,
    COUNT)`` times COUNT batch-N calls."""

    def __init__(self, args, thread: str, log_path: str):
        self.thread, self.log_path = thread, log_path
        argv = ["--worker", "--thread", thread, "--model", args.model, "--steps", str(args.steps)]
        argv += ["--audio-length", str(args.audio_length), "--guidance-scale", str(args.guidance_scale)]
        self.process = Script("audio", argv, REPO, log_path)
        self.info: dict = {}

    def wait_ready(self) -> dict:
        word, _, info = self.process.stdout.readline().partition(" ")
        if word != "ready":
            with open(self.log_path) as log:
                raise RuntimeError(f"ceiling worker ({self.thread} thread) failed to start: {log.read()[-2000:]}")
        self.info = json.loads(info)
        return self.info

    def seconds(self, batch: int, count: int) -> float:
        self.process.stdin.write(f"{batch} {count}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def close(self) -> None:
        self.process.wait()


async def served(base_url: str, n: int, requests_per_client: int, args, seed: int) -> dict:
    """N clients, each posting ``requests_per_client`` requests one after another; every answer's length checked."""
    latencies: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        before = await scrape(session, base_url)

        async def client(c: int) -> None:
            for r in range(requests_per_client):
                body = {
                    "input": PROMPTS[(c + r) % len(PROMPTS)],
                    "response_format": "pcm",
                    "audio_length": args.audio_length,
                    "num_inference_steps": args.steps,
                    "guidance_scale": args.guidance_scale,
                    "seed": seed + c * requests_per_client + r,
                }
                sent = time.perf_counter()
                async with session.post(f"{base_url}/v1/audio/generate", json=body) as response:
                    data = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"POST /v1/audio/generate answered {response.status}: {data[:500]!r}")
                    rate, channels = int(response.headers["X-Sample-Rate"]), int(response.headers["X-Channels"])
                latencies.append(time.perf_counter() - sent)
                seconds = len(data) / (2 * channels * rate)  # 16-bit samples
                assert abs(seconds - args.audio_length) <= 1 / rate, (seconds, args.audio_length)

        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(n)))
        wall = time.perf_counter() - started
        after = await scrape(session, base_url)
    view = server_view(before, after, "audio")
    return {"wall_s": wall, "requests": len(latencies), "latency_mean_s": statistics.fmean(latencies)} | {
        "mean_batch_size": view["mean_batch_size"]
    }


def _server_args(n: int, wait_ms: float) -> list[str]:
    return [
        *("--max-num-seqs", str(n), "--request-batch-max-wait-ms", str(wait_ms)),
        *("--max-waiting-requests", str(max(64, 2 * n)), "--disable-uvicorn-access-log"),
        *("--uvicorn-log-level", "warning"),
    ]


def _block(server, ceilings: dict[str, Ceiling], n: int, block: int, args) -> dict:
    """One served run then each ceiling worker's calls (the workers' order alternates)."""
    run = asyncio.run(served(server.base_url, n, args.rounds, args, seed=block * 10_000))
    offline_s = {}
    for thread in list(ceilings) if block % 2 == 0 else list(ceilings)[::-1]:
        offline_s[thread] = ceilings[thread].seconds(n, args.rounds)
    served_aps = run["requests"] * args.audio_length / run["wall_s"]
    ceiling_aps = {t: n * args.rounds * args.audio_length / s for t, s in offline_s.items()}
    return {
        "served_audio_s_per_s": round(served_aps, 4),
        "ceiling_audio_s_per_s_by_thread": {t: round(v, 4) for t, v in ceiling_aps.items()},
        "ratio": round(served_aps / max(ceiling_aps.values()), 4),
        "latency_mean_s": round(run["latency_mean_s"], 4),
        "ceiling_call_s": round(min(offline_s.values()) / args.rounds, 4),
        "server_mean_batch_size": run["mean_batch_size"],
    }


def measure(n: int, ceilings: dict[str, Ceiling], args) -> dict:
    """Interleaved served and ceiling blocks at N; the row of their medians."""
    log = os.path.join(args.log_dir, f"server-n{n}.log")
    server = RemoteOmniServer(args.model, _server_args(n, args.wait_ms), log_path=log)
    if not server.preloaded:  # a `vllm serve` process of this checkout (a preloaded one has the caller's imports)
        server.command = in_tree(server.command, REPO)
    with server:
        for ceiling in ceilings.values():
            ceiling.info or ceiling.wait_ready()
        asyncio.run(served(server.base_url, n, 1, args, seed=10**9))  # warm-up: the server's first batch
        for ceiling in ceilings.values():
            ceiling.seconds(n, 1)
        pids = [os.getpid(), server.process.pid, *(c.process.pid for c in ceilings.values())]
        started, (ours, machine) = time.perf_counter(), cpu_seconds(pids)
        blocks = [_block(server, ceilings, n, block, args) for block in range(args.blocks)]
        ours_after, machine_after = cpu_seconds(pids)
        other_cores = ((machine_after - machine) - (ours_after - ours)) / (time.perf_counter() - started)
    if server.returncode != 0:
        raise RuntimeError(f"server for N={n} exited with {server.returncode}")

    def median(key):
        return round(statistics.median(key(b) for b in blocks), 4)

    return {
        "n": n,
        "served_audio_s_per_s": median(lambda b: b["served_audio_s_per_s"]),
        "ceiling_audio_s_per_s": median(lambda b: max(b["ceiling_audio_s_per_s_by_thread"].values())),
        "ratio": median(lambda b: b["ratio"]),
        "ratio_per_block": [b["ratio"] for b in blocks],
        "latency_mean_s": median(lambda b: b["latency_mean_s"]),
        "ceiling_call_s": median(lambda b: b["ceiling_call_s"]),
        "server_mean_batch_size": median(lambda b: b["server_mean_batch_size"] or 0),
        "other_cores": round(other_cores, 2),
        "blocks": blocks,
    }


def render(result: dict) -> str:
    lines = [
        "| N | served audio-s/s | ceiling audio-s/s | served / ceiling | per block | mean latency s | "
        "ceiling call s | server batch | other cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        blocks = ", ".join(f"{x:.2f}" for x in r["ratio_per_block"])
        lines.append(
            f"| {r['n']} | {r['served_audio_s_per_s']:.3f} | {r['ceiling_audio_s_per_s']:.3f} | **{r['ratio']:.2f}** | "
            f"{blocks} | {r['latency_mean_s']:.3f} | {r['ceiling_call_s']:.3f} | {r['server_mean_batch_size']:.2f} | "
            f"{r['other_cores']:.2f} |"
        )
    work = f"{result['pipeline']}, {result['steps']} steps, {result['audio_length']} s clips, guidance "
    work += f"{result['guidance_scale']}, {result['blocks']} blocks of {result['rounds']} requests per client"
    return f"{result['name']} ({result['device']}; {work})\n\n" + "\n".join(lines) + "\n"


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, AUDIO_FAMILIES)
    parser.add_argument("--name", default="cpu-tiny-stable-audio", help="results/<name>.{json,md}")
    parser.add_argument("--max-num-seqs", default="1,4", help="comma-separated N")
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps of every request and call")
    parser.add_argument("--audio-length", type=float, default=1.0, help="seconds of audio per request")
    parser.add_argument("--guidance-scale", type=float, default=7.0, help="guidance_scale (Stable Audio's default)")
    parser.add_argument("--blocks", type=int, default=4, help="served/ceiling alternations per N")
    parser.add_argument("--rounds", type=int, default=3, help="requests per client, and ceiling calls, per block")
    parser.add_argument("--threads", default=",".join(THREADS), help="the ceiling workers' torch threads")
    parser.add_argument("--wait-ms", type=float, default=100.0, help="--request-batch-max-wait-ms of the server")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--thread", choices=THREADS, default="main", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not set(args.threads.split(",")) <= set(THREADS):
        parser.error(f"--threads: a comma-separated subset of {', '.join(THREADS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.worker:
        _on_one_thread(args.thread, _serve_worker, args)
        return
    from step_batching import cached_model

    args.model = os.path.abspath(args.model) if args.model else cached_model(args.model_dir, args.family)
    rows = []
    with tempfile.TemporaryDirectory(prefix="audio-bench-") as args.log_dir, contextlib.ExitStack() as stack:
        ceilings = {}
        for thread in args.threads.split(","):
            ceilings[thread] = Ceiling(args, thread, os.path.join(args.log_dir, f"ceiling-{thread}.log"))
            stack.callback(ceilings[thread].close)
        for n in args.max_num_seqs.split(","):
            rows.append(measure(int(n), ceilings, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "blocks"}), flush=True)
        workers = {thread: ceiling.info for thread, ceiling in ceilings.items()}  # their pipeline and vllm_omni
    keys = ("name", "model", "steps", "audio_length", "guidance_scale", "blocks", "rounds", "wait_ms", "threads")
    result = {key: getattr(args, key) for key in keys} | {
        "pipeline": workers[next(iter(workers))]["pipeline"],
        "device": _device(),
    }
    result |= {"ceiling_workers": workers, "rows": rows}
    publish(result, render(result), args.out_dir, args.name)


if __name__ == "__main__":
    # SIGTERM (e.g. `kill PID` of a run started with nohup) stops the server and the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
