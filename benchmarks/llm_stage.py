"""The ``llm`` stage (prompt enhancement): what it costs a request, and llm → diffusion against diffusion alone under
load, in one run.

    python benchmarks/llm_stage.py --out-dir benchmarks/results --name cpu-tiny-llm-stage   # the published run
    python benchmarks/llm_stage.py --reps 1 --latency-requests 4 --num-requests 8            # quicker
    python benchmarks/llm_stage.py --family flux-bench --size 256x256 --steps 8 --python-executable ''  # GPU (untested)
    python benchmarks/llm_stage.py [--model DIR] [--llm-model DIR] [--python-executable PY] [--max-tokens 16]
        [--enforce-eager] [--latency-requests 16] [--num-requests 32] [--concurrency 4] [--reps 3] [--warmup 4]
        [--steps 4] [--size 64x64] [--batch-wait-ms 0]

Two deploys of the same diffusion model (tiny random-weight Flux, 64x64, 4 steps, built once into
``--model-dir``, as the tiny Llama is) are started through `AsyncOmni`, both in this process:

- ``flux``: one ``diffusion`` stage, ``max_num_seqs 4`` (``request_batch_max_wait_ms``: ``--batch-wait-ms``);
- ``llm-flux``: an ``llm`` stage (vLLM's engine in a Ray actor, ``max_num_seqs 4``, completion mode, greedy,
  ``--max-tokens`` tokens with ``ignore_eos``) whose text is the prompt of the same ``diffusion`` stage.

On a CPU host the llm stage's actor runs in ``--python-executable`` (default: ``.venv-llm-cpu/bin/python``,
``make llm-cpu-venv``, when it exists; ``''``: the server's own interpreter, as on a GPU host).

Each deploy is warmed up (`AsyncOmni.warm_up`, then ``--warmup`` requests at once), then each rep runs two
phases, each deploy in turn (the order alternates per rep, so a shared machine's drift hits both alike):

- ``latency``: ``--latency-requests`` requests one after the other (concurrency 1): the mean and p50 end-to-end
  latency of each deploy, their difference (the llm stage's cost per request; median over the reps of the
  per-rep difference) and its share of llm-flux's end to end, and the llm stage's own mean queue_ms and exec_ms
  from each output's ``metrics["stages"][0]``;
- ``throughput``: ``--num-requests`` requests in a closed loop of ``--concurrency`` workers: the req/s of each,
  the ratio llm-flux / flux (median of the per-rep ratios) and the llm stage's mean batch (a request's
  ``batch_size`` there is the mean sequences per vLLM step it ran in).

Request i has its own prompt and seed i in every deploy, phase and rep. Figures are medians over the reps (every
rep kept in the JSON); nothing is asserted. The llm actor and the diffusion engine share the machine's cores: on
a small CPU they compete for them. Writes ``<out-dir>/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from common import REPO, Shape, add_model_arguments, publish
from stages import check_lines, closed_loop, deploy_row, requests, summarize_rep
from step_batching import _device, _ratio, cached_model

from vllm_omni import AsyncOmni
from vllm_omni.config import DeployConfig, StageDeployConfig

DEPLOYS = ("flux", "llm-flux")
PHASES = ("latency", "throughput")
DIFFUSION_MAX, LLM_MAX = 4, 4
PROMPT_TEMPLATE = "Describe in detail: {prompt}\n"
LLM_ENGINE_ARGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20}
CPU_VENV_PYTHON = os.path.join(REPO, ".venv-llm-cpu", "bin", "python")


def llm_engine_args(args) -> dict:
    """The llm stage's vLLM engine arguments: `LLM_ENGINE_ARGS`, eager with ``--enforce-eager`` (no torch.compile
    of the model: a replica starts about 20 s sooner on a CPU, and serves slower)."""
    return LLM_ENGINE_ARGS | ({"enforce_eager": True} if args.enforce_eager else {})


def deploy_config(deploy: str, args) -> DeployConfig:
    """The stages of ``deploy`` (one of `DEPLOYS`)."""
    diffusion = {
        "stage_type": "diffusion",
        "max_num_seqs": DIFFUSION_MAX,
        "request_batch_max_wait_ms": args.batch_wait_ms,
    }
    if deploy == "flux":
        return DeployConfig(stages=[StageDeployConfig(stage_id=0, **diffusion)])
    llm = StageDeployConfig(
        stage_id=0,
        stage_type="llm",
        model=args.llm_model,
        python_executable=args.python_executable or None,
        mode="completion",
        prompt_template=PROMPT_TEMPLATE,
        sampling={"temperature": 0, "max_tokens": args.max_tokens, "ignore_eos": True},
        engine_args=llm_engine_args(args),
        max_num_seqs=LLM_MAX,
    )
    return DeployConfig(stages=[llm, StageDeployConfig(stage_id=1, inputs=(0,), **diffusion)])


async def sample(omni: AsyncOmni, prompt: str, params) -> dict:
    """One request's prompt and what the llm stage made of it."""
    [output] = [o async for o in omni.generate(prompt, params)]
    return {"prompt": prompt, "revised_prompt": output.revised_prompt}


