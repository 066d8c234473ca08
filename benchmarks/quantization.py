"""Quantization modes against none: the denoiser's parameter bytes, the engine process's peak memory, latency alone
and throughput at 4 in flight, in one run.

    python benchmarks/quantization.py             # the published run: results/cpu-tiny-quantization.{json,md}
    python benchmarks/quantization.py [--model DIR | --family flux-bench] [--modes none,int8,...] [--gpu]
        [--reps 3] [--requests 8] [--steps 8] [--size 128x128] [--quick] [--out-dir DIR] [--name NAME]

Modes: ``none``, ``int8`` (torchao int8 weight-only), ``fp8_storage`` (float8 storage, compute in the stage's
dtype), ``gguf-Q8_0`` / ``gguf-Q4_0`` (the model's transformer written as a GGUF by the ``gguf`` package,
`vllm_omni.testing.models.gguf_files`, served as ``MODEL FILE.gguf --model-config DIR``), and on CUDA only ``fp8``
(torchao float8) and ``nf4`` (bitsandbytes). The default modes are those that run here; ``--gpu`` (what
``gpu_check.py`` runs where CUDA exists) takes all seven on a Flux-sized transformer (`flux_sized`: FLUX.1's 3072
width, 24 heads, one double and two single blocks, random weights, with flux-bench's tiny encoders and VAE), so
that the int8 and fp8 kernels see FLUX.1's matrix shapes.

Each mode is one engine (`AsyncOmni`, ``max_num_seqs 4``, request mode, inline) in a worker process of its own
(`engine_workers`), started and warmed up before any is measured. Per mode: the denoiser's parameter bytes as
stored (`vllm_omni.diffusion.features.quantization.parameter_bytes`: a torchao tensor's data and scales, GGUF's packed
blocks), the worker's peak resident memory (``VmHWM`` from ``/proc``: load, warm-up and every run; on CUDA also the
peak CUDA memory allocated), latency at concurrency 1 (``--requests`` requests one after another) and images/s at
concurrency 4 (4 closed-loop clients, ``--requests`` in all). Each of the ``--reps`` reps runs every mode in turn,
the order alternating per rep; ratios against ``none`` are medians of per-rep ratios. A mode that cannot start
here (``fp8`` or ``nf4`` without CUDA) is reported with the reason it was refused. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import PROMPTS, add_model_arguments, publish
from engine_workers import Worker, start_all
from step_batching import HERE, _device, _ratio, cached_model

MAX_NUM_SEQS = 4
FAMILIES = ("flux", "flux-bench")
MODES: dict[str, dict] = {
    "none": {},
    "int8": {"quantization": "int8"},
    "fp8_storage": {"quantization": "fp8_storage"},
    "gguf-Q8_0": {},  # the model is the GGUF file (`engine_for`)
    "gguf-Q4_0": {},
    "fp8": {"quantization": "fp8"},
    "nf4": {"quantization": "nf4"},
}
"""Each mode's stage knobs on top of the base ones."""
CPU_MODES = ("none", "int8", "fp8_storage", "gguf-Q8_0", "gguf-Q4_0")
GPU_MODES = ("none", "int8", "fp8", "fp8_storage", "nf4", "gguf-Q8_0", "gguf-Q4_0")


def flux_sized(model_dir: str) -> str:
    """flux-bench's pipeline with a transformer of FLUX.1's width (3072 = 24 heads x 128; 1 double and 2 single
    blocks, random weights), built once under ``model_dir``."""
    path = os.path.abspath(os.path.join(model_dir, "flux-sized"))
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    import shutil

    import torch
    from diffusers import FluxTransformer2DModel

    base = cached_model(model_dir, "flux-bench")
    scratch = f"{path}.partial-{os.getpid()}"
    shutil.copytree(base, scratch, ignore=shutil.ignore_patterns("transformer"))
    torch.manual_seed(0)
    FluxTransformer2DModel(
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=32,  # flux-bench's tiny T5
        pooled_projection_dim=32,  # and CLIP
        axes_dims_rope=[16, 56, 56],
    ).save_pretrained(os.path.join(scratch, "transformer"))
    os.rename(scratch, path)
    return path


def gguf_file(model: str, qtype: str) -> str:
    """``model``'s transformer as a ``qtype`` GGUF beside it (written once)."""
    from vllm_omni.diffusion.pipeline.runner import read_model_index
    from vllm_omni.testing.models.gguf_files import write_gguf

    layouts = {"FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd3", "WanTransformer3DModel": "wan"}
    path = f"{model.rstrip('/')}-{qtype}.gguf"
    if not os.path.isfile(path):
        layout = layouts[read_model_index(model)["transformer"][1]]
        write_gguf(model, layout, f"{path}.partial-{os.getpid()}", qtype)
        os.rename(f"{path}.partial-{os.getpid()}", path)
    return path


