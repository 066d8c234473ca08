"""Per-request overhead at concurrency 1: where a request's time goes besides the engine's execution.

    python benchmarks/overhead.py [--model DIR | --family flux] [--size 64x64] [--steps 4] [--n 1] [--count 100]
        [--formats b64_json,url] [--output-format png] [--block 20] [--warmup 5] [--server-arg=--flag ...]
        [--out-dir DIR --name NAME]

Starts a real ``vllm serve MODEL --omni`` (tiny random-weight model built offline unless ``--model``; access log
off, as in the other benchmarks) and sends ``--count`` requests per response format, one at a time, over one
keep-alive connection (httpx), alternating the formats in blocks of ``--block`` requests. The end-to-end latency is
the client's (request sent → whole answer read; a ``url`` answer's image is not downloaded). The phases come from the
server itself: the difference of its ``vllm_omni:request_phase_seconds{api="images"}`` histograms before and after
each block (sum over count is the mean), observed once per completed request:

    parse        the route receives the body and decodes its JSON
    validation   FastAPI's schema validation (pydantic) and API-key check, and the server's request checks
    completion   parameter completion and the operator's limits (``AsyncOmni.admit``, with its thread hop)
    handoff      to the engine and back: submitting, and the output's way back to the event loop
    queue        arrival in the engine → the engine starts on it (``RequestMetrics.queue_ms``)
    execution    the engine's work on it (``RequestMetrics.exec_ms``: the pipeline call, VAE decode included)
    encoding     image file encoding (and base64), in worker threads
    response     the response object: ``url`` entries, FastAPI's serialisation

``outside the route`` is the client's latency minus the sum of the phases: the client, loopback TCP, uvicorn's HTTP
parsing and writing, and the ASGI middlewares; the client's own CPU time is shown beside it. For scale, the script
also times ``GET /health`` over the same client (a route that does almost nothing). The target
(docs/performance.md) is end to end minus execution ≤ 3 ms at 64×64 PNG; it is reported, never an exit code, with
encoding shown separately.

``--stub-engine`` serves the same app with a stub engine instead of the model (one thread that answers each request
at once with ready-made random images; ``--stub-busy-ms`` of torch work first): the HTTP layer's own cost, in
isolation and with the CPU left as a pipeline call leaves it.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import httpx
from common import REPO, Script, publish
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.testing.models.tiny import FAMILIES, make_tiny_model
from vllm_omni.testing.processes.server import RemoteOmniServer, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("parse", "validation", "completion", "handoff", "queue", "execution", "encoding", "response")
METRIC = "vllm_omni:request_phase_seconds"
TARGET_MS = 3.0


def phase_totals(client: httpx.Client) -> dict[str, tuple[float, float]]:
    """``{phase: (sum of seconds, count)}`` of the server's image request phases, now."""
    totals = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith(METRIC) and sample.labels.get("api") == "images":
                seconds, count = totals.get(sample.labels["phase"], (0.0, 0.0))
                if sample.name == f"{METRIC}_sum":
                    seconds = sample.value
                elif sample.name == f"{METRIC}_count":
                    count = sample.value
                totals[sample.labels["phase"]] = (seconds, count)
    return totals


class StubServer:
    """The real HTTP app (``build_app``, uvicorn) in a process of its own (`common.Script`), with a stub engine instead
    of the model: one thread that answers each request at once with ``n`` ready-made random images (after
    ``busy_ms`` of torch matrix products, when given, reported as its execution, to leave the CPU as a pipeline call
    leaves it). The HTTP layer's own floor."""

    def __init__(self, args):
        self.port = free_port()
        self.argv = ["--serve-stub", str(self.port), "--size", args.size, "--stub-busy-ms", str(args.stub_busy_ms)]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Always a log, so that a stub that dies before it is ready can say why, as `RemoteOmniServer`'s.
        descriptor, self.log_path = tempfile.mkstemp(prefix="overhead-stub-", suffix=".log")
        os.close(descriptor)
        self.returncode: int | None = None

    def __enter__(self) -> StubServer:
        self.process = Script("overhead", self.argv, REPO, self.log_path)
        while True:
            if (code := self.process.poll()) is not None:
                with open(self.log_path) as log:
                    raise RuntimeError(f"the stub server exited with {code}: {log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc_info) -> None:
        self.process.send_signal(signal.SIGINT)
        self.returncode = self.process.wait()


def serve_stub(port: int, size: str, busy_ms: float) -> None:
    """`StubServer`'s process."""
    import asyncio
    import queue
    import threading
    from concurrent.futures import Future

    import numpy as np
    import torch
    import uvicorn
    from PIL import Image

    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.diffusion.families.model_card import ModelCard
    from vllm_omni.entrypoints.openai.app import build_app
    from vllm_omni.orchestrator.stage_runtime import StageHealth
    from vllm_omni.outputs import OmniRequestOutput, RequestMetrics
    from vllm_omni.sampling_params import AdmittedParams

    width, height = map(int, size.split("x"))
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image, matrix = Image.fromarray(pixels), torch.randn(256, 256)

    class StubOmni:
        num_waiting = 0
        lora_adapters = []
        output_kind = "image"
        speech_card = None
        model_card = ModelCard(
            pipeline_name="StubPipeline",
            call_args=frozenset(),
            call_defaults={},
            default_size=(height, width),
            size_multiple=8,
            frame_multiple=1,
            outputs_arg="num_images_per_prompt",
        )

        def __init__(self):
            self.requests: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._loop, daemon=True).start()

        def _loop(self) -> None:
            while True:
                future, prompt, request_id, n = self.requests.get()
                started = time.perf_counter()
                while time.perf_counter() - started < busy_ms / 1000:
                    matrix @ matrix
                busy = 1000 * (time.perf_counter() - started) if busy_ms else 0.0
                metrics = RequestMetrics(batch_size=1, queue_ms=0.0, exec_ms=busy, seed=0, replica=0)
                future.set_result(OmniRequestOutput(request_id, prompt, images=[image] * n, metrics=metrics))

        def health(self) -> list[StageHealth]:
            return [StageHealth(0, 1, [0])]

        def admit(self, params) -> AdmittedParams:
            return AdmittedParams(params, (None,))

        async def generate(self, prompt, admitted, request_id=None):
            future: Future = Future()
            self.requests.put((future, prompt, request_id, admitted.params.num_outputs_per_prompt))
            yield await asyncio.wrap_future(future)

    app = build_app("stub", [], ServingConfig(served_model_names=["stub"]), on_fatal=print)
    app.state.server.omni, app.state.server.ready = StubOmni(), True
    uvicorn.run(app, host="127.0.0.1", port=port, lifespan="off", access_log=False, log_level="warning")


