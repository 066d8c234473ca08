"""One request on several ranks against one process: latency at concurrency 1 and throughput at N = 4 for each
parallel combination of a stage (``cfg_parallel_size``, ``ulysses_degree``, ``ring_degree``,
``vae_patch_parallel_size``; docs/scaling.md).

    python benchmarks/parallel.py                     # the published run: results/cpu-tiny-parallel.{json,md}
    python benchmarks/parallel.py [--model DIR | --family flux] [--variants one_process,cfg_2,...]
        [--latency-requests 4] [--requests 16] [--reps 3] [--steps 8] [--size 128x128] [--dtype bfloat16] [--quick]
        [--out-dir DIR] [--name cpu-tiny-parallel]

Every variant is one engine (`AsyncOmni`, request mode, ``max_num_seqs 4``, inline) on the same model (``--model``,
or the tiny random-weight ``--family`` built once into ``--model-dir``) with the degrees of `VARIANTS`;
``one_process`` has none. Each engine runs in a worker process of its own (`engine_workers`), and a variant's ranks
are processes of that worker: the engine's torch threads (the host's cores) are shared out over its ranks, so every
variant uses the same cores. Every request is guided (a negative prompt and Flux's ``true_cfg_scale``), so each
variant runs the same two denoiser calls per step and CFG-parallel has an unconditional branch to split.

Each of the ``--reps`` reps runs every variant in turn (the order alternating per rep, so a shared machine's drift
hits all alike), each with two closed loops: **latency**, one client sending ``--latency-requests`` requests one
after the other (p50 end-to-end latency: what the degrees are for), and **throughput**, 4 clients sending
``--requests`` requests in all (images/s at N = 4: what replicas are for). Per variant: those figures and the
batch size, medians over the reps, and against ``one_process`` the ratios of p50 latency and of images/s, medians
of per-rep ratios. A variant this host cannot start (``ring_2`` without CUDA, a world larger than the devices) is
reported with the reason it was refused.

On this 2-core CPU the ranks share the cores that one process already uses with two torch threads, and gloo moves
every exchange through memory: the figures show the cost of the exchanges, not a GPU's gain (where each rank has a
device of its own). `gpu_check.py` runs this on the flux-bench model where a machine with 2 GPUs is lent.

Nothing is asserted and the exit code says nothing about speed. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import PROMPTS, add_model_arguments, publish
from engine_workers import Clients, Worker, start_all
from step_batching import HERE, _device, _ratio, cached_model

MAX_NUM_SEQS = 4
CLIENTS = 4
FAMILIES = ("flux", "flux-bench")
VARIANTS: dict[str, dict] = {
    "one_process": {},
    "cfg_2": {"cfg_parallel_size": 2},
    "ulysses_2": {"ulysses_degree": 2},
    "ring_2": {"ring_degree": 2},
    "vae_patch_2": {"vae_patch_parallel_size": 2},
    "cfg_2_ulysses_2": {"cfg_parallel_size": 2, "ulysses_degree": 2},  # four ranks
}
"""Each variant's parallel degrees on top of the base knobs."""
PHASES = ("latency", "throughput")


def variant_knobs(variant: str, args) -> dict:
    """The engine knobs of ``variant``: the base knobs and its degrees."""
    base = dict(
        max_num_seqs=MAX_NUM_SEQS,
        request_batch_max_wait_ms=args.request_wait_ms,
        distributed_executor_backend="inline",
    )
    if args.dtype is not None:
        base["dtype"] = args.dtype
    return base | VARIANTS[variant]


def workload(count: int, clients: int, args, seed: int) -> Clients:
    """Per client, its requests (request j goes to client j mod ``clients``), every one guided."""
    width, height = (int(v) for v in args.size.split("x"))
    work: Clients = [[] for _ in range(clients)]
    for j in range(count):
        params = dict(
            height=height,
            width=width,
            num_inference_steps=args.steps,
            seed=seed + j,
            negative_prompt="blurry",
            extra_args={"true_cfg_scale": 4.0},
        )
        work[j % clients].append((f"{PROMPTS[j % len(PROMPTS)]}, take {j}", params))
    return work


def measure(model: str, args) -> list[dict]:
    """Every variant: one row each."""
    workers = {v: Worker(f"parallel-{v}", daemon=False) for v in args.variants}  # a worker's ranks are its children
    reps: dict[str, list[dict]] = {v: [] for v in args.variants}
    try:
        ready, refused = start_all(workers, {v: (model, variant_knobs(v, args)) for v in workers})
        for variant in workers:
            print(f"{variant}: up and warm in {ready[variant]:.1f} s", flush=True)
        loads = {
            "latency": workload(args.latency_requests, 1, args, args.seed),
            "throughput": workload(args.requests, CLIENTS, args, args.seed),
        }
        # The batch shapes of the loops, once (no more than the throughput loop: a smoke run's 4 are one batch)
        warm = workload(min(2 * CLIENTS, args.requests), CLIENTS, args, args.seed + 10_000)
        for worker in workers.values():
            worker.run("warm-up", warm)
        order = list(workers)
        for rep in range(args.reps):
            for variant in order if rep % 2 == 0 else order[::-1]:
                figures = {phase: workers[variant].run(variant, loads[phase]) for phase in PHASES}
                reps[variant].append(figures)
                print(
                    f"rep {rep + 1} {variant}: latency p50 {figures['latency']['p50_ms']:.0f} ms, "
                    f"{figures['throughput']['images_per_s']:.3f} images/s at N = {CLIENTS} (mean batch "
                    f"{figures['throughput']['batch_mean']:.2f})",
                    flush=True,
                )
    finally:
        for worker in workers.values():
            worker.close()
    return [_row(variant, reps, refused, ready) for variant in args.variants]


