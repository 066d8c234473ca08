"""Real-scale speed without downloading weights: FLUX.1-dev and Qwen-Image at their published sizes, with random
weights, timed through the served API and as a direct pipeline call, against the peers' published figures.

    python benchmarks/real_scale.py [--families flux,qwen-image] [--parts served,batching,modes,knobs]
        [--knobs first_block,taylorseer,magcache,pab,cache_dit,compile_regional] [--batches 1,4,8]
        [--budget-s 420] [--name real-scale] [--out-dir DIR]
    python benchmarks/real_scale.py --reduced    # the same code path at the reduced size, on the CPU (smoke)

Each family's folder holds its published configs, tokenizers and scheduler, no weights
(`vllm_omni.testing.models.full_size`, ``configs_only``); each engine loads it with ``load_format: dummy``, which draws
random bfloat16 weights on the GPU as the stage loads (seconds for FLUX.1-dev's 17 B parameters). The shapes are the
real ones, so the work is too: the figures are speed, with no claim on the images. Each engine serves the HTTP API
(the app ``vllm serve MODEL --omni`` builds, on uvicorn; `in_process_server`) in a worker process of its own, one
at a time, so one model is in GPU memory at a time; requests go over HTTP from this process (`bench_serving`).

1. **served** (every family): one request at 1024x1024 (FLUX.1-dev 28 steps, Qwen-Image 50 without a negative
   prompt, so one forward a step), end to end through ``POST /v1/images/generations`` after a warm-up request,
   and the same call on the pipeline the engine loaded, directly in its process (no server, no engine); the peak
   allocated CUDA memory of each. Against xDiT's 6.71 s and SGLang CI's 7.35 s (FLUX.1-dev) and SGLang CI's 13.1 s
   (Qwen-Image), all on one H100.
2. **batching** (flux): N = 1, 4, 8 requests at once at 512x512 and 1024x1024 in request mode (``max_num_seqs`` 8,
   a 50 ms admission window so that a burst runs as one batch): images/s, the gain over N = 1 (SGLang: 3.21x at
   batch 16 at 512x512, 1.02x at 1024x1024), the batch the server ran, and the peak allocated memory per batch.
3. **modes** (flux): step mode against request mode under load: the same Poisson arrivals at 512x512 (80 % of the
   request-mode images/s at N = 4) to each: requests/s, end-to-end latency and the server's queue wait.
4. **knobs** (flux): each step cache (`speed_knobs.VARIANTS`' settings) and ``compile=regional`` against none, one
   request at 1024x1024 and 28 steps, with the block computations each cache skipped.

The whole run keeps to ``--budget-s`` (420 s: with the imports and the shutdowns it fits one 10-minute command on a
lent machine, and with the machine's start its 15 minutes): before each
engine start and each measured request or batch it estimates the time from what it has measured so far, and what
does not fit is skipped and listed in the report. ``--reduced``: the same parts on the families' reduced sizes
(one or two layers, a few channels; 64x64, 2 steps) on the CPU, the smoke test (tests/benchmarks/test_scripts.py);
at full size without CUDA the script exits 2. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
from bench_serving import run_benchmark
from common import PROMPTS, Shape, publish
from engine_workers import PipeWorker
from speed_knobs import skipped_computations, variant_knobs

from vllm_omni.testing.models.full_size import FULL_SIZE, make_full_size_model

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("flux", "qwen-image")
PARTS = ("served", "batching", "modes", "knobs")
KNOBS = ("first_block", "taylorseer", "magcache", "pab", "cache_dit", "compile_regional")
MODEL_NAMES = {"flux": "FLUX.1-dev", "qwen-image": "Qwen-Image"}
PEERS = {
    "flux": [("xDiT, one H100", 6.71), ("SGLang CI, one H100", 7.35)],
    "qwen-image": [("SGLang CI, one H100", 13.1)],
}
"""The peers' published seconds for one request at 1024x1024 (FLUX.1-dev 28 steps, Qwen-Image 50)."""
BATCHING_PEER = {512: "SGLang: 3.21x at batch 16", 1024: "SGLang: 1.02x at batch 16"}
BATCH_WINDOW_MS = 50.0
"""The batching engine's admission window: the N requests of a burst, sent at once, arrive within it and run as one
batch (the mean batch shows it); a burst of fewer than ``max_num_seqs`` requests waits it out, 2.5 % of one request
at 512x512 on an H100."""
COMPILE_ALLOWANCE_S = {"full": 150.0, "reduced": 120.0}
"""What ``compile=regional``'s warm-up is expected to add to an engine's start (the budget's estimate)."""