def run_block(client: httpx.Client, count: int, body: dict | None = None) -> tuple[list[float], float]:
    """``count`` image requests (or, without ``body``, ``GET /health``) one after the other: their latencies, and
    the CPU seconds this client spent on them (s)."""
    latencies, cpu = [], 0.0
    for _ in range(count):
        started, started_cpu = time.perf_counter(), time.process_time()
        response = client.get("/health") if body is None else client.post("/v1/images/generations", json=body)
        response.read()
        latencies.append(time.perf_counter() - started)
        cpu += time.process_time() - started_cpu
        if response.status_code != 200:
            raise RuntimeError(f"request failed: {response.status_code} {response.text[:300]}")
    return latencies, cpu


def measure(model: str, args) -> dict:
    server_args = ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args.server_arg]
    formats = args.formats.split(",")
    latencies: dict[str, list[float]] = {f: [] for f in formats}
    health: list[float] = []
    per_block: dict[str, list[float]] = {f: [] for f in formats}
    client_cpu = dict.fromkeys(formats, 0.0)
    phases = {f: {p: [0.0, 0.0] for p in PHASES} for f in formats}
    server = StubServer(args) if args.stub_engine else RemoteOmniServer(model, server_args)
    with server, httpx.Client(base_url=server.base_url, timeout=600) as client:
        bodies = {
            f: {
                "prompt": "a photo of a cat",
                "size": args.size,
                "num_inference_steps": args.steps,
                "response_format": f,
                "output_format": args.output_format,
                "seed": 0,
                "n": args.n,
            }
            for f in formats
        }
        for f in formats:
            run_block(client, args.warmup, bodies[f])
        done = 0
        while done < args.count:
            block = min(args.block, args.count - done)
            health += run_block(client, block)[0]
            for f in formats:
                before = phase_totals(client)
                block_latencies, cpu = run_block(client, block, bodies[f])
                client_cpu[f] += cpu
                after = phase_totals(client)
                for phase in PHASES:
                    seconds, count = after.get(phase, (0.0, 0.0))
                    phases[f][phase][0] += seconds - before.get(phase, (0.0, 0.0))[0]
                    phases[f][phase][1] += count - before.get(phase, (0.0, 0.0))[1]
                execution = after["execution"][0] - before.get("execution", (0.0, 0.0))[0]
                per_block[f].append(round(1000 * (sum(block_latencies) - execution) / block, 3))
                latencies[f] += block_latencies
            done += block
    if server.returncode != 0:
        raise RuntimeError(f"the server exited with {server.returncode}")
    results = {
        f: summarize(latencies[f], phases[f])
        | {
            "client_cpu_ms": round(1000 * client_cpu[f] / len(latencies[f]), 3),
            "e2e_minus_execution_per_block_ms": per_block[f],
        }
        for f in formats
    }
    results["GET /health"] = {"requests": len(health), "e2e_p50_ms": round(1000 * statistics.median(health), 3)}
    return results