async def run_phase(omni: AsyncOmni, work: list, concurrency: int, label: str) -> dict:
    """One rep of one (phase, deploy): `stages.summarize_rep` with the mean e2e, and a progress line."""
    wall, results = await closed_loop(omni, work, concurrency)
    summary = summarize_rep(wall, results) | {"mean_ms": 1000 * statistics.fmean(e2e for e2e, _ in results)}
    stages = "; ".join(
        f"stage {sid}: batch {s['batch_mean']:.2f}, queue/exec {s['queue_ms_mean']:.1f}/{s['exec_ms_mean']:.1f} ms"
        for sid, s in summary["stages"].items()
    )
    line = f"{summary['req_per_s']:.3f} req/s, e2e mean/p50 {summary['mean_ms']:.1f}/{summary['p50_ms']:.1f} ms"
    print(f"{label}: {line}; {stages}", flush=True)
    return summary


async def start(deploy: str, config: DeployConfig, args, warm_up: list, label: str) -> AsyncOmni:
    """``deploy`` started and warmed up: `AsyncOmni.warm_up`, then ``warm_up`` at once."""
    started = time.perf_counter()
    print(f"{label} starting {deploy}", flush=True)
    omni = AsyncOmni(args.model, deploy_config=config)
    await omni.warm_up()
    if warm_up:
        await closed_loop(omni, warm_up, len(warm_up))
    print(f"{label} {deploy} up and warm in {time.perf_counter() - started:.1f} s", flush=True)
    return omni


async def measure(args) -> tuple[list[dict], dict]:
    """Rows per (phase, deploy) as `stages.deploy_row` makes them, with the phase, concurrency and mean e2e."""
    shape = Shape(*(int(v) for v in args.size.split("x")), args.steps)
    label = f"[{shape}]"
    work = {
        "latency": requests(args.latency_requests, shape, args.seed),
        "throughput": requests(args.num_requests, shape, args.seed),
    }
    concurrency = {"latency": 1, "throughput": args.concurrency}
    warm_up = requests(args.warmup, shape, args.seed + max(args.latency_requests, args.num_requests))
    configs = {deploy: deploy_config(deploy, args) for deploy in DEPLOYS}
    omnis: dict[str, AsyncOmni] = {}
    reps: dict[tuple[str, str], list[dict]] = {(p, d): [] for p in PHASES for d in DEPLOYS}
    try:
        for deploy, config in configs.items():
            omnis[deploy] = await start(deploy, config, args, warm_up, label)
        example = await sample(omnis["llm-flux"], *work["latency"][0])
        print(f"{label} llm-flux: {example['prompt']!r} -> {example['revised_prompt']!r}", flush=True)
        for rep in range(args.reps):
            order = DEPLOYS if rep % 2 == 0 else DEPLOYS[::-1]
            for phase, deploy in ((p, d) for p in PHASES for d in order):
                where = f"{label} rep {rep + 1} {phase} {deploy}"
                reps[phase, deploy].append(await run_phase(omnis[deploy], work[phase], concurrency[phase], where))
    finally:
        for omni in omnis.values():
            omni.shutdown()
    rows = []
    for (phase, deploy), mine in reps.items():
        row = deploy_row(args.family, shape, deploy, configs[deploy], mine)
        mean_ms = round(statistics.median(r["mean_ms"] for r in mine), 3)
        rows.append({"phase": phase, "concurrency": concurrency[phase], "mean_ms": mean_ms} | row)
    return rows, example


