"""The speed and memory knobs against none: images/s and latency of each, on one model, under one closed loop.

    python benchmarks/speed_knobs.py                  # the published run: results/cpu-tiny-speed-knobs.{json,md}
    python benchmarks/speed_knobs.py [--model DIR | --family flux] [--variants none,first_block,...]
        [--execution-mode request,step] [--requests 16] [--reps 3] [--steps 8] [--size 128x128] [--quick]
        [--out-dir DIR] [--name cpu-tiny-speed-knobs]

Every variant is one engine (`AsyncOmni`, ``max_num_seqs 4``, inline) on the same model (``--model``, or the tiny
random-weight ``--family`` built once into ``--model-dir``) with the stage knobs of `VARIANTS` on top of the same
base knobs; ``none`` has none (``cache_dit`` runs at ``max_num_seqs`` 1, the only one it takes: it decides for a
whole pipeline call). Each engine runs in a worker process of its own (`engine_workers`), started and warmed
up (`AsyncOmni.warm_up`, which compiles ``compile_sizes``) before any is measured; the seconds that took are its
``ready_s``. All run the same closed loop: 4 clients, ``--requests`` requests per rep in all (request j: client
j mod 4, its own prompt, seed ``--seed`` + j), after a warm-up of 8 requests (``--requests`` when fewer). Each of
the ``--reps`` reps runs every variant in turn, the order alternating per rep, so a shared machine's drift hits all
alike. Per (mode, variant):
images/s, end-to-end latency p50/p90/mean and the mean batch size, medians over the reps; the block computations
its step cache skipped per request (`StepCache.skipped`, what ``vllm_omni:cache_skipped_steps_total`` counts); and
against ``none`` the ratios of images/s and of p50 latency, medians over the reps of each rep's ratio (rep i of
every variant ran back to back).

A variant that cannot start on this host (``cpu_offload`` without CUDA) is reported with the reason it was refused.
The default size is 128x128 because the tiny VAE tiles above its 64 px ``sample_size``: at 64x64 ``vae_tiling``
would not change what runs. The cache configs are the tests' (tests/entrypoints/test_omni_step_cache.py): random
weights give no meaningful quality threshold, only the skipping itself; ``magcache``'s ``mag_ratios`` are not
calibrated for the model. CPU figures do not predict GPU speed-ups (docs/performance.md); `gpu_check.py` runs this
on the flux-bench model where a GPU is lent.

Nothing is asserted and the exit code says nothing about speed. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import PROMPTS, add_model_arguments, publish
from engine_workers import Worker, start_all
from step_batching import HERE, _device, _ratio, cached_model

from vllm_omni import AsyncOmni

MAX_NUM_SEQS = 4
CLIENTS = 4
MODES = ("request", "step")
FAMILIES = ("flux", "flux-bench")
VARIANTS: dict[str, dict] = {
    "none": {},
    "first_block": {"cache_backend": "first_block", "cache_config": {"threshold": 0.5}},
    "taylorseer": {
        "cache_backend": "taylorseer",
        "cache_config": {"cache_interval": 2, "disable_cache_before_step": 2},
    },
    "magcache": {"cache_backend": "magcache", "cache_config": {"threshold": 0.5, "retention_ratio": 0.1}},
    "pab": {
        "cache_backend": "pab",
        "cache_config": {"spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": [-1, 1001]},
    },
    "cache_dit": {  # one request per pipeline call: cache-dit decides for a whole call
        "cache_backend": "cache_dit",
        "cache_config": {
            "residual_diff_threshold": 0.5,
            "max_warmup_steps": 1,
            "Fn_compute_blocks": 1,
            "Bn_compute_blocks": 0,
        },
        "max_num_seqs": 1,
    },
    "compile_regional": {"compile": "regional"},
    "vae_tiling": {"vae_tiling": True},
    "vae_slicing": {"vae_slicing": True},
    "max_batch_pixels_2": {},  # two requests' pixels: set per run (`variant_knobs`)
    "cpu_offload_model": {"cpu_offload": "model"},
}
"""Each variant's stage knobs on top of the base ones."""


def variant_knobs(variant: str, mode: str, args) -> dict:
    """The engine knobs of ``variant`` in ``mode``: the base knobs and the variant's."""
    width, height = (int(v) for v in args.size.split("x"))
    knobs = dict(
        max_num_seqs=MAX_NUM_SEQS,
        execution_mode=mode,
        request_batch_max_wait_ms=args.request_wait_ms if mode == "request" else 0.0,
        distributed_executor_backend="inline",
    )
    knobs |= VARIANTS[variant]
    if variant == "max_batch_pixels_2":
        knobs["max_batch_pixels"] = 2 * width * height
    if variant == "magcache":
        knobs["cache_config"] = {**knobs["cache_config"], "mag_ratios": [1.0] * args.steps}
        knobs["cache_config"]["num_inference_steps"] = args.steps
    if variant == "compile_regional":
        knobs["compile_sizes"] = [args.size]
    return knobs


def skipped_computations(omni: AsyncOmni, variant: str) -> int:
    """Block computations the engine's step cache has skipped so far (0 without one)."""
    cache = omni.engine.stages[0].replicas[0].engine.runner.step_cache
    return 0 if cache is None else cache.skipped


def workload(count: int, args, seed: int) -> list[list[tuple[str, dict]]]:
    """Per client, its requests: request j goes to client j mod 4."""
    width, height = (int(v) for v in args.size.split("x"))
    clients: list[list[tuple[str, dict]]] = [[] for _ in range(CLIENTS)]
    for j in range(count):
        params = dict(height=height, width=width, num_inference_steps=args.steps, seed=seed + j)
        clients[j % CLIENTS].append((f"{PROMPTS[j % len(PROMPTS)]}, take {j}", params))
    return clients