@dataclass(frozen=True)
class Scale:
    """The sizes and steps of a run."""

    single: int
    """One request's side (square), in pixels."""
    batching: tuple[int, ...]
    modes: int
    steps: dict[str, int]
    poisson_requests: int


FULL = Scale(single=1024, batching=(512, 1024), modes=512, steps={"flux": 28, "qwen-image": 50}, poisson_requests=12)
REDUCED = Scale(single=64, batching=(64,), modes=64, steps={"flux": 2, "qwen-image": 2}, poisson_requests=4)


@dataclass
class Budget:
    """The run's time budget: what fits is run, what does not is listed."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, what: str, needs: float) -> bool:
        """Whether ``what``, expected to take ``needs`` seconds, fits; else it is listed as skipped."""
        if needs <= self.left():
            return True
        self.skipped.append(
            f"{what}: needs about {needs:.0f} s, {max(0.0, self.left()):.0f} s of the {self.seconds:.0f} s budget left"
        )
        print(f"[budget] skipped {self.skipped[-1]}", flush=True)
        return False


# ------------------------------------------------------------------------------------------------ the worker side


def _serve(conn, model: str, knobs: dict) -> None:
    """A worker: the HTTP app on ``model`` with the stage ``knobs`` (`in_process_server`), its base URL sent once it
    is ready, then ``(function, args)`` commands, each answered with ``function(app, *args)``, until ``None``."""
    from vllm_omni.testing.processes.server import in_process_server

    try:
        with in_process_server(model, **knobs) as (app, base):
            conn.send(("ready", base))
            while (command := conn.recv()) is not None:
                function, args = command
                try:
                    conn.send(("done", function(app, *args)))
                except Exception:  # noqa: BLE001 - the main process reports it
                    conn.send(("error", traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - the main process raises it
        conn.send(("error", traceback.format_exc()))


def _omni(app):
    return app.state.server.omni


def reset_peak(app) -> int | None:
    """The CUDA allocator's peak counter reset (``None`` on the CPU); what is allocated now."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_allocated(app) -> int | None:
    """The most CUDA memory allocated since `reset_peak` (``None`` on the CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def direct_call(app, prompt: str, size: int, steps: int, reps: int) -> dict:
    """The pipeline the engine loaded, called directly ``reps`` times in this process (the engine idle): seconds of
    each call, synchronised, and the peak allocated memory."""
    import torch

    pipeline = _omni(app).engine.stages[0].replicas[0].engine.runner.pipeline
    device = pipeline._execution_device
    reset_peak(app)
    seconds = []
    for rep in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        generator = torch.Generator(device).manual_seed(rep)
        with torch.inference_mode():
            pipeline(prompt=prompt, height=size, width=size, num_inference_steps=steps, generator=generator)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return {"seconds": seconds, "peak_bytes": peak_allocated(app)}


def skipped_blocks(app) -> int:
    """The block computations the engine's step cache has skipped so far (`speed_knobs.skipped_computations`)."""
    return skipped_computations(_omni(app), "")


# ------------------------------------------------------------------------------------------------ the main side


class ServerWorker(PipeWorker):
    """An engine serving the HTTP API in a worker process of its own; `call` runs a function of this module on its
    app there. `close` stops its server (its engine shuts down) and waits for the process: its GPU memory is free
    after."""

    def __init__(self, name: str, model: str, knobs: dict):
        started = time.perf_counter()
        super().__init__(f"real-scale-{name}", _serve, (model, knobs), join_s=180)
        try:
            self.base: str = self.answer()
        except BaseException:
            self.close()
            raise
        self.ready_s = time.perf_counter() - started

    def call(self, function, *args):
        self.conn.send((function, args))
        return self.answer()


def served_seconds(base: str, prompt: str, size: int, steps: int, seed: int) -> float:
    """One request through ``POST /v1/images/generations``, end to end (the image comes back as base64 PNG)."""
    body = {"prompt": prompt, "size": f"{size}x{size}", "num_inference_steps": steps, "seed": seed}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/images/generations", json=body | {"response_format": "b64_json"}, timeout=3600)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text[:500]}")
    return seconds


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / 2**30, 2)


