"""Engines in worker processes of their own, driven from the benchmark's main process over a pipe, and the closed
loop they are measured with.

Every thread that runs torch ops on the CPU brings its own OpenMP team, and a process holding more OpenMP threads
than cores slows every forward (docs/performance.md). So each engine under comparison runs in a worker process of
its own, whose one engine thread does all its torch work and whose main thread runs none. Workers are forked from
the forkserver that has imported the stack once (`preloaded_context`; it runs no torch op, so a fork starts with no
OpenMP team), not spawned: spawned, each imported it again (the six-variant smoke run took 48 s, forked 25 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm_omni import AsyncOmni, OmniDiffusionSamplingParams
from vllm_omni.testing.processes.server import preloaded_context

WORKERS = preloaded_context()

Clients = list[list[tuple[str, dict]]]
"""Per client, its requests in order: (prompt, sampling params as keywords)."""


async def closed_loop(omni: AsyncOmni, clients: Clients) -> dict:
    """Each client sends its requests one after the other; one rep's figures."""

    async def client(work: list[tuple[str, dict]]) -> list[tuple[float, int, float]]:
        done = []
        for prompt, params in work:
            started = time.perf_counter()
            outputs = [o async for o in omni.generate(prompt, OmniDiffusionSamplingParams(**params))]
            if len(outputs) != 1:
                raise RuntimeError(f"{prompt!r} ended with {len(outputs)} outputs (aborted?)")
            output = outputs[0]
            done.append(
                (time.perf_counter() - started, len(output.images) + len(output.videos), output.metrics.batch_size)
            )
        return done

    started = time.perf_counter()
    per_client = await asyncio.gather(*(client(work) for work in clients))
    wall = time.perf_counter() - started
    results = [r for done in per_client for r in done]
    latencies = [e2e for e2e, _, _ in results]
    return {
        "req_per_s": len(results) / wall,
        "images_per_s": sum(images for _, images, _ in results) / wall,
        "p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "p90_ms": 1000 * float(np.percentile(latencies, 90)),
        "mean_ms": 1000 * statistics.fmean(latencies),
        "batch_mean": statistics.fmean(batch for _, _, batch in results),
        "wall_s": wall,
    }


Hook = Callable[[AsyncOmni, str], Any]
"""A picklable (module-level) function of the worker's engine and the variant to run: `Worker`'s ``prepare`` is
called before each run, its ``report`` before and after, and the run's figures gain ``report``'s difference."""


def serve(
    conn, prepare: Hook | None, report: Hook | None, describe: Hook | None = None, setup: Callable | None = None
) -> None:
    """A worker: waits for ``(model, engine knobs)`` (``None``: exit), calls ``setup()`` (what the engine's load
    needs in this process), starts its `AsyncOmni` and warms it up (answering with the seconds that took, and with
    ``describe``: ``(seconds, describe(omni, model))``), then runs ``(variant, clients)`` commands until ``None``,
    answering each with its figures (or the traceback that failed it)."""
    omni = None
    try:
        if (config := conn.recv()) is None:
            return
        model, engine = config
        if setup is not None:
            setup()
        started = time.perf_counter()
        omni = AsyncOmni(model, **engine)
        asyncio.run(omni.warm_up())
        ready = time.perf_counter() - started
        conn.send(("ready", ready if describe is None else (ready, describe(omni, model))))
        while (command := conn.recv()) is not None:
            variant, clients = command
            if prepare is not None:
                prepare(omni, variant)
            before = report(omni, variant) if report is not None else None
            figures = asyncio.run(closed_loop(omni, clients))
            if report is not None:
                figures["report"] = report(omni, variant) - before
            conn.send(("done", figures))
    except BaseException:  # noqa: BLE001 - the main process raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        if omni is not None:
            omni.shutdown()


class PipeWorker:
    """A process forked from `WORKERS` (whose preload imported the stack) that the benchmark talks to over a pipe:
    it answers each command with ``("done", value)`` or ``("error", traceback)``, and exits on ``None``."""

    def __init__(self, name: str, target: Callable, args: tuple, daemon: bool = True, join_s: float = 60):
        """``daemon=False`` for a process that starts processes of its own (a stage of several ranks): a daemonic
        process may not; such a worker still exits with the benchmark, when its pipe closes. ``join_s``: how long
        `close` waits for it to stop on its own (an engine that frees a GPU takes longer)."""
        self.name, self.join_s = name, join_s
        self.conn, theirs = WORKERS.Pipe()
        self.process = WORKERS.Process(target=target, args=(theirs, *args), name=f"bench-{name}", daemon=daemon)
        self.process.start()
        theirs.close()

    def answer(self):
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"worker {self.name} exited (code {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"worker {self.name} failed:\n{value}")
        return value

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(self.join_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


class Worker(PipeWorker):
    """A worker process running `serve`, then `start`-ed with its engine's knobs."""

    def __init__(
        self,
        name: str,
        prepare: Hook | None = None,
        report: Hook | None = None,
        describe: Hook | None = None,
        setup: Callable | None = None,
        daemon: bool = True,
    ):
        super().__init__(name, serve, (prepare, report, describe, setup), daemon=daemon)

    def start(self, model: str, engine: dict) -> None:
        self.conn.send((model, engine))

    def run(self, variant: str, clients: Clients) -> dict:
        self.conn.send((variant, clients))
        return self.answer()


def start_all(
    workers: dict[str, Worker], engines: dict[str, tuple[str, dict]]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Start each worker with its ``(model, engine knobs)`` from ``engines``, all at once, then wait for each: its
    answer (``ready``), or, when this host refused it, the last line of the error (``refused``: reported, not
    measured), that worker closed and removed from ``workers``."""
    for name, worker in workers.items():
        worker.start(*engines[name])
    ready: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for name, worker in list(workers.items()):
        try:
            ready[name] = worker.answer()
        except RuntimeError as exc:
            refused[name] = str(exc).strip().splitlines()[-1]
            worker.close()
            del workers[name]
    return ready, refused