def _row(variant: str, reps: dict[str, list[dict]], refused: dict[str, str], ready: dict[str, float]) -> dict:
    row: dict = {"variant": variant, "degrees": VARIANTS[variant]}
    if variant in refused:
        return row | {"refused": refused[variant]}
    mine = reps[variant]
    fields = {
        "latency_p50_ms": ("latency", "p50_ms"),
        "latency_mean_ms": ("latency", "mean_ms"),
        "images_per_s": ("throughput", "images_per_s"),
        "throughput_p50_ms": ("throughput", "p50_ms"),
        "batch_mean": ("throughput", "batch_mean"),
    }
    for name, (phase, field) in fields.items():
        row[name] = round(statistics.median(r[phase][field] for r in mine), 3)
    row["ready_s"] = round(ready[variant], 1)
    if reps.get("one_process") and variant != "one_process":
        ratios = {"latency_over_one": ("latency", "p50_ms"), "images_per_s_over_one": ("throughput", "images_per_s")}
        for name, (phase, field) in ratios.items():
            pairs = zip(mine, reps["one_process"], strict=True)
            row[name] = round(statistics.median(_ratio(m[phase][field], o[phase][field]) for m, o in pairs), 3)
    row["reps"] = mine
    return row


def tables(result: dict) -> str:
    config = result["config"]
    lines = [
        f"Parallel degrees on {config['model_label']}, {config['size']}, {config['steps']} steps, guided (true CFG), "
        f"request mode, max_num_seqs {MAX_NUM_SEQS} ({result['device']}). Latency: one client, "
        f"{config['latency_requests']} requests in turn; throughput: {CLIENTS} closed-loop clients, "
        f"{config['requests']} requests; {config['reps']} reps. Ratios against `one_process`, medians of per-rep "
        "ratios (latency: below 1 is faster; images/s: above 1 is more).",
        "",
        "| variant | degrees | latency p50 ms | latency / one | images/s at N = 4 | images/s / one | mean batch "
        "| ready s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        degrees = ", ".join(f"{k} {v}" for k, v in row["degrees"].items()) or "–"
        if "refused" in row:
            lines.append(f"| {row['variant']} | {degrees} | refused: {row['refused']} | | | | | |")
            continue
        lines.append(
            f"| {row['variant']} | {degrees} | {row['latency_p50_ms']:.0f} | {row.get('latency_over_one', '')} | "
            f"{row['images_per_s']:.3f} | {row.get('images_per_s_over_one', '')} | {row['batch_mean']:.2f} | "
            f"{row['ready_s']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, FAMILIES)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--latency-requests", type=int, default=4, help="requests per rep at concurrency 1")
    parser.add_argument("--requests", type=int, default=16, help="requests per rep at N = 4 (all 4 clients)")
    parser.add_argument("--reps", type=int, default=3, help="runs per variant, interleaved; medians")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    parser.add_argument(
        "--size", default="128x128", help="WxH (above the tiny VAE's 64 px tile, so vae_patch_2 splits)"
    )
    parser.add_argument(
        "--request-wait-ms",
        type=float,
        default=0.0,
        help="request_batch_max_wait_ms (0: a request alone never waits for others, so latency is the call's)",
    )
    parser.add_argument("--dtype", help="the stage's dtype (default: the engine's; ring_2 needs bfloat16 or float16)")
    parser.add_argument("--seed", type=int, default=0, help="request j has seed SEED + j")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="cpu-tiny-parallel")
    parser.add_argument("--quick", action="store_true", help="smoke defaults: 1 + 4 requests, 1 rep, 2 steps")
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(latency_requests=1, requests=4, reps=1, steps=2)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        parser.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.requests < CLIENTS or args.requests % CLIENTS:
        parser.error(f"--requests must be a positive multiple of {CLIENTS} (the closed loop's clients)")
    if args.latency_requests < 1:
        parser.error("--latency-requests must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    model = args.model or cached_model(args.model_dir, args.family)
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "model": model,
            "model_label": f"{args.family} (tiny)" if not args.model else os.path.basename(args.model.rstrip("/")),
            "variants": args.variants,
            "size": args.size,
            "steps": args.steps,
            "dtype": args.dtype,
            "latency_requests": args.latency_requests,
            "requests": args.requests,
            "reps": args.reps,
            "max_num_seqs": MAX_NUM_SEQS,
            "request_batch_max_wait_ms": args.request_wait_ms,
            "seed": args.seed,
            "quick": args.quick,
        },
        "rows": measure(model, args),
    }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