def engine_for(mode: str, model: str, args) -> tuple[str, dict]:
    """The model to start and the engine's keywords for ``mode``."""
    knobs = dict(
        max_num_seqs=MAX_NUM_SEQS,
        execution_mode="request",
        request_batch_max_wait_ms=args.request_wait_ms,
        distributed_executor_backend="inline",
        **MODES[mode],
    )
    if mode.startswith("gguf-"):
        return gguf_file(model, mode.removeprefix("gguf-")), knobs | {"model_config": model}
    return model, knobs


def any_width() -> None:
    """Worker set-up: diffusers' Flux converter splits at the config's width (the tiny models are narrower than
    FLUX.1; `vllm_omni.testing.models.single_file`), for the process's life."""
    from vllm_omni.testing.models.single_file import flux_converter_for_any_width

    global _ANY_WIDTH
    _ANY_WIDTH = flux_converter_for_any_width()  # held: a collected context manager would undo the patch
    _ANY_WIDTH.__enter__()


_ANY_WIDTH = None


def denoiser_memory(omni, model: str) -> dict:
    """The denoiser's parameter bytes as stored, how the stage holds it, and the CUDA peak so far."""
    import torch

    from vllm_omni.diffusion.features.quantization import parameter_bytes
    from vllm_omni.diffusion.pipeline.components import loaded_denoisers

    runner = omni.engine.stages[0].replicas[0].engine.runner
    denoisers = [getattr(runner.pipeline, name) for name in loaded_denoisers(runner.pipeline)]
    return {
        "denoiser_bytes": sum(parameter_bytes(d) for d in denoisers),
        "quantized": runner.quantization.describe(),
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
    }