def llm_summary(rows: list[dict]) -> dict:
    """The llm stage's cost per request (latency phase) and llm-flux against flux under load (throughput phase);
    differences and ratios are medians of the per-rep ones."""
    row = {(r["phase"], r["deploy"]): r for r in rows}
    alone, enhanced = row["latency", "flux"], row["latency", "llm-flux"]
    pairs = list(zip(alone["reps"], enhanced["reps"], strict=True))

    def med(values) -> float:
        return round(statistics.median(values), 3)

    cost_mean = med(e["mean_ms"] - a["mean_ms"] for a, e in pairs)
    llm = enhanced["stages"][0]
    loaded_alone, loaded = row["throughput", "flux"], row["throughput", "llm-flux"]
    return {
        "cost_ms_mean": cost_mean,
        "cost_ms_p50": med(e["p50_ms"] - a["p50_ms"] for a, e in pairs),
        "cost_share_of_e2e": round(cost_mean / enhanced["mean_ms"], 3),
        "llm_queue_ms_mean": llm["queue_ms_mean"],
        "llm_exec_ms_mean": llm["exec_ms_mean"],
        "llm_exec_share_of_e2e": round(llm["exec_ms_mean"] / enhanced["mean_ms"], 3),
        "throughput_ratio": med(
            e["req_per_s"] / a["req_per_s"] for a, e in zip(loaded_alone["reps"], loaded["reps"], strict=True)
        ),
        "throughput_ratio_of_medians": _ratio(loaded["req_per_s"], loaded_alone["req_per_s"]),
        "llm_batch_mean_loaded": loaded["stages"][0]["batch_mean"],
        "llm_batch_max_loaded": loaded["stages"][0]["batch_max"],
    }