def measure_mode(mode: str, model: str, args) -> list[dict]:
    """Every variant in one execution mode: one row each."""
    workers = {v: Worker(f"knobs-{mode}-{v}", report=skipped_computations) for v in args.variants}
    reps: dict[str, list[dict]] = {v: [] for v in args.variants}
    try:
        ready, refused = start_all(workers, {v: (model, variant_knobs(v, mode, args)) for v in workers})
        for variant in workers:
            print(f"[{mode}] {variant}: up and warm in {ready[variant]:.1f} s", flush=True)
        # The batch shapes of the loop, once (no more than the loop itself: a smoke run's 4 are one batch)
        warm = workload(min(2 * CLIENTS, args.requests), args, args.seed + 10_000)
        for worker in workers.values():
            worker.run("warm-up", warm)
        work = workload(args.requests, args, args.seed)
        order = list(workers)
        for rep in range(args.reps):
            for variant in order if rep % 2 == 0 else order[::-1]:
                summary = workers[variant].run(variant, work)
                reps[variant].append(summary)
                print(
                    f"[{mode}] rep {rep + 1} {variant}: {summary['images_per_s']:.3f} images/s, e2e p50/p90 "
                    f"{summary['p50_ms']:.0f}/{summary['p90_ms']:.0f} ms, mean batch {summary['batch_mean']:.2f}, "
                    f"skipped {summary['report']}",
                    flush=True,
                )
    finally:
        for worker in workers.values():
            worker.close()
    rows = []
    for variant in args.variants:
        base = variant_knobs("none", mode, args)
        knobs = {k: v for k, v in variant_knobs(variant, mode, args).items() if k not in base or base[k] != v}
        row = {"mode": mode, "variant": variant, "knobs": knobs}
        if variant in refused:
            rows.append(row | {"refused": refused[variant]})
            continue
        mine = reps[variant]
        for field in ("images_per_s", "p50_ms", "p90_ms", "mean_ms", "batch_mean"):
            row[field] = round(statistics.median(r[field] for r in mine), 3)
        row["skipped_per_request"] = round(statistics.median(r["report"] for r in mine) / args.requests, 2)
        row["ready_s"] = round(ready[variant], 1)
        if "none" in reps and reps["none"] and variant != "none":
            for field, name in (("images_per_s", "images_per_s"), ("p50_ms", "p50")):
                per_rep = [_ratio(m[field], n[field]) for m, n in zip(mine, reps["none"], strict=True)]
                row[f"{name}_over_none"] = statistics.median(per_rep)
        row["reps"] = [{k: round(v, 3) for k, v in r.items()} for r in mine]
        rows.append(row)
    return rows


def tables(result: dict) -> str:
    config = result["config"]
    lines = [
        f"Speed knobs on {config['model_label']}, {config['size']}, {config['steps']} steps, max_num_seqs "
        f"{MAX_NUM_SEQS}, {CLIENTS} closed-loop clients, {config['requests']} requests x {config['reps']} reps "
        f"({result['device']}). Ratios against `none`, medians of per-rep ratios.",
        "",
        "| mode | variant | images/s | p50 ms | p90 ms | mean batch | skipped / request | images/s / none "
        "| p50 / none | ready s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "refused" in row:
            lines.append(f"| {row['mode']} | {row['variant']} | refused: {row['refused']} | | | | | | | |")
            continue
        lines.append(
            f"| {row['mode']} | {row['variant']} | {row['images_per_s']:.3f} | {row['p50_ms']:.0f} | "
            f"{row['p90_ms']:.0f} | {row['batch_mean']:.2f} | {row['skipped_per_request']} | "
            f"{row.get('images_per_s_over_none', '')} | {row.get('p50_over_none', '')} | {row['ready_s']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, FAMILIES)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--execution-mode", default="request", help="comma-separated: request, step")
    parser.add_argument("--requests", type=int, default=16, help="requests per variant and rep (all 4 clients)")
    parser.add_argument("--reps", type=int, default=3, help="runs per variant, interleaved; medians")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    parser.add_argument("--size", default="128x128", help="WxH")
    parser.add_argument(
        "--request-wait-ms", type=float, default=50.0, help="request mode's request_batch_max_wait_ms (as lora.py)"
    )
    parser.add_argument("--seed", type=int, default=0, help="request j has seed SEED + j")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="cpu-tiny-speed-knobs")
    parser.add_argument("--quick", action="store_true", help="smoke defaults: 4 requests, 1 rep, 2 steps")
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(requests=4, reps=1, steps=2)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.modes = [m for m in args.execution_mode.split(",") if m]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        parser.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if unknown := [m for m in args.modes if m not in MODES]:
        parser.error(f"unknown --execution-mode {unknown}; choose from {', '.join(MODES)}")
    if args.requests < CLIENTS or args.requests % CLIENTS:
        parser.error(f"--requests must be a positive multiple of {CLIENTS} (the closed loop's clients)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    model = args.model or cached_model(args.model_dir, args.family)
    rows = [row for mode in args.modes for row in measure_mode(mode, model, args)]
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "model": model,
            "model_label": f"{args.family} (tiny)" if not args.model else os.path.basename(args.model.rstrip("/")),
            "modes": args.modes,
            "variants": args.variants,
            "size": args.size,
            "steps": args.steps,
            "requests": args.requests,
            "reps": args.reps,
            "max_num_seqs": MAX_NUM_SEQS,
            "request_batch_max_wait_ms": args.request_wait_ms,
            "seed": args.seed,
            "quick": args.quick,
        },
        "rows": rows,
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
