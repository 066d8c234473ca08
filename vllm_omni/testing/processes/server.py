"""Start a real ``vllm serve MODEL --omni`` process on 127.0.0.1 and wait until it is ready.

Used by the tests, the demo and the benchmarks: they all talk to the server the
way a user would, through the real CLI. A test run asks for preloaded servers
(`use_preloaded_servers`): the same CLI in a fork of a process that has already
imported the stack (`vllm_omni.testing.processes.preloaded`), which saves each server the
imports; a server with an environment of its own, or one asked with ``cli=True``,
is always a real ``vllm`` process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx

RAY_WORKER_PORTS_END = 20000
"""Ray's worker processes listen on ports 10002-19999 (its ``min_worker_port`` / ``max_worker_port``)."""


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_PORTS = random.SystemRandom()
"""Not the module's generator: the tests may seed that (pytest-randomly seeds it alike in every worker before each
test), and two workers would then try the same ports in the same order."""


def free_port() -> int:
    """A port that is free now and that nothing else takes before the server binds it: between Ray's worker ports
    and the kernel's ephemeral ones, where every bind to port 0 and every outgoing connection lands (the tests'
    own clients, Ray's nodes and actors). A port taken in between makes uvicorn's bind fail, and the server exits
    1 before it is ready."""
    lo, hi = RAY_WORKER_PORTS_END, _ephemeral_start()
    for _ in range(200 if hi - lo > 100 else 0):
        port = _PORTS.randrange(lo, hi)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no such range on this host: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_preloaded: multiprocessing.context.ForkServerContext | None = None


def preloaded_context() -> multiprocessing.context.ForkServerContext:
    """The `multiprocessing` forkserver whose preload imports the serving stack
    (`vllm_omni.testing.processes.preloaded`),
    started at its first use: a process forked from it skips the ~10 s of imports a spawned one pays. Servers
    (`use_preloaded_servers`) and the benchmarks' engine workers share it, so one process imports the stack once."""
    context = multiprocessing.get_context("forkserver")
    # one list for every caller: the first start wins
    context.set_forkserver_preload(["vllm_omni.testing.processes.preloaded"])
    return context


def use_preloaded_servers() -> None:
    """From now on, `RemoteOmniServer` forks its servers from `preloaded_context`. A script that calls this needs the
    ``if __name__ == "__main__":`` guard, as any `multiprocessing` user does (each fork imports the caller's main
    module)."""
    global _preloaded
    if _preloaded is None:
        _preloaded = preloaded_context()


def _enter_fork(cwd: str, environ: dict[str, str], log_path: str | None) -> None:
    """A preloaded fork's start: a session of its own (so that a process-group kill or interrupt reaches what it
    starts, and not its starter, as for a ``Popen(start_new_session=True)``), the starter's working directory and
    environment (over what the preload set: the device hint, which the starter may lack), stdout and stderr to
    ``log_path`` (``None``: the forkserver's)."""
    os.setsid()
    os.chdir(cwd)
    os.environ.update(environ)
    if log_path is not None:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)


def _serve_preloaded(argv: list[str], log_path: str | None, cwd: str, environ: dict[str, str]) -> None:
    _enter_fork(cwd, environ, log_path or os.devnull)
    from vllm_omni.testing.processes.preloaded import serve  # already imported: the forkserver's preload

    serve(argv)


def run_as_main(path: str, argv: list[str], cwd: str, environ: dict[str, str], log_path: str | None = None) -> None:
    """A preloaded fork's body (`PreloadedProcess`) that runs ``python PATH ARGV`` as the interpreter would: the
    script as ``__main__`` (``runpy``) with its folder first on ``sys.path``, SIGINT a ``KeyboardInterrupt`` even
    where the starter ignores it; an exception it raises ends the process with exit code 1 and its traceback."""
    import runpy

    _enter_fork(cwd, environ, log_path)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.argv = [path, *argv]
    runpy.run_path(path, run_name="__main__")


def preloaded_servers_in_use() -> bool:
    """Whether `use_preloaded_servers` has run in this process (the tests' servers and scripts are forks)."""
    return _preloaded is not None


class PreloadedProcess:
    """``target(*args)`` in a fork of `preloaded_context`, with the part of `subprocess.Popen`'s interface that
    `RemoteOmniServer`, the tests and the benchmarks' script runners use: ``pid``, ``poll()``, ``wait(timeout)``,
    ``send_signal(sig)`` and ``returncode`` (negative: killed by that signal, as Popen reports it). ``target``
    sets its own session, working directory and environment. Not a ``daemon`` where it starts processes of its
    own."""

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], daemon: bool = True):
        assert _preloaded is not None, "made only once use_preloaded_servers has run"
        self._process = _preloaded.Process(target=target, args=args, daemon=daemon)
        self._process.start()
        pid = self._process.pid
        assert pid is not None, "started"
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            assert timeout is not None, "join() without a timeout returns once it exited"
            raise subprocess.TimeoutExpired([self._process.name], timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)