def summarize(latencies: list[float], phases: dict[str, list[float]]) -> dict:
    counts = {phase: count for phase, (_, count) in phases.items()}
    if any(count != len(latencies) for count in counts.values()):
        raise RuntimeError(f"the server observed {counts} phases for {len(latencies)} requests")
    ms = {phase: 1000 * seconds / count for phase, (seconds, count) in phases.items()}
    e2e = 1000 * statistics.mean(latencies)
    ms["outside the route"] = e2e - sum(ms.values())
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "phases_ms": {k: round(v, 3) for k, v in ms.items()},
        "e2e_mean_ms": round(e2e, 3),
        "e2e_p50_ms": round(1000 * ordered[len(ordered) // 2], 3),
        "e2e_p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 3),
        "e2e_minus_execution_ms": round(e2e - ms["execution"], 3),
        "e2e_minus_execution_and_encode_ms": round(e2e - ms["execution"] - ms["encoding"], 3),
    }


def table(results: dict, args) -> str:
    formats = [f for f in results if f != "GET /health"]
    lines = [
        f"| phase (mean ms, {args.size}, {args.steps} steps, n={args.n}, {args.output_format}) | "
        + " | ".join(formats)
        + " | share of e2e ("
        + formats[0]
        + ") |",
        "|---|" + "---|" * (len(formats) + 1),
    ]
    first = results[formats[0]]
    for phase in (*PHASES, "outside the route"):
        cells = " | ".join(f"{results[f]['phases_ms'][phase]:.3f}" for f in formats)
        share = 100 * first["phases_ms"][phase] / first["e2e_mean_ms"]
        lines.append(f"| {phase} | {cells} | {share:.1f} % |")
    cells = " | ".join(f"{results[f]['client_cpu_ms']:.3f}" for f in formats)
    lines.append(f"| of which the client's CPU (httpx) | {cells} | |")
    for label, key in (
        ("**end to end** (client, mean)", "e2e_mean_ms"),
        ("end to end p50 / p90", None),
        ("**end to end − execution**", "e2e_minus_execution_ms"),
        ("end to end − execution − encode", "e2e_minus_execution_and_encode_ms"),
    ):
        if key is None:
            cells = " | ".join(f"{results[f]['e2e_p50_ms']:.2f} / {results[f]['e2e_p90_ms']:.2f}" for f in formats)
        else:
            cells = " | ".join(f"{results[f][key]:.3f}" for f in formats)
        lines.append(f"| {label} | {cells} | |")
        if key == "e2e_minus_execution_ms":
            cells = " | ".join(
                f"{statistics.median(results[f]['e2e_minus_execution_per_block_ms']):.2f} "
                f"({min(results[f]['e2e_minus_execution_per_block_ms']):.2f}–"
                f"{max(results[f]['e2e_minus_execution_per_block_ms']):.2f})"
                for f in formats
            )
            lines.append(f"| per-block median and range (blocks of {args.block}) | {cells} | |")
    verdicts = ", ".join(
        f"{f}: {results[f]['e2e_minus_execution_ms']:.2f} ms "
        f"({'met' if results[f]['e2e_minus_execution_ms'] <= TARGET_MS else 'missed'})"
        for f in formats
    )
    lines.append(f"\nTarget: end to end − execution ≤ {TARGET_MS:g} ms. {verdicts}.")
    lines.append(
        f"For scale: `GET /health` over the same client takes {results['GET /health']['e2e_p50_ms']:.2f} ms (p50)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="diffusers folder to serve (default: build a tiny one of --family)")
    parser.add_argument("--family", default="flux", choices=sorted(FAMILIES))
    parser.add_argument("--size", default="64x64", help="WxH")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--count", type=int, default=100, help="measured requests per response format")
    parser.add_argument("--n", type=int, default=1, help="images per request")
    parser.add_argument("--formats", default="b64_json,url", help="response formats, comma-separated")
    parser.add_argument("--output-format", default="png", choices=("png", "jpeg", "webp"))
    parser.add_argument("--block", type=int, default=20, help="requests per format before switching formats")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured requests per format first")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="one more argument of vllm serve (repeat: --server-arg=X)"
    )
    parser.add_argument(
        "--stub-engine",
        action="store_true",
        help="serve the real HTTP app with a stub engine that answers at once (no model): the HTTP layer alone",
    )
    parser.add_argument(
        "--stub-busy-ms", type=float, default=0.0, help="with --stub-engine: torch work per request before answering"
    )
    parser.add_argument("--serve-stub", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help="write <name>.json and <name>.md there")
    parser.add_argument("--name", default="cpu-tiny-overhead")
    args = parser.parse_args(argv)
    if args.serve_stub is not None:
        serve_stub(args.serve_stub, args.size, args.stub_busy_ms)
        return

    model = "stub" if args.stub_engine else args.model
    model = model or make_tiny_model(os.path.join(tempfile.mkdtemp(), args.family), args.family)
    results = measure(model, args)
    summary = {
        "model": model,
        "stub_busy_ms": args.stub_busy_ms if args.stub_engine else None,
        "size": args.size,
        "steps": args.steps,
        "output_format": args.output_format,
        "n": args.n,
        "count": args.count,
        "target_ms": TARGET_MS,
        "results": results,
    }
    publish(summary, table(results, args), args.out_dir, args.name)


if __name__ == "__main__":
    main()