@dataclass
class Run:
    """What the parts share: the arguments, the budget, the folders and what was measured so far."""

    args: argparse.Namespace
    scale: Scale
    budget: Budget
    models: dict[str, str]
    ready_s: list[float] = field(default_factory=list)
    """Each engine start so far, in seconds (the next one's estimate is the longest)."""
    single_s: dict[tuple[str, int], float] = field(default_factory=dict)
    """(family, side): the seconds of one request measured so far (the estimates')."""
    none_s: dict[str, float] = field(default_factory=dict)
    """Per family, the served part's median: the knobs' ``none`` (the same engine knobs)."""

    def start_estimate(self) -> float:
        return max(self.ready_s, default=0.0)

    def request_estimate(self, family: str, side: int, n: int = 1) -> float:
        """N requests at ``side``: from the nearest measured side, by pixels, of the same family, else of another
        by its denoiser's published parameters and steps (batching gains nothing at a GPU's large sizes, so the
        estimate assumes none)."""
        if not self.single_s:
            return 0.0
        (f, s), secs = min(self.single_s.items(), key=lambda item: (item[0][0] != family, abs(item[0][1] - side)))
        return n * secs * (side / s) ** 2 * self._work(family) / self._work(f)

    def _work(self, family: str) -> float:
        """A request's denoising work, relative: the transformer's published parameters times the steps."""
        return FULL_SIZE[family].components["transformer"].published_count * self.scale.steps[family]

    def worker(self, name: str, family: str, knobs: dict, extra_s: float = 0.0) -> ServerWorker | None:
        """A started engine for ``family``, or ``None`` when its start does not fit the budget (or failed: reported)."""
        if self.ready_s and not self.budget.allows(f"{family} {name}: engine start", self.start_estimate() + extra_s):
            return None
        print(f"[{family}] starting {name}: {knobs}", flush=True)
        worker = ServerWorker(f"{family}-{name}", self.models[family], knobs)
        self.ready_s.append(worker.ready_s)
        print(f"[{family}] {name} ready in {worker.ready_s:.1f} s", flush=True)
        return worker

    def base_knobs(self) -> dict:
        """The knobs of `speed_knobs`' ``none`` variant (request mode, ``max_num_seqs`` 4) with random weights: the
        engine of the served part and the knobs' baseline."""
        return variant_knobs("none", "request", self._knob_args(self.scale.single, "flux")) | {"load_format": "dummy"}

    def _knob_args(self, side: int, family: str) -> SimpleNamespace:
        return SimpleNamespace(size=f"{side}x{side}", steps=self.scale.steps[family], request_wait_ms=0.0)


def part_served(run: Run, family: str) -> dict:
    """One request through the server (after a warm-up) and directly on the loaded pipeline."""
    side, steps = run.scale.single, run.scale.steps[family]
    row: dict[str, Any] = {"family": family, "model": MODEL_NAMES[family], "size": side, "steps": steps}
    worker = run.worker("served", family, run.base_knobs())
    if worker is None:
        return row | {"skipped": True}
    try:
        row["ready_s"] = round(worker.ready_s, 1)
        before = worker.call(reset_peak)
        warm = served_seconds(worker.base, PROMPTS[0], side, steps, 0)
        run.single_s[family, side] = warm
        row["warm_up_s"] = round(warm, 3)
        row["served_s"] = []
        for rep in range(run.args.served_reps):
            if not run.budget.allows(f"{family} served request {rep + 1}", run.request_estimate(family, side)):
                break
            row["served_s"].append(round(served_seconds(worker.base, PROMPTS[rep + 1], side, steps, rep + 1), 3))
        row["served_peak_gib"] = _gib(worker.call(peak_allocated))
        row["allocated_at_rest_gib"] = _gib(before)
        if row["served_s"]:
            run.single_s[family, side] = run.none_s[family] = statistics.median(row["served_s"])
        if run.budget.allows(f"{family} direct call", run.request_estimate(family, side, run.args.direct_reps)):
            direct = worker.call(direct_call, PROMPTS[0], side, steps, run.args.direct_reps)
            row["direct_s"] = [round(s, 3) for s in direct["seconds"]]
            row["direct_peak_gib"] = _gib(direct["peak_bytes"])
    finally:
        worker.close()
    return row