def vllm_executable() -> str:
    """The ``vllm`` script next to this Python (the one that hands ``--omni`` to vllm-omni)."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm")
    return beside if os.path.exists(beside) else shutil.which("vllm") or "vllm"


class RemoteOmniServer:
    """``with RemoteOmniServer(model, ["--max-num-seqs", "4"]) as server: server.url_for("v1")``."""

    def __init__(
        self,
        model: str,
        args: Sequence[str] = (),
        *,
        startup_timeout_s: float = 300.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        cli: bool = False,
    ):
        """``env``: variables set for the server on top of this process's environment (the stack reads some at
        import, so such a server is a real ``vllm`` process). ``cli``: a real ``vllm`` process even when servers
        are preloaded, for a test whose promise is the executable itself."""
        self.port = free_port()
        self.command = [
            vllm_executable(),
            "serve",
            model,
            "--omni",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        self.env = None if env is None else os.environ | env
        self.preloaded = _preloaded is not None and env is None and not cli
        self.startup_timeout_s = startup_timeout_s
        # Always a log, so that a server that dies before it is ready can say why (its tail is in the error).
        self.log_path = log_path or tempfile.mkstemp(prefix="vllm-omni-server-", suffix=".log")[1]
        self.process: subprocess.Popen | PreloadedProcess | None = None
        self.returncode: int | None = None
        self.health_before_ready: list[tuple[int, dict]] = []
        """``/health`` answers (status, JSON body) seen while the server was listening but not ready."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.base_url, *parts])

    def __enter__(self) -> RemoteOmniServer:
        if self.preloaded:
            # The starter's environment now, not the forkserver's from when it started: Ray's RAY_AUTH_MODE, for
            # one, is set in the process that starts a local cluster, and a server without it cannot join it.
            started = (["vllm", *self.command[1:]], self.log_path, os.getcwd(), dict(os.environ))
            self.process = PreloadedProcess(_serve_preloaded, started)
        else:
            log = open(self.log_path, "w")  # noqa: SIM115 - closed by the child's exit
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode} before it was ready: {self.command}\n"
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                health = httpx.get(self.url_for("health"), timeout=2)
            except httpx.HTTPError:
                pass
            else:
                if health.status_code == 200:
                    return self
                self.health_before_ready.append((health.status_code, health.json()))
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(
            f"server not ready after {self.startup_timeout_s} s: {self.command}\n"
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        with open(self.log_path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.returncode = self.process.returncode if self.process else None
        return self.returncode

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def in_process_server(
    model: str,
    deploy_config: str | None = None,
    startup_timeout_s: float = 600,
    serving: dict[str, Any] | None = None,
    **knobs,
) -> Iterator[tuple[Any, str]]:
    """A real uvicorn server in this process, so that a test can reach into its real engine; yields the app and
    its base URL, and checks on the way out that the server stopped. ``deploy_config``: a deploy YAML's path;
    ``serving``: `ServingConfig` fields (``strict_fields``, ...); ``knobs``: global stage knobs."""
    import uvicorn

    from vllm_omni.config import resolve_stage_configs
    from vllm_omni.config.serving import ServingConfig
    from vllm_omni.entrypoints.openai.app import build_app

    port = free_port()
    config = ServingConfig(host="127.0.0.1", port=port, served_model_names=["tiny"], **(serving or {}))
    app = build_app(model, resolve_stage_configs(deploy_config, global_knobs=knobs), config, on_fatal=print)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(base):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the in-process server at {base} was not healthy within {startup_timeout_s} s")
            time.sleep(0.05)
        yield app, base
    finally:
        server.should_exit = True
        thread.join(120)
    assert not thread.is_alive(), "the server did not stop"


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def came_true(predicate, timeout: float = 120.0) -> bool:
    """Whether ``predicate`` came true within ``timeout``, polled: a bound on a hang, not a timing assumption."""
    event, deadline = threading.Event(), time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        event.wait(0.05)
    return True


def outcome_count(base: str, counter: str, outcome: str) -> float:
    """The server's ``vllm_omni:<counter>_total{outcome=...}`` (0 before the first one)."""
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        if line.startswith(f'vllm_omni:{counter}_total{{outcome="{outcome}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def finished_video_job(base: str, video_id: str, headers: dict[str, str], timeout: float = 600.0) -> dict:
    """The Videos API job ``video_id`` once it completed or failed, polled (the deadline bounds a hang; at it, the
    job as it is then)."""
    deadline = time.monotonic() + timeout
    while True:
        job = httpx.get(f"{base}/v1/videos/{video_id}", headers=headers, timeout=60).json()
        if job["status"] in ("completed", "failed") or time.monotonic() > deadline:
            return job
        threading.Event().wait(0.1)