def markdown_table(header: list[str], cells: list[list]) -> list[str]:
    """A markdown table's lines: ``header``, then one row per list of ``cells``."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header), *(f"| {' | '.join(map(str, c))} |" for c in cells)]


def tables(result: dict) -> str:
    rows = result["rows"]
    lines = markdown_table(
        [
            "phase",
            "deploy",
            "concurrency",
            "req/s (median)",
            "req/s per rep",
            "e2e mean (ms)",
            "e2e p50 (ms)",
            "e2e p99 (ms)",
        ],
        [
            [r["phase"], r["deploy"], r["concurrency"], f"{r['req_per_s']:.3f}"]
            + [", ".join(f"{rep['req_per_s']:.2f}" for rep in r["reps"])]
            + [f"{r[k]:.1f}" for k in ("mean_ms", "p50_ms", "p99_ms")]
            for r in rows
        ],
    )
    lines.append("")
    lines += markdown_table(
        ["phase", "deploy", "stage", "max_num_seqs", "batch mean / max", "queue ms mean", "exec ms mean"],
        [
            [r["phase"], r["deploy"], f"{s['stage_id']} {s['stage_type']}", s["max_num_seqs"]]
            + [f"{s['batch_mean']:.2f} / {s['batch_max']:g}", f"{s['queue_ms_mean']:.1f}", f"{s['exec_ms_mean']:.1f}"]
            for r in rows
            for s in r["stages"]
        ],
    )
    s, config = result["llm_stage"], result["config"]
    lines += [
        "",
        f"- llm stage's cost per request (llm-flux − flux, concurrency 1): **{s['cost_ms_mean']:.1f} ms** mean, "
        f"{s['cost_ms_p50']:.1f} ms p50; {100 * s['cost_share_of_e2e']:.1f} % of llm-flux's mean end to end",
        f"- llm stage's own (concurrency 1): queue {s['llm_queue_ms_mean']:.1f} ms, "
        f"exec {s['llm_exec_ms_mean']:.1f} ms "
        f"mean ({100 * s['llm_exec_share_of_e2e']:.1f} % of end to end), {config['max_tokens']} tokens",
        f"- throughput at concurrency {config['concurrency']}: llm-flux / flux req/s **{s['throughput_ratio']}x** "
        f"(median of per-rep ratios; of the medians {s['throughput_ratio_of_medians']}x); the llm stage's mean "
        f"batch {s['llm_batch_mean_loaded']:.2f} sequences per vLLM step (largest {s['llm_batch_max_loaded']:g})",
    ]
    lines += [f"- {line}" for line in result["checks"]]
    lines += [
        f"- example: {result['example']['prompt']!r} → {result['example']['revised_prompt']!r}",
        "",
        f"{result['device']}; {config['size']}, {config['steps']} steps, diffusion request_batch_max_wait_ms "
        f"{config['batch_wait_ms']:g}; {config['latency_requests']} sequential "
        f"and {config['num_requests']} closed-loop requests per rep, {config['reps']} reps (deploys interleaved), "
        "medians; largest batch: over all reps. llm batch: a request's mean sequences per vLLM step; exec ms: the "
        "wall time of the request's batch (llm: its time in vLLM's engine).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, ("flux", "flux-bench"))
    parser.add_argument("--llm-model", help="the llm stage's transformers folder (default: build the tiny Llama)")
    parser.add_argument(
        "--python-executable",
        default=CPU_VENV_PYTHON if os.path.exists(CPU_VENV_PYTHON) else "",
        help="interpreter of the llm stage's actor (default: .venv-llm-cpu's when built; '': this one's)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens the llm stage writes per request")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="the llm stage's engine runs eager (vLLM's flag: no compile)"
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=0.0, help="the diffusion stage's request_batch_max_wait_ms (both)"
    )
    parser.add_argument("--latency-requests", type=int, default=16, help="sequential requests per (deploy, rep)")
    parser.add_argument("--num-requests", type=int, default=32, help="closed-loop requests per (deploy, rep)")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop workers of the throughput phase")
    parser.add_argument("--reps", type=int, default=3, help="runs per (phase, deploy), interleaved; medians")
    parser.add_argument("--warmup", type=int, default=4, help="requests at once per deploy before measuring")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per request")
    parser.add_argument("--size", default="64x64", help="WxH")
    parser.add_argument("--seed", type=int, default=0, help="request i has seed SEED + i")
    parser.add_argument("--out-dir", help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="llm-stage")
    args = parser.parse_args(argv)
    if min(args.latency_requests, args.num_requests, args.concurrency, args.reps) < 1:
        parser.error("--latency-requests, --num-requests, --concurrency and --reps must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    args.model = args.model or cached_model(args.model_dir, args.family)
    args.llm_model = args.llm_model or cached_model(args.model_dir, "llm")
    rows, example = asyncio.run(measure(args))
    keys = (
        "family",
        "max_tokens",
        "batch_wait_ms",
        "latency_requests",
        "num_requests",
        "concurrency",
        "reps",
        "warmup",
        "steps",
        "size",
        "seed",
    )
    result = {
        "name": args.name,
        "device": _device(),
        "cpus": os.cpu_count(),
        "config": {k: getattr(args, k) for k in keys}
        | {
            "model": args.model,
            "llm_model": args.llm_model,
            "python_executable": args.python_executable or None,
            "prompt_template": PROMPT_TEMPLATE,
            "llm_engine_args": llm_engine_args(args),
            "max_num_seqs": {"llm": LLM_MAX, "diffusion": DIFFUSION_MAX},
        },
        "rows": rows,
        "llm_stage": llm_summary(rows),
        "checks": check_lines([r for r in rows if r["phase"] == "throughput"], args.concurrency),
        "example": example,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    main()
