"""LoRA at N = 4: four tenants with their own adapters, mixed batching against adapter-in-key batching and the base
model; and the RSS check (memory grows by the adapters' size only).

    python benchmarks/lora.py --rss --rss-rank 8192      # the published run: results/cpu-tiny-lora.{json,md}
    python benchmarks/lora.py [--model DIR | --family flux] [--execution-mode request,step] [--requests 32]
        [--reps 3] [--steps 8] [--size 64x64] [--rank 16] [--rss [--rss-adapters 10] [--rss-rank 64]]
        [--quick] [--out-dir DIR] [--name cpu-tiny-lora]

Every variant runs through `AsyncOmni` (``max_num_seqs 4``, inline) on the same model (``--model``, or the tiny
random-weight ``--family`` built once into ``--model-dir``), under the same closed loop: 4 clients, client i always
selects tenant i's adapter (``tenant<i>``, a random rank-``--rank`` adapter written by
`vllm_omni.testing.models.lora.write_random_lora`), ``--requests`` requests per variant in all (request j: client j mod
4,
its own prompt, seed ``--seed`` + j, the same in every variant and rep):

- ``mixed``: the product as is, ``max_loras 4``, the four adapters served from start-up: tenants share a batch
  (request mode) or a forward (step mode), each row with its own adapter's delta.
- ``adapter-in-key``: the same engine, with the batch key also holding the request's adapter names, so tenants never
  share a batch: what peers do. This is an emulation in this benchmark only, not a product mode: the stage's
  `StageAdmission` (where the engine admits requests, and where each replica's engine keys them) is swapped for
  `AdapterInKeyAdmission`, whose ``key`` is ``(the product's key, frozenset(adapter names))``; the swap is undone for
  ``mixed``. ``max_loras`` stays 4, so every adapter stays resident and no variant pays for reloads. With one client
  per tenant this runs every request in a batch (or forward) of its own.
- ``base``: no adapter, on an engine without LoRA (``enable_lora`` off), the same load.

In request mode ``request_batch_max_wait_ms`` is 50 (``--request-wait-ms``): under a closed loop of 4 the four
clients resubmit within a few milliseconds of each other once their batch is done, and a batch starts as soon as it
is full, so the wait only bounds how long a partial batch may wait and never delays a full one. At 0 the batch of 4
forms only when all four resubmissions reach the scheduler before the engine's thread takes the first one alone (a
race: on a quiet machine the event loop usually wins it; a busy one splits rounds into 1 + 3). Requests that queued
behind a running batch start at once in any case, so ``adapter-in-key``, whose other tenants are always queued,
never waits either. Step mode takes no admission wait (0).

The engines' torch work must not share a process: every thread that runs torch ops on the CPU brings its own OpenMP
team, and a process holding more OpenMP threads than cores slows every forward (docs/performance.md). So each
engine runs in a worker process of its own (`engine_workers`), whose one engine thread does all its torch work and whose
main thread runs none; the main process writes the tiny model and the adapters meanwhile, and only drives. Per
mode, the LoRA engine (``mixed`` and ``adapter-in-key``) and the base engine are up together, each warmed up on
every variant it serves, and each of the ``--reps`` reps runs the three variants in turn, the order alternating per
rep, so a shared machine's drift hits all alike. Per (mode, variant): req/s, images/s, end-to-end latency
p50/p90/mean and the mean batch size (each output's ``metrics.batch_size``: requests per pipeline call in request
mode, its mean requests per forward in step mode), medians over the reps; the ratios mixed / adapter-in-key and
mixed / base (req/s and p90), medians over the reps of each rep's ratio.

``--rss``: a separate check, run in the main process once the workers are gone (its engine's thread runs the torch
work; speed does not matter here): an engine with ``enable_lora`` and ``max_loras 2``; ``--rss-adapters`` adapters
(rank ``--rss-rank``) are added one by one with ``add_lora``, each served one request right after. This process's RSS
(``VmRSS`` of /proc/self/status, after ``gc.collect()``), as a server has it, is read after the request with the
first adapter (the start) and after each later one; the check passes when the growth from the start to the last stays
within 2 × the adapter file's size. (The engine hands the pages an eviction or a load frees back to the system with
glibc's ``malloc_trim``; without that, RSS kept up to four adapters' worth more.) Also reported: the spread of RSS
from the second adapter on (two adapters resident throughout; above the bound, the verdict is marked inconclusive),
the growth per adapter over those readings (least-squares slope: a leak of every evicted adapter shows as about its
size), the bytes of LoRA weights loaded in the pipeline at the start and the end (exact: one adapter's, then two's)
and the adapters resident at the end (2 expected). Small adapters drown in the allocator's noise: on the tiny flux a
rank-64 adapter is a 0.17 MiB file in small tensors, and loading and evicting such adapters moves RSS by a few MiB
either way (no tensor or hook is left behind: Python sees the same tensors after every cycle), so the published run
uses ``--rss-rank 8192``, a 21.5 MiB file: RSS then grows by one adapter at the second adapter and stays flat.

Nothing is asserted and the exit code says nothing about speed: the figures and the RSS verdict are reported. Writes
``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from common import PROMPTS, add_model_arguments, publish
from engine_workers import Worker
from step_batching import HERE, _device, _ratio, cached_model

from vllm_omni import AsyncOmni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.engine.roles import StageAdmission

VARIANTS = ("mixed", "adapter-in-key", "base")
MODES = ("request", "step")
TENANTS = 4
MAX_NUM_SEQS = 4
MAX_LORAS = 4
RSS_MAX_LORAS = 2
FAMILIES = ("flux", "sd", "flux-bench")


class AdapterInKeyAdmission(StageAdmission):
    """The baseline emulation (this benchmark only): the product's batch key with the request's adapter names added,
    so that requests with different adapters never share a batch or a forward."""

    def key(self, params: OmniDiffusionSamplingParams):
        return (super().key(params), frozenset(selection.name for selection in params.lora))


def set_adapter_in_key(omni: AsyncOmni, on: bool) -> None:
    """Key every stage's requests with their adapters (``on``) or as the product does: the stage's admission (the
    keys the engine routes by) and each replica engine's own (the keys its scheduler batches by). Call it while the
    engine is idle."""
    kind = AdapterInKeyAdmission if on else StageAdmission
    for stage in omni.engine.stages:
        for holder in (stage, *(replica.engine for replica in stage.replicas)):
            admission = holder.admission
            holder.admission = kind(admission.role, admission.card, admission.stepper)


def adapter_bytes(path: str) -> int:
    """Bytes of an adapter on disk (its folder's files, or the file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def rss_bytes() -> int:
    """This process's resident set size (``VmRSS``) after ``gc.collect()``."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# The files, written by the main process (while the first workers import), before any engine starts.


def prepare(args, root: str) -> dict:
    """The model folder, and the adapters: ``tenant<i>`` for the variants, ``rss<i>`` for the RSS check."""
    from vllm_omni.testing.models.lora import write_random_lora

    model = args.model or cached_model(args.model_dir, args.family)
    tenants = {
        f"tenant{i}": write_random_lora(model, os.path.join(root, f"tenant{i}"), seed=args.seed + i, rank=args.rank)
        for i in range(TENANTS)
    }
    rss = {
        f"rss{i}": write_random_lora(model, os.path.join(root, f"rss{i}"), seed=args.seed + 100 + i, rank=args.rss_rank)
        for i in range(args.rss_adapters if args.rss else 0)
    }
    return {"model": model, "tenants": tenants, "rss": rss}


def prepare_variant(omni: AsyncOmni, variant: str) -> None:
    """Before each run in a worker: the LoRA engine keys its requests by adapter for ``adapter-in-key`` only."""
    if omni.stage_configs[0].lora_modules:
        set_adapter_in_key(omni, variant == "adapter-in-key")


def engine_knobs(mode: str, tenants: dict[str, str] | None, args) -> dict:
    knobs = dict(
        max_num_seqs=MAX_NUM_SEQS,
        execution_mode=mode,
        request_batch_max_wait_ms=args.request_wait_ms if mode == "request" else 0.0,
        distributed_executor_backend="inline",
    )
    if tenants:
        knobs.update(
            lora_modules=[f"{name}={path}" for name, path in tenants.items()],
            max_loras=MAX_LORAS,
            max_lora_rank=max(64, args.rank),
        )
    return knobs


def workload(variant: str, count: int, args, seed: int) -> list[list[tuple[str, dict]]]:
    """Per client, its requests: request j goes to client j mod 4, which selects tenant (j mod 4)'s adapter
    (none for ``base``)."""
    width, height = (int(v) for v in args.size.split("x"))
    clients: list[list[tuple[str, dict]]] = [[] for _ in range(TENANTS)]
    for j in range(count):
        params = dict(height=height, width=width, num_inference_steps=args.steps, seed=seed + j)
        if variant != "base":
            params["lora"] = {"name": f"tenant{j % TENANTS}", "scale": 1.0}
        clients[j % TENANTS].append((f"{PROMPTS[j % len(PROMPTS)]}, take {j}", params))
    return clients


def spawn_workers(mode: str) -> dict[str, Worker]:
    """The two workers of a mode: ``lora`` (mixed and adapter-in-key) and ``base``."""
    return {kind: Worker(f"lora-{mode}-{kind}", prepare_variant) for kind in ("lora", "base")}


def measure_mode(mode: str, workers: dict[str, Worker], files: dict, args) -> list[dict]:
    """The three variants in one execution mode: one row each. Closes ``workers``."""
    reps: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    try:
        workers["lora"].start(files["model"], engine_knobs(mode, files["tenants"], args))
        workers["base"].start(files["model"], engine_knobs(mode, None, args))
        for worker in workers.values():
            worker.answer()  # ready
        print(f"[{mode}] engines up", flush=True)
        for variant in VARIANTS:  # warm-up: each variant's batch shapes once
            warm = workload(variant, 2 * TENANTS, args, args.seed + 10_000)
            workers["base" if variant == "base" else "lora"].run(variant, warm)
        work = {variant: workload(variant, args.requests, args, args.seed) for variant in VARIANTS}
        for rep in range(args.reps):
            for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                summary = workers["base" if variant == "base" else "lora"].run(variant, work[variant])
                reps[variant].append(summary)
                print(
                    f"[{mode}] rep {rep + 1} {variant}: {summary['req_per_s']:.3f} req/s, e2e p50/p90 "
                    f"{summary['p50_ms']:.0f}/{summary['p90_ms']:.0f} ms, mean batch {summary['batch_mean']:.2f}",
                    flush=True,
                )
    finally:
        for worker in workers.values():
            worker.close()
    rows = []
    for variant in VARIANTS:
        mine = reps[variant]
        row = {"mode": mode, "variant": variant}
        for field in ("req_per_s", "images_per_s", "p50_ms", "p90_ms", "mean_ms", "batch_mean"):
            row[field] = round(statistics.median(r[field] for r in mine), 3)
        row["reps"] = [{k: round(v, 3) for k, v in r.items()} for r in mine]
        rows.append(row)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per mode: mixed over adapter-in-key and over base (req/s and p90), medians over the reps of each rep's ratio
    (rep i of every variant ran back to back)."""
    found = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        by = {r["variant"]: r["reps"] for r in rows if r["mode"] == mode}
        entry = {"mode": mode}
        for other, tag in (("adapter-in-key", "key"), ("base", "base")):
            for field, name in (("req_per_s", "req_per_s"), ("p90_ms", "p90")):
                per_rep = [_ratio(m[field], o[field]) for m, o in zip(by["mixed"], by[other], strict=True)]
                entry[f"mixed_over_{tag}_{name}"] = statistics.median(per_rep)
        found.append(entry)
    return found


# The RSS check (in the main process, once the workers are gone).


def lora_parameter_bytes(omni: AsyncOmni) -> int:
    """Bytes of the LoRA weights loaded in the engine's pipeline (every ``lora_A`` and ``lora_B`` of its PEFT layers;
    tensor metadata only, no torch op)."""
    from peft.tuners.lora import LoraLayer

    adapters = omni.engine.stages[0].replicas[0].engine.runner.lora
    return sum(
        p.numel() * p.element_size()
        for _, _, component in adapters.components()
        for layer in component.modules()
        if isinstance(layer, LoraLayer)
        for weights in (layer.lora_A, layer.lora_B)
        for p in weights.parameters()
    )


def rss_check(model: str, adapters: dict[str, str], args) -> dict:
    """Add ``adapters`` one by one to an engine with ``max_loras 2``, one request with each: RSS and the bytes of
    LoRA weights loaded after the request with the first adapter (the start) and after each later one."""
    omni = AsyncOmni(
        model,
        max_num_seqs=1,
        enable_lora=True,
        max_loras=RSS_MAX_LORAS,
        max_lora_rank=max(64, args.rss_rank),
        distributed_executor_backend="inline",
    )
    width, height = (int(v) for v in args.size.split("x"))

    async def one(name: str, seed: int) -> None:
        params = OmniDiffusionSamplingParams(
            height=height, width=width, num_inference_steps=args.steps, seed=seed, lora={"name": name}
        )
        async for _ in omni.generate(f"{PROMPTS[seed % len(PROMPTS)]}, adapter {name}", params):
            pass

    async def serve_each() -> tuple[list[int], list[int]]:
        series, weights = [], []
        for i, (name, path) in enumerate(adapters.items()):
            await omni.add_lora(name, path)
            await one(name, i)
            series.append(rss_bytes())
            weights.append(lora_parameter_bytes(omni))
        return series, weights

    try:
        series, weights = asyncio.run(serve_each())
        resident = list(omni.engine.stages[0].replicas[0].engine.runner.lora.resident)
    finally:
        omni.shutdown()
    size = max(adapter_bytes(path) for path in adapters.values())
    growth = series[-1] - series[0]
    return {
        "adapters": len(adapters),
        "rank": args.rss_rank,
        "max_loras": RSS_MAX_LORAS,
        "adapter_bytes": size,
        "start_rss_bytes": series[0],
        "end_rss_bytes": series[-1],
        "growth_bytes": growth,
        "bound_bytes": 2 * size,
        "pass": growth <= 2 * size,
        # From the second adapter on two are resident: how far RSS moves meanwhile is noise (or a leak's trend).
        "spread_bytes": max(series[1:]) - min(series[1:]),
        "growth_per_adapter_bytes": round(float(np.polyfit(range(len(series) - 1), series[1:], 1)[0]))
        if len(series) > 2
        else None,
        "rss_after_each_bytes": series,
        "lora_weights_start_bytes": weights[0],
        "lora_weights_end_bytes": weights[-1],
        "lora_weights_max_bytes": max(weights),
        "resident": resident,
        "resident_count": len(resident),
    }


# Output.


def tables(result: dict) -> str:
    lines = [
        "| mode | variant | req/s | images/s | e2e p50 (ms) | e2e p90 (ms) | mean batch | req/s per rep |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per_rep = ", ".join(f"{rep['req_per_s']:.2f}" for rep in r["reps"])
        lines.append(
            f"| {r['mode']} | {r['variant']} | {r['req_per_s']:.3f} | {r['images_per_s']:.3f} | {r['p50_ms']:.0f} "
            f"| {r['p90_ms']:.0f} | {r['batch_mean']:.2f} | {per_rep} |"
        )
    lines.append("")
    for q in result["ratios"]:
        lines.append(
            f"- {q['mode']}: mixed / adapter-in-key req/s **{q['mixed_over_key_req_per_s']}x** (p90 "
            f"{q['mixed_over_key_p90']}x); mixed / base req/s **{q['mixed_over_base_req_per_s']}x** (p90 "
            f"{q['mixed_over_base_p90']}x)"
        )
    rss = result["rss"]
    if rss is not None:
        mib = ", ".join(f"{b / 2**20:.2f}" for b in rss["rss_after_each_bytes"])
        verdict = "PASS" if rss["pass"] else "FAIL"
        if rss["spread_bytes"] > rss["bound_bytes"]:
            verdict += " (inconclusive: RSS moved more than the bound while two adapters were resident)"
        lines.append(
            f"- RSS check **{verdict}**: "
            f"{rss['adapters']} adapters (rank {rss['rank']}, {rss['adapter_bytes']} bytes each) served in turn with "
            f"max_loras {rss['max_loras']}: RSS growth "
            f"{rss['growth_bytes']} bytes from the start (after the first adapter's request) to the last, bound "
            f"{rss['bound_bytes']} (2 adapters); spread from the "
            f"second adapter on (2 resident) {rss['spread_bytes']}; per adapter "
            f"(least squares) {rss['growth_per_adapter_bytes']}; LoRA weights loaded {rss['lora_weights_start_bytes']}"
            f" → {rss['lora_weights_end_bytes']} bytes (max {rss['lora_weights_max_bytes']}); resident at the end "
            f"{rss['resident_count']} ({', '.join(rss['resident'])}); RSS after each adapter (MiB): {mib}"
        )
    c = result["config"]
    lines += [
        "",
        f"{result['device']}; {c['model_label']}, {c['size']}, {c['steps']} steps; {TENANTS} closed-loop clients "
        f"(client i: tenant i's adapter, rank {c['rank']}), {c['requests']} requests per variant and rep, "
        f"{c['reps']} reps (variants interleaved), medians; max_num_seqs {MAX_NUM_SEQS}, max_loras {MAX_LORAS}, "
        f"request mode's request_batch_max_wait_ms {c['request_batch_max_wait_ms']:g}; each engine in a process of its "
        "own. adapter-in-key: emulated (the batch key also holds the adapter names). mean batch: requests per pipeline "
        "call (request mode) or a request's mean requests per forward (step mode). Ratios: medians over the reps of "
        "each rep's ratio.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, FAMILIES)
    parser.add_argument("--execution-mode", default=",".join(MODES), help="comma-separated: request, step")
    parser.add_argument("--requests", type=int, default=32, help="requests per variant and rep (all 4 clients)")
    parser.add_argument("--reps", type=int, default=3, help="runs per variant, interleaved; medians")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    parser.add_argument("--size", default="64x64", help="WxH")
    parser.add_argument("--rank", type=int, default=16, help="rank of the tenants' adapters")
    parser.add_argument(
        "--request-wait-ms", type=float, default=50.0, help="request mode's request_batch_max_wait_ms (docstring)"
    )
    parser.add_argument("--seed", type=int, default=0, help="request j has seed SEED + j; adapter seeds from SEED")
    parser.add_argument("--rss", action="store_true", help="also run the RSS check")
    parser.add_argument("--rss-adapters", type=int, default=10, help="adapters served in turn by the RSS check")
    parser.add_argument("--rss-rank", type=int, default=64, help="rank of the RSS check's adapters")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="cpu-tiny-lora")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke defaults: 8 requests, 1 rep, 2 steps, request mode only, RSS check with 4 adapters",
    )
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(requests=8, reps=1, steps=2, execution_mode="request", rss_adapters=4)
    args = parser.parse_args(argv)
    args.modes = [m for m in args.execution_mode.split(",") if m]
    if unknown := [m for m in args.modes if m not in MODES]:
        parser.error(f"unknown execution modes {unknown}; choose from {', '.join(MODES)}")
    if args.requests < TENANTS or args.requests % TENANTS:
        parser.error(f"--requests must be a positive multiple of {TENANTS} (one client per tenant)")
    if args.rss and args.rss_adapters < 2:
        parser.error("--rss-adapters must be at least 2 (the first is the start)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    root = tempfile.mkdtemp(prefix="lora-bench-")
    workers = spawn_workers(args.modes[0])
    try:
        try:
            files = prepare(args, root)
        except BaseException:
            for worker in workers.values():
                worker.close()
            raise
        print(f"[{time.perf_counter() - started:.1f} s] model {files['model']}; adapters in {root}", flush=True)
        rows = []
        for i, mode in enumerate(args.modes):
            rows += measure_mode(mode, workers if i == 0 else spawn_workers(mode), files, args)
        rss = rss_check(files["model"], files["rss"], args) if args.rss else None
        tenant_bytes = adapter_bytes(files["tenants"]["tenant0"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "model": files["model"],
            "model_label": f"{args.family} (tiny)" if not args.model else os.path.basename(args.model.rstrip("/")),
            "family": None if args.model else args.family,
            "modes": args.modes,
            "variants": list(VARIANTS),
            "size": args.size,
            "steps": args.steps,
            "rank": args.rank,
            "adapter_bytes": tenant_bytes,
            "tenants": TENANTS,
            "requests": args.requests,
            "reps": args.reps,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_loras": MAX_LORAS,
            "request_batch_max_wait_ms": args.request_wait_ms,
            "seed": args.seed,
            "quick": args.quick,
        },
        "rows": rows,
        "ratios": ratios(rows),
        "rss": rss,
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