async def _burst(base: str, side: int, steps: int, n: int, seed: int) -> dict:
    """N requests sent at once (a closed loop of N clients, one request each), as bench_serving measures them."""
    shape = Shape(side, side, steps)
    return await run_benchmark(
        base, shapes=[shape], num_requests=n, concurrency=n, warmup=0, seed=seed, progress=False, rss_interval_s=None
    )


def part_batching(run: Run, family: str) -> tuple[list[dict], dict | None]:
    """N requests at once at each batching size; then, on the same engine, request mode's side of the modes part."""
    knobs = run.base_knobs() | {"max_num_seqs": max(run.args.batches), "request_batch_max_wait_ms": run.args.window_ms}
    worker = run.worker("batching", family, knobs)
    rows: list[dict] = []
    if worker is None:
        return rows, None
    try:
        steps = run.scale.steps[family]
        for side in run.scale.batching:
            if (family, side) not in run.single_s:  # a warm-up at this size, which also gives the estimate
                if not run.budget.allows(f"{family} {side}px warm-up", run.request_estimate(family, side)):
                    continue
                run.single_s[family, side] = served_seconds(worker.base, PROMPTS[0], side, steps, 99)
            for n in run.args.batches:
                if not run.budget.allows(f"{family} batch of {n} at {side}px", run.request_estimate(family, side, n)):
                    continue
                worker.call(reset_peak)
                result = asyncio.run(_burst(worker.base, side, steps, n, seed=1000 + n))
                row = {"family": family, "size": side, "n": n, "steps": steps}
                row |= {k: result[k] for k in ("images_per_s", "latency_p50_s", "duration_s", "failed")}
                row |= {
                    "mean_batch": result["server"]["mean_batch_size"],
                    "peak_gib": _gib(worker.call(peak_allocated)),
                }
                rows.append(row)
                print(f"[{family}] batch {n} at {side}px: {row}", flush=True)
        _gains(rows)
        request_side = _load(run, worker, family, "request", rows)
    finally:
        worker.close()
    return rows, request_side


def _gains(rows: list[dict]) -> None:
    for row in rows:
        alone = next((r for r in rows if r["size"] == row["size"] and r["n"] == 1), None)
        row["gain"] = round(row["images_per_s"] / alone["images_per_s"], 3) if alone and alone["images_per_s"] else None


def _poisson_rate(run: Run, family: str, rows: list[dict]) -> float:
    """80 % of what request mode served at N = 4 (or the largest N measured) at the modes part's size; else of one
    request at a time."""
    side = run.scale.modes
    measured = [r for r in rows if r["size"] == side]
    if measured:
        best = min(measured, key=lambda r: abs(r["n"] - 4))
        return 0.8 * best["images_per_s"]
    return 0.8 / max(run.request_estimate(family, side), 1e-3)


def _load(run: Run, worker: ServerWorker, family: str, mode: str, rows: list[dict]) -> dict | None:
    """The modes part's Poisson arrivals against ``worker`` (an engine in ``mode``)."""
    if "modes" not in run.args.parts:
        return None
    side, steps, count = run.scale.modes, run.scale.steps[family], run.scale.poisson_requests
    rate = run.args.poisson_rate or _poisson_rate(run, family, rows)
    if not run.budget.allows(f"{family} Poisson load, {mode} mode", count / rate + run.request_estimate(family, side)):
        return None
    result = asyncio.run(
        run_benchmark(
            worker.base,
            shapes=[Shape(side, side, steps)],
            num_requests=count,
            request_rate=rate,
            warmup=1,
            seed=7,  # the same arrivals for both modes
            progress=False,
            rss_interval_s=None,
        )
    )
    server = result["server"]
    row = {"family": family, "mode": mode, "size": side, "steps": steps, "requests": count, "rate": round(rate, 3)}
    row |= {k: result[k] for k in ("requests_per_s", "latency_mean_s", "latency_p90_s", "failed")}
    row |= {"mean_queue_wait_ms": server["mean_queue_wait_ms"], "mean_batch": server["mean_batch_size"]}
    print(f"[{family}] Poisson load, {mode} mode: {row}", flush=True)
    return row


