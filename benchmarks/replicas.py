"""Scale-out: served throughput of 1 vs 2 Ray replicas (one CPU each), and where the CPU goes.

    python benchmarks/replicas.py [--model DIR] [--shapes 64x64:4,64x64:20] [--configs 1,2]
        [--num-requests 48] [--concurrency 8] [--max-num-seqs 2] [--reps 3] [--idle-s 5]
        [--baseline DIR] [--out-dir benchmarks/results] [--name cpu-tiny-replicas]

Each configuration (``--configs``: a number of Ray replicas with one CPU and one
torch thread each, or ``inline``: the engine on a thread of the server, torch's
default threads) is a real ``vllm serve MODEL --omni`` server, started in turn.
After a warm-up of every replica it measures

- **Ray's idle CPU**: the CPU time of every process of the server's tree
  (server, GCS, raylet, Ray's other processes, the replica actors) over
  ``--idle-s`` seconds with nothing served, in % of one core;
- ``--reps`` times, for each shape, ``--num-requests`` requests from
  ``--concurrency`` closed-loop HTTP clients (bench_serving, no ``/metrics``
  scraping inside the window): requests/s, and the **CPU seconds per
  completed request** of each process group over exactly that window: the
  load generator (this process), the server, Ray's GCS, the raylet, Ray's other
  processes (dashboard, agents, monitors, idle workers) and the actors; plus the
  whole machine's busy CPU, whose excess over those is other people's work;
- the per-request **overhead**: at concurrency 1, the client's latency minus the
  queue wait and execution time the server reports.

The processes are those of the server's process tree, plus any process whose
command line names this server's Ray session (none so far: Ray keeps them all
under the server). The tables show the median req/s of the reps and the CPU
summed over all reps ÷ all completed requests; the 2/1 replica ratio is checked
against the targets (≥ 1.6× at 4 steps, ≥ 1.8× at 20 steps), never an exit code.

``--baseline DIR`` starts every configuration a second time with the server and
its Ray actors importing vllm_omni from the checkout DIR (``PYTHONPATH`` and the
working directory set to DIR; the current code gets its own checkout the same
way, except that its inline server is a preloaded one where the caller asked for
those, the tests), alternating which goes first, and reports both side by side with the
ratio. Where the server and each actor took vllm_omni from is checked with
``py-spy dump`` (when installed) and recorded.

    python benchmarks/replicas.py --baseline /tmp/before --out-dir benchmarks/results --name cpu-tiny-replicas
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time

import psutil
from bench_serving import run_benchmark
from common import REPO, Shape, check_tree, imported_from, imports_ok, in_tree, publish, runs_tree

from vllm_omni.testing.processes.server import RemoteOmniServer

TARGETS = {4: 1.6, 20: 1.8}
"""2 Ray replicas / 1 Ray replica throughput the issue asks for on this 2-core machine, by denoising steps."""
GROUPS = ("load_generator", "server", "ray_gcs", "raylet", "ray_other", "actors", "server_other")


def _group(process: psutil.Process, server_pid: int) -> str:
    if process.pid == server_pid:
        return "server"
    name, cmdline = process.name(), " ".join(process.cmdline())
    if name == "gcs_server" or "gcs_server" in cmdline.split(" ", 1)[0]:
        return "ray_gcs"
    if name == "raylet" or cmdline.split(" ", 1)[0].endswith("/raylet"):
        return "raylet"
    if cmdline.startswith("ray::_ReplicaActor"):
        return "actors"
    if cmdline.startswith("ray::") or "/ray/" in cmdline or "session_" in cmdline:
        return "ray_other"
    return "server_other"


class CpuProbe:
    """CPU seconds of every process of a server's tree (and of its Ray session), by group, between two snapshots."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid
        self.me = psutil.Process()
        self.session: str | None = None
        self.seen: dict[int, psutil.Process] = {}

    def processes(self) -> dict[int, tuple[str, psutil.Process]]:
        root = psutil.Process(self.server_pid)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
        if self.session is None:
            for p in found.values():
                with _gone():
                    if marks := [a for a in p.cmdline() if "/session_" in a]:
                        self.session = marks[0].split("/session_")[1].split("/")[0]
                        break
        if self.session:  # a process of this Ray session that Ray moved out of the tree
            for p in psutil.process_iter(["cmdline"]):
                if p.pid not in found and any(self.session in a for a in p.info["cmdline"] or ()):
                    found[p.pid] = p
        self.seen.update(found)
        groups = {}
        for pid, p in found.items():
            with _gone():
                groups[pid] = (_group(p, self.server_pid), p)
        return groups

    def snapshot(self) -> dict:
        cpu: dict[int, tuple[str, float]] = {}
        for pid, (group, p) in self.processes().items():
            with _gone():
                t = p.cpu_times()
                cpu[pid] = (group, t.user + t.system)
        everyone = {}  # every process of the machine, to name where the CPU outside ours went
        for p in psutil.process_iter(["cpu_times", "cmdline", "name"]):
            if p.pid not in cpu and p.pid != self.me.pid and p.info["cpu_times"] is not None:
                t = p.info["cpu_times"]
                name = " ".join(p.info["cmdline"] or []) or p.info["name"] or "?"
                everyone[p.pid] = (name[:120], t.user + t.system)
        t = self.me.cpu_times()
        machine = psutil.cpu_times()
        busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
        return {"at": time.perf_counter(), "cpu": cpu, "me": t.user + t.system, "machine": busy, "others": everyone}

    @staticmethod
    def delta(start: dict, end: dict) -> dict:
        """CPU seconds by group between the snapshots (a process that ended in between is missed), the machine's
        busy CPU seconds, and the wall time."""
        groups = dict.fromkeys(GROUPS, 0.0)
        groups["load_generator"] = end["me"] - start["me"]
        for pid, (group, seconds) in end["cpu"].items():
            groups[group] += seconds - start["cpu"].get(pid, (group, 0.0))[1]
        others = {}
        for pid, (name, seconds) in end["others"].items():
            if (used := seconds - start["others"].get(pid, (name, 0.0))[1]) > 0:
                others[f"{pid} {name}"] = used
        return {
            "groups": groups,
            "total": sum(groups.values()),
            "machine": end["machine"] - start["machine"],
            "wall": end["at"] - start["at"],
            "others": others,
        }