def cuda_peak(omni, variant: str) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (``VmHWM``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def workload(count: int, clients: int, args, seed: int) -> list[list[tuple[str, dict]]]:
    """Per client, its requests: request j goes to client j mod ``clients``."""
    width, height = (int(v) for v in args.size.split("x"))
    work: list[list[tuple[str, dict]]] = [[] for _ in range(clients)]
    for j in range(count):
        params = dict(height=height, width=width, num_inference_steps=args.steps, seed=seed + j)
        work[j % clients].append((f"{PROMPTS[j % len(PROMPTS)]}, take {j}", params))
    return work


def measure(model: str, args) -> list[dict]:
    workers = {m: Worker(f"quant-{m}", report=cuda_peak, describe=denoiser_memory, setup=any_width) for m in args.modes}
    runs: dict[str, list[tuple[dict, dict]]] = {m: [] for m in args.modes}
    rss: dict[str, int | None] = {}
    try:
        ready, refused = start_all(workers, {m: engine_for(m, model, args) for m in workers})
        for mode in workers:
            seconds, memory = ready[mode]
            print(f"{mode}: up in {seconds:.1f} s; denoiser {memory['denoiser_bytes'] / 2**20:.2f} MiB", flush=True)
        for worker in workers.values():  # the batch shapes of the loop, once
            worker.run("warm-up", workload(MAX_NUM_SEQS, MAX_NUM_SEQS, args, args.seed + 10_000))
        alone, together = workload(args.requests, 1, args, args.seed), workload(args.requests, 4, args, args.seed)
        order = list(workers)
        for rep in range(args.reps):
            for mode in order if rep % 2 == 0 else order[::-1]:
                pair = workers[mode].run(mode, alone), workers[mode].run(mode, together)
                runs[mode].append(pair)
                print(
                    f"rep {rep + 1} {mode}: alone p50 {pair[0]['p50_ms']:.0f} ms, 4 in flight "
                    f"{pair[1]['images_per_s']:.3f} images/s (mean batch {pair[1]['batch_mean']:.2f})",
                    flush=True,
                )
        rss = {mode: peak_rss_bytes(worker.process.pid) for mode, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    rows = []
    for mode in args.modes:
        row: dict = {"mode": mode, "knobs": MODES[mode], "model": engine_for(mode, model, args)[0]}
        if mode in refused:
            rows.append(row | {"refused": refused[mode]})
            continue
        seconds, memory = ready[mode]
        mine = runs[mode]
        cuda = memory["cuda_peak_bytes"] + sum(a["report"] + b["report"] for a, b in mine)
        row |= {
            "denoiser_mib": round(memory["denoiser_bytes"] / 2**20, 3),
            "quantized": memory["quantized"],
            "peak_rss_mib": None if rss.get(mode) is None else round(rss[mode] / 2**20, 1),
            "cuda_peak_mib": round(cuda / 2**20, 1) if cuda else None,
            "p50_ms_alone": round(statistics.median(a["p50_ms"] for a, _ in mine), 1),
            "images_per_s_4": round(statistics.median(b["images_per_s"] for _, b in mine), 3),
            "batch_mean_4": round(statistics.median(b["batch_mean"] for _, b in mine), 2),
            "ready_s": round(seconds, 1),
        }
        if "none" in ready and mode != "none":
            base_memory, base_runs = ready["none"][1], runs["none"]
            row["denoiser_over_none"] = _ratio(memory["denoiser_bytes"], base_memory["denoiser_bytes"])
            row["p50_alone_over_none"] = statistics.median(
                _ratio(a["p50_ms"], n["p50_ms"]) for (a, _), (n, _) in zip(mine, base_runs, strict=True)
            )
            row["images_per_s_4_over_none"] = statistics.median(
                _ratio(b["images_per_s"], n["images_per_s"]) for (_, b), (_, n) in zip(mine, base_runs, strict=True)
            )
        row["reps"] = [{"alone": a, "four": b} for a, b in mine]
        rows.append(row)
    return rows


def table(result: dict) -> str:
    config = result["config"]
    lines = [
        f"Quantization on {config['model_label']}, {config['size']}, {config['steps']} steps, max_num_seqs "
        f"{MAX_NUM_SEQS}, {config['requests']} requests alone and 4 in flight x {config['reps']} reps "
        f"({result['device']}). Ratios against `none`, medians of per-rep ratios.",
        "",
        "| mode | denoiser MiB | / none | peak RSS MiB | CUDA peak MiB | p50 alone ms | / none | images/s at 4 "
        "| / none | stage holds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if "refused" in row:
            lines.append(f"| {row['mode']} | refused: {row['refused']} | | | | | | | | |")
            continue
        lines.append(
            f"| {row['mode']} | {row['denoiser_mib']} | {row.get('denoiser_over_none', '')} | {row['peak_rss_mib']} "
            f"| {row['cuda_peak_mib'] or ''} | {row['p50_ms_alone']:.0f} | {row.get('p50_alone_over_none', '')} "
            f"| {row['images_per_s_4']:.3f} | {row.get('images_per_s_4_over_none', '')} | {row['quantized']} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, FAMILIES)
    parser.set_defaults(family="flux-bench")
    parser.add_argument("--modes", default=None, help=f"comma-separated, from: {', '.join(MODES)}")
    parser.add_argument(
        "--gpu", action="store_true", help="all modes, on the Flux-sized transformer (gpu_check.py's part)"
    )
    parser.add_argument("--requests", type=int, default=8, help="requests alone, and at 4 in flight, per rep")
    parser.add_argument("--reps", type=int, default=3, help="runs per mode, interleaved; medians")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps per request")
    parser.add_argument("--size", default="128x128", help="WxH")
    parser.add_argument("--request-wait-ms", type=float, default=50.0, help="request_batch_max_wait_ms")
    parser.add_argument("--seed", type=int, default=0, help="request j has seed SEED + j")
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default=None, help="default: cpu-tiny-quantization, or gpu-quantization (--gpu)")
    parser.add_argument("--quick", action="store_true", help="smoke defaults: 4 requests, 1 rep, 2 steps, 64x64")
    if parser.parse_known_args(argv)[0].quick:  # only changes defaults: explicit options still win
        parser.set_defaults(requests=4, reps=1, steps=2, size="64x64")
    args = parser.parse_args(argv)
    args.modes = [m for m in (args.modes or ",".join(GPU_MODES if args.gpu else CPU_MODES)).split(",") if m]
    args.name = args.name or ("gpu-quantization" if args.gpu else "cpu-tiny-quantization")
    if unknown := [m for m in args.modes if m not in MODES]:
        parser.error(f"unknown --modes {unknown}; choose from {', '.join(MODES)}")
    if args.requests < 4 or args.requests % 4:
        parser.error("--requests must be a positive multiple of 4 (the clients at concurrency 4)")
    if args.gpu and args.model:
        parser.error("--gpu builds its Flux-sized model; give --model without --gpu (and --modes for the GPU modes)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    model = args.model or (flux_sized(args.model_dir) if args.gpu else cached_model(args.model_dir, args.family))
    label = "Flux-sized transformer (3072 wide)" if args.gpu else f"{args.family} (tiny)"
    rows = measure(model, args)
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {
            "model": model,
            "model_label": os.path.basename(args.model.rstrip("/")) if args.model else label,
            "modes": args.modes,
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
    publish(result, table(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