def part_modes(run: Run, family: str, request_side: dict | None, rows: list[dict]) -> list[dict]:
    """Step mode's side of the Poisson load (request mode's ran on the batching engine)."""
    knobs = run.base_knobs() | {"max_num_seqs": max(run.args.batches), "execution_mode": "step"}
    worker = run.worker("step-mode", family, knobs)
    if worker is None:
        return [r for r in (request_side,) if r]
    try:
        step_side = _load(run, worker, family, "step", rows)
    finally:
        worker.close()
    return [r for r in (request_side, step_side) if r]


def part_knobs(run: Run, family: str) -> list[dict]:
    """Each step cache and compile=regional against none: one request each, after a warm-up at half the side."""
    side, steps, rows = run.scale.single, run.scale.steps[family], []
    none = run.none_s.get(family)
    if none is not None:
        rows.append({"family": family, "variant": "none", "size": side, "steps": steps, "seconds": round(none, 3)})
    for variant in run.args.knobs:
        knobs = variant_knobs(variant, "request", run._knob_args(side, family)) | {"load_format": "dummy"}
        extra = COMPILE_ALLOWANCE_S["reduced" if run.args.reduced else "full"] if variant == "compile_regional" else 0
        needs = extra + 2 * run.request_estimate(family, side)
        if not run.budget.allows(f"{family} {variant}: engine start and request", run.start_estimate() + needs):
            continue
        row = {"family": family, "variant": variant, "size": side, "steps": steps}
        try:
            worker = run.worker(variant, family, knobs, extra)
        except RuntimeError as exc:  # refused on this host (cache_dit not installed, say): reported, not measured
            rows.append(row | {"refused": str(exc).strip().splitlines()[-1]})
            continue
        if worker is None:
            continue
        try:
            rows.append(row | _one_knob(worker, variant, side, steps, none))
            print(f"[{family}] {variant}: {rows[-1]}", flush=True)
        finally:
            worker.close()
    return rows