class _gone:
    """Skip a process that ended (or that this user may not read) meanwhile."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        return kind is not None and issubclass(kind, (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError))


def _server_args(config: str, args, shapes: list[Shape]) -> list[str]:
    ray = [] if config == "inline" else ["--distributed-executor-backend", "ray", "--num-cpus", "1"]
    replicas = [] if config == "inline" else ["--num-replicas", config]
    return [
        *replicas,
        *ray,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-waiting-requests",
        str(max(64, args.num_requests)),
        "--max-image-pixels",
        str(max(s.width * s.height for s in shapes)),
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]


def _check_imports(server: RemoteOmniServer, probe: CpuProbe, tree: str) -> dict:
    """Where the server and its actors took vllm_omni from; raises if it is not ``tree``."""
    seen = {"tree": tree, "server": imported_from(server.process.pid)}
    actors = [p for _, (group, p) in probe.processes().items() if group == "actors"]
    seen["actors"] = [imported_from(p.pid) for p in actors]
    verdicts = [imports_ok(s, tree) for s in [seen["server"], *seen["actors"]]]
    seen["ok"] = None if None in verdicts else all(verdicts)
    if False in verdicts:
        raise RuntimeError(f"a process of the server does not run {tree}: {seen}")
    return seen


def _stop(server: RemoteOmniServer, probe: CpuProbe) -> None:
    """Stop the server; end any process of its tree (Ray's) that outlives it by 15 s. Only ever our own."""
    server.stop()
    deadline = time.monotonic() + 15
    left = [p for p in probe.seen.values() if p.pid != server.process.pid]
    while left and time.monotonic() < deadline:
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
    for p in left:
        with _gone():
            p.send_signal(signal.SIGKILL)


def run_config(model: str, config: str, label: str, tree: str, args, shapes: list[Shape]) -> dict:
    log = os.path.join(args.log_dir, f"server-{label}-{config}.log")
    # The current code's inline server is a preloaded one where the caller asked for those (the tests) and this process
    # runs its checkout. Else a real `vllm serve` process, whose command `in_tree` rewrites to run the checkout
    # ``tree``: a baseline's (another checkout's, even when it is this one) and every Ray server (its actors take the
    # server's working directory and environment, which a preloaded server has from its caller).
    preload = label == "current" and config == "inline" and runs_tree(tree)
    server = RemoteOmniServer(
        model, _server_args(config, args, shapes), log_path=log, startup_timeout_s=600, cli=not preload
    )
    if not server.preloaded:
        server.command = in_tree(server.command, tree)
    started = time.perf_counter()
    server.__enter__()
    probe = CpuProbe(server.process.pid)
    try:
        startup_s = time.perf_counter() - started
        imports = _check_imports(server, probe, tree)
        print(f"{label} {config}: up in {startup_s:.1f} s, imports {imports}", flush=True)
        for shape in shapes:  # every replica loads its kernels for every shape
            asyncio.run(
                run_benchmark(
                    server.base_url,
                    shapes=[shape],
                    num_requests=2 * args.concurrency,
                    concurrency=args.concurrency,
                    warmup=0,
                    progress=False,
                    rss_interval_s=None,
                )
            )
        time.sleep(1.0)
        start = probe.snapshot()
        time.sleep(args.idle_s)
        idle = CpuProbe.delta(start, probe.snapshot())
        idle_cores = {g: round(100 * s / idle["wall"], 1) for g, s in idle["groups"].items()}
        idle_cores["machine"] = round(100 * idle["machine"] / idle["wall"], 1)
        ray_idle = sum(idle_cores[g] for g in ("ray_gcs", "raylet", "ray_other", "actors"))
        per_shape = {str(s): {"req_per_s": [], "cpu": [], "completed": 0, "served_by": {}} for s in shapes}
        for rep in range(args.reps):
            for shape in shapes:
                window: dict = {}

                def on_window(edge: str, window=window) -> None:
                    window[edge] = probe.snapshot()

                run = asyncio.run(
                    run_benchmark(
                        server.base_url,
                        shapes=[shape],
                        num_requests=args.num_requests,
                        concurrency=args.concurrency,
                        warmup=0,
                        seed=rep * 10_000,
                        progress=False,
                        rss_interval_s=None,
                        on_window=on_window,
                    )
                )
                if run["failed"]:
                    raise RuntimeError(f"{run['failed']} requests failed ({label} {config} {shape}): {run['errors']}")
                mine = per_shape[str(shape)]
                mine["req_per_s"].append(run["requests_per_s"])
                mine["cpu"].append(CpuProbe.delta(window["start"], window["end"]))
                mine["completed"] += run["completed"]
                for replica, n in run["server"]["requests_by_replica"].items():
                    mine["served_by"][replica] = mine["served_by"].get(replica, 0) + n
        over = asyncio.run(
            run_benchmark(
                server.base_url,
                shapes=shapes[:1],
                num_requests=args.overhead_requests,
                concurrency=1,
                warmup=0,
                progress=False,
                rss_interval_s=None,
            )
        )
        view = over["server"]
        overhead_ms = 1000 * over["latency_mean_s"] - (view["mean_queue_wait_ms"] or 0) - view["mean_batch_exec_ms"]
    finally:
        _stop(server, probe)
    rows = []
    for shape in shapes:
        mine = per_shape[str(shape)]
        completed = mine["completed"]
        groups = {g: sum(c["groups"][g] for c in mine["cpu"]) for g in GROUPS}
        total, machine = sum(groups.values()), sum(c["machine"] for c in mine["cpu"])
        wall = sum(c["wall"] for c in mine["cpu"])
        others: dict[str, float] = {}
        for c in mine["cpu"]:
            for name, seconds in c["others"].items():
                others[name] = others.get(name, 0.0) + seconds
        top = sorted(others.items(), key=lambda item: -item[1])[:5]
        rows.append(
            {
                "variant": label,
                "config": config,
                "backend": "inline" if config == "inline" else "ray",
                "replicas": 1 if config == "inline" else int(config),
                "shape": str(shape),
                "req_per_s": round(statistics.median(mine["req_per_s"]), 3),
                "req_per_s_reps": mine["req_per_s"],
                "served_by": mine["served_by"],
                "cpu_ms_per_request": {g: round(1000 * s / completed, 2) for g, s in groups.items()},
                "cpu_ms_per_request_total": round(1000 * total / completed, 2),
                "machine_cpu_ms_per_request": round(1000 * machine / completed, 2),
                "other_cpu_ms_per_request": round(1000 * (machine - total) / completed, 2),
                "other_processes_cpu_ms_per_request": {name: round(1000 * s / completed, 2) for name, s in top},
                # If this server had the machine to itself and kept every core busy, at this CPU per request:
                "cpu_bound_req_per_s": round(os.cpu_count() * completed / total, 2),
                "cores_busy_ours": round(total / wall, 2),
                "cores_busy_machine": round(machine / wall, 2),
                "idle_pct_of_core": idle_cores,
                "ray_idle_pct_of_core": round(ray_idle, 1),
                "overhead_ms": round(overhead_ms, 2),
                "startup_s": round(startup_s, 1),
                "imports": imports,
            }
        )
    return {"rows": rows}


def speedups(rows: list[dict], configs: list[str]) -> list[dict]:
    """2 Ray replicas / 1 Ray replica per variant and shape, against the target for its steps."""
    out = []
    if not {"1", "2"} <= set(configs):
        return out
    by = {(r["variant"], r["config"], r["shape"]): r for r in rows}
    for variant, _, shape in [k for k in by if k[1] == "1"]:  # rows come sorted by shape, config, variant
        one, two = by[(variant, "1", shape)], by[(variant, "2", shape)]
        ratio = two["req_per_s"] / one["req_per_s"]
        target = TARGETS.get(Shape.parse(shape).steps)
        out.append(
            {
                "variant": variant,
                "shape": shape,
                "speedup": round(ratio, 2),
                # The most 2 replicas could give on this machine at their CPU per request, over 1 replica as measured.
                "cpu_bound_speedup": round(two["cpu_bound_req_per_s"] / one["req_per_s"], 2),
                "target": target,
                "pass": None if target is None else ratio >= target,
            }
        )
    return out


def _cell(value) -> str:
    return "—" if value is None else str(value)


def tables(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "| shape | config | code | req/s (median) | req/s per rep | served by replica | overhead ms (c=1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['config']} | {r['variant']} | {r['req_per_s']} "
            f"| {', '.join(map(str, r['req_per_s_reps']))} | {r['served_by']} | {r['overhead_ms']} |"
        )
    lines += [
        "",
        "CPU ms per completed request, by process group (all reps), and the whole machine's:",
        "",
        "| shape | config | code | load generator | server | Ray GCS | raylet | Ray other | actors | total (ours) "
        "| machine | others | cores busy ours / machine |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["cpu_ms_per_request"]
        groups = " | ".join(str(c[g]) for g in ("load_generator", "server", "ray_gcs", "raylet", "ray_other", "actors"))
        lines.append(
            f"| {r['shape']} | {r['config']} | {r['variant']} | {groups} | **{r['cpu_ms_per_request_total']}** "
            f"| {r['machine_cpu_ms_per_request']} | {r['other_cpu_ms_per_request']} "
            f"| {r['cores_busy_ours']} / {r['cores_busy_machine']} |"
        )
    busy = [r for r in rows if r["cores_busy_machine"] - r["cores_busy_ours"] >= 0.1]
    if busy:
        lines += ["", "**The machine was not quiet**: other processes used CPU during the measured windows:", ""]
        for r in busy:
            name, ms = next(iter(r["other_processes_cpu_ms_per_request"].items()), ("?", 0))
            lines.append(
                f"- {r['shape']} {r['config']} {r['variant']}: "
                f"{r['cores_busy_machine'] - r['cores_busy_ours']:.2f} cores, most of it `{name}` ({ms} ms/request)"
            )
    lines += [
        "",
        f"Idle CPU over {result['idle_s']} s with nothing served, % of one core:",
        "",
        "| config | code | server | Ray GCS | raylet | Ray other | actors | all Ray processes | whole machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["shape"] != rows[0]["shape"]:
            continue
        i = r["idle_pct_of_core"]
        lines.append(
            f"| {r['config']} | {r['variant']} | {i['server']} | {i['ray_gcs']} | {i['raylet']} | {i['ray_other']} "
            f"| {i['actors']} | **{r['ray_idle_pct_of_core']}** | {i['machine']} |"
        )
    if result["speedups"]:
        lines += [
            "",
            "| shape | code | 2 Ray replicas / 1 | target | | CPU bound: all cores ÷ 2-replica CPU per request, "
            "over 1 replica's req/s |",
            "|---|---|---|---|---|---|",
        ]
        for s in result["speedups"]:
            verdict = "—" if s["pass"] is None else ("PASS" if s["pass"] else "FAIL")
            lines.append(
                f"| {s['shape']} | {s['variant']} | **{s['speedup']}x** | {_cell(s['target'])} | {verdict} "
                f"| {s['cpu_bound_speedup']}x |"
            )
    if result.get("comparison"):
        lines += [
            "",
            "Current ÷ baseline:",
            "",
            "| shape | config | req/s | total CPU ms/request | server CPU ms/request | actors CPU ms/request |",
            "|---|---|---|---|---|---|",
        ]
        for c in result["comparison"]:
            lines.append(
                f"| {c['shape']} | {c['config']} | {c['req_per_s']} | {c['cpu_total']} | {c['cpu_server']} "
                f"| {c['cpu_actors']} |"
            )
    return "\n".join(lines) + "\n"


def compare(rows: list[dict]) -> list[dict]:
    by = {(r["variant"], r["config"], r["shape"]): r for r in rows}
    out = []
    for (variant, config, shape), r in by.items():
        b = by.get(("baseline", config, shape))
        if variant != "current" or b is None:
            continue

        def ratio(x: float, y: float) -> float | None:
            return round(x / y, 3) if y else None

        out.append(
            {
                "shape": shape,
                "config": config,
                "req_per_s": ratio(r["req_per_s"], b["req_per_s"]),
                "cpu_total": ratio(r["cpu_ms_per_request_total"], b["cpu_ms_per_request_total"]),
                "cpu_server": ratio(r["cpu_ms_per_request"]["server"], b["cpu_ms_per_request"]["server"]),
                "cpu_actors": ratio(r["cpu_ms_per_request"]["actors"], b["cpu_ms_per_request"]["actors"]),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="diffusers folder (default: the tiny Flux built into --model-dir)")
    parser.add_argument("--model-dir", default=os.path.join(REPO, ".tiny-models"))
    parser.add_argument("--shapes", default="64x64:4,64x64:20", help="comma-separated WxH:STEPS")
    parser.add_argument("--configs", default="1,2", help="comma-separated: Ray replica counts, or inline")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=2, help="per replica")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=5.0, help="how long idle CPU is measured")
    parser.add_argument("--overhead-requests", type=int, default=20)
    parser.add_argument("--baseline", help="checkout whose vllm_omni every configuration also runs with")
    parser.add_argument("--out-dir", help="write NAME.json and NAME.md here")
    parser.add_argument("--name", default="replicas")
    args = parser.parse_args(argv)
    shapes = [Shape.parse(s) for s in args.shapes.split(",")]
    configs = args.configs.split(",")
    trees = [("current", check_tree(REPO))] + ([("baseline", check_tree(args.baseline))] if args.baseline else [])

    from step_batching import cached_model

    model = os.path.abspath(args.model) if args.model else cached_model(args.model_dir, "flux")
    rows = []
    with tempfile.TemporaryDirectory(prefix="replicas-") as args.log_dir:
        for i, config in enumerate(configs):
            for label, tree in trees if i % 2 == 0 else trees[::-1]:  # who goes first alternates
                rows += run_config(model, config, label, tree, args, shapes)["rows"]
    order = {label: i for i, (label, _) in enumerate(trees)}
    rows.sort(key=lambda r: (r["shape"], configs.index(r["config"]), order[r["variant"]]))
    result = {
        "shapes": args.shapes,
        "configs": configs,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "max_num_seqs_per_replica": args.max_num_seqs,
        "reps": args.reps,
        "idle_s": args.idle_s,
        "cpus": os.cpu_count(),
        "trees": dict(trees),
        "rows": rows,
        "speedups": speedups(rows, configs),
        "comparison": compare(rows),
    }
    publish(result, tables(result), args.out_dir, args.name)


if __name__ == "__main__":
    # SIGTERM (e.g. `kill PID` of a run started with nohup, which ignores SIGINT) stops the servers and workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