def _one_knob(worker: ServerWorker, variant: str, side: int, steps: int, none: float | None) -> dict:
    """A knob's engine after a warm-up at half the side: one request's seconds, the blocks its cache skipped."""
    if variant != "compile_regional":  # compiled at `side` as it started: another size would compile again
        served_seconds(worker.base, PROMPTS[1], side // 2, steps, 98)
    before = worker.call(skipped_blocks)
    seconds = served_seconds(worker.base, PROMPTS[0], side, steps, 1)
    return {
        "seconds": round(seconds, 3),
        "skipped_blocks": worker.call(skipped_blocks) - before,
        "ready_s": round(worker.ready_s, 1),
        "over_none": round(seconds / none, 3) if none else None,
    }


# ------------------------------------------------------------------------------------------------ report


def environment() -> dict:
    import diffusers
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__}
    env["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"device": torch.cuda.get_device_name(0), "device_memory_gib": round(props.total_memory / 2**30, 1)}
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return env


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


def served_table(rows: list[dict]) -> list[str]:
    lines = [
        "| model | size | steps | served e2e s (median) | direct call s | served / direct | GiB at rest | "
        "peak GiB served | peak GiB direct | peer | peer s | served / peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("skipped"):
            lines.append(f"| {row['model']} | {row['size']}² | {row['steps']} | skipped (budget) |" + " |" * 8)
            continue
        served = statistics.median(row["served_s"]) if row.get("served_s") else None
        direct = min(row["direct_s"]) if row.get("direct_s") else None
        ratio = served / direct if served and direct else None
        peers = PEERS[row["family"]] if row["size"] == 1024 else [("–", None)]
        for i, (peer, peer_s) in enumerate(peers):
            head = (
                f"| {row['model']} | {row['size']}² | {row['steps']} | {_cell(served)} | {_cell(direct)} | "
                f"{_cell(ratio, '{:.3f}')} | {_cell(row.get('allocated_at_rest_gib'))} | "
                f"{_cell(row.get('served_peak_gib'))} | {_cell(row.get('direct_peak_gib'))}"
                if i == 0
                else "| | | | | | | | |"
            )
            mine = served / peer_s if served and peer_s else None
            lines.append(f"{head} | {peer} | {_cell(peer_s)} | {_cell(mine, '{:.2f}x')} |")
    return lines


def batching_table(rows: list[dict]) -> list[str]:
    lines = [
        "| size | N | images/s | gain over N = 1 | mean batch run | p50 e2e s | peak GiB (batch) | peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peer = BATCHING_PEER.get(row["size"], "–") if row["n"] == max(r["n"] for r in rows) else ""
        lines.append(
            f"| {row['size']}² | {row['n']} | {row['images_per_s']:.3f} | {_cell(row['gain'], '{:.2f}x')} | "
            f"{_cell(row['mean_batch'])} | {_cell(row['latency_p50_s'])} | {_cell(row['peak_gib'])} | {peer} |"
        )
    return lines


def modes_table(rows: list[dict]) -> list[str]:
    lines = [
        "| mode | arrivals/s | requests | req/s | mean e2e s | p90 e2e s | mean queue wait ms | mean batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['rate']} | {row['requests']} | {row['requests_per_s']:.3f} | "
            f"{_cell(row['latency_mean_s'])} | {_cell(row['latency_p90_s'])} | "
            f"{_cell(row['mean_queue_wait_ms'], '{:.0f}')} | {_cell(row['mean_batch'])} |"
        )
    return lines


def knobs_table(rows: list[dict]) -> list[str]:
    lines = ["| variant | e2e s | / none | skipped block computations | engine ready s |", "|---|---|---|---|---|"]
    for row in rows:
        if "refused" in row:
            lines.append(f"| {row['variant']} | refused: {row['refused']} | | | |")
            continue
        lines.append(
            f"| {row['variant']} | {row['seconds']:.2f} | {_cell(row.get('over_none'), '{:.2f}x')} | "
            f"{row.get('skipped_blocks', '–')} | {row.get('ready_s', '–')} |"
        )
    return lines


def markdown(result: dict) -> str:
    env, scale = result["environment"], result["config"]
    lines = [
        f"# Real-scale speed{' (reduced size: a smoke run, not a measurement)' if scale['reduced'] else ''}",
        "",
        f"{env['device']}; torch {env['torch']}, diffusers {env['diffusers']}, transformers {env['transformers']}. "
        "**Random weights** (`load_format: dummy` on the published configurations: the same work as the real models, "
        "no claim on image quality), bfloat16 on CUDA. Peers' figures as they publish them, all on one H100. "
        f"Budget {scale['budget_s']:.0f} s, took {result['wall_s']} s.",
        "",
        f"## One request at {scale['single']}², through the server and as a direct pipeline call",
        "",
        *served_table(result["served"]),
    ]
    sections = (
        (
            "batching",
            f"## Batching gain (request mode, max_num_seqs {max(scale['batches'])}, "
            f"a {scale['window_ms']:.0f} ms window)",
            batching_table,
        ),
        ("modes", f"## Step mode against request mode under load ({scale['modes']}², Poisson arrivals)", modes_table),
        ("knobs", f"## Step caches and compile against none ({scale['single']}²)", knobs_table),
    )
    for key, title, table in sections:
        if result[key]:
            lines += ["", title, "", *table(result[key])]
    if result["skipped"]:
        lines += ["", "## Not run (time budget or failure)", "", *(f"- {s}" for s in result["skipped"])]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main


def _csv(value: str, allowed: tuple[str, ...], option: str, parser) -> list[str]:
    chosen = [v for v in value.split(",") if v]
    if unknown := [v for v in chosen if v not in allowed]:
        parser.error(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    return chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--knobs", default=",".join(KNOBS), help=f"comma-separated, of {', '.join(KNOBS)}")
    parser.add_argument("--batches", default="1,4,8", help="the batching part's N, comma-separated")
    parser.add_argument("--budget-s", type=float, default=420.0, help="what does not fit is skipped and listed")
    parser.add_argument(
        "--window-ms", type=float, default=BATCH_WINDOW_MS, help="the batching engine's request_batch_max_wait_ms"
    )
    parser.add_argument("--served-reps", type=int, default=2, help="timed served requests after the warm-up")
    parser.add_argument("--direct-reps", type=int, default=1, help="timed direct pipeline calls")
    parser.add_argument("--poisson-rate", type=float, help="the modes part's arrivals/s (default: 80 %% of N = 4's)")
    parser.add_argument("--reduced", action="store_true", help="the reduced sizes on the CPU: the smoke run")
    parser.add_argument("--model-dir", help="where the configs-only folders are written (default: a temporary one)")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", help="results/<name>.{json,md} (default: real-scale, or cpu-reduced-real-scale)")
    args = parser.parse_args(argv)
    args.families = _csv(args.families, FAMILIES, "--families", parser)
    args.parts = _csv(args.parts, PARTS, "--parts", parser)
    args.knobs = _csv(args.knobs, KNOBS, "--knobs", parser)
    try:
        args.batches = sorted({int(n) for n in args.batches.split(",") if n})
    except ValueError:
        parser.error(f"--batches: comma-separated whole numbers, not {args.batches!r}")
    if not args.batches or args.batches[0] < 1:
        parser.error("--batches: at least one N, each 1 or more")
    args.name = args.name or ("cpu-reduced-real-scale" if args.reduced else "real-scale")
    import torch

    if not args.reduced and not torch.cuda.is_available():
        parser.error(
            "without --reduced, the full size needs CUDA (FLUX.1-dev alone is 34 GB of bfloat16 weights), and there "
            "is none here; --reduced runs the same code path at the reduced size on the CPU"
        )
    return args


def _family_parts(run: Run, family: str, result: dict) -> None:
    """The parts for ``family`` in priority order, each failure reported and the others still run."""
    parts = [("served", lambda: result["served"].append(part_served(run, family)))]
    if family == "flux":  # the peers publish batching, modes and knobs on FLUX.1-dev only
        parts.append(("batching", lambda: _batching_and_modes(run, family, result)))
        parts.append(("knobs", lambda: result["knobs"].extend(part_knobs(run, family))))
    for part, body in parts:
        if part in run.args.parts or (part == "batching" and "modes" in run.args.parts):
            try:
                body()
            except Exception:  # noqa: BLE001 - reported; the other parts still run
                run.budget.skipped.append(f"{family} {part}: failed\n\n```\n{traceback.format_exc(limit=6)}```")
                print(run.budget.skipped[-1], flush=True)


def _batching_and_modes(run: Run, family: str, result: dict) -> None:
    rows, request_side = part_batching(run, family) if "batching" in run.args.parts else ([], None)
    if "batching" not in run.args.parts and "modes" in run.args.parts:  # request mode's side on its own engine
        knobs = run.base_knobs() | {"max_num_seqs": max(run.args.batches)}
        worker = run.worker("request-mode", family, knobs | {"request_batch_max_wait_ms": run.args.window_ms})
        if worker is not None:
            try:
                request_side = _load(run, worker, family, "request", rows)
            finally:
                worker.close()
    result["batching"] += rows
    if "modes" in run.args.parts:
        result["modes"] += part_modes(run, family, request_side, rows)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    scale = REDUCED if args.reduced else FULL
    budget = Budget(args.budget_s)
    with contextlib.ExitStack() as stack:
        folder = args.model_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="real-scale-"))
        size = "reduced" if args.reduced else "full"
        models = {
            f: make_full_size_model(os.path.join(folder, f), f, configs_only=True, size=size) for f in args.families
        }
        run = Run(args, scale, budget, models)
        result: dict[str, Any] = {"name": args.name, "environment": environment()}
        result["config"] = {
            "reduced": args.reduced,
            "families": args.families,
            "parts": args.parts,
            "knobs": args.knobs,
            "batches": args.batches,
            "budget_s": args.budget_s,
            "window_ms": args.window_ms,
            "single": scale.single,
            "batching_sizes": list(scale.batching),
            "modes": scale.modes,
            "steps": scale.steps,
        }
        result |= {"served": [], "batching": [], "modes": [], "knobs": []}
        try:
            for family in args.families:
                _family_parts(run, family, result)
        except KeyboardInterrupt:  # gpu_check.py's time limit: what ran is still written
            budget.skipped.append("interrupted (the caller's time limit): the parts after this point did not run")
    result["skipped"] = budget.skipped
    result["engine_ready_s"] = [round(s, 1) for s in run.ready_s]
    result["wall_s"] = round(time.perf_counter() - budget.started, 1)
    publish(result, markdown(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
