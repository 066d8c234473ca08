"""The benchmark scripts run in the test process: each smoke test calls a script's ``main`` with its command line,
so that it needs no interpreter of its own (and its servers come from the session's preloaded ones, where the
script does not ask for a real ``vllm`` process). The workers and servers a script starts itself stay processes
of their own."""

import importlib
import pathlib
import signal

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    """``bench(script, *args)`` runs ``python benchmarks/<script>.py ARGS`` in this process: the script's ``main``
    with the script's folder first on ``sys.path``, as Python puts it there for a script (its imports of ``common``
    and of the other scripts, and its spawned workers' imports, find them there), and fails unless ``main``
    returns normally (``None``, or exit code 0). What a run changes in the process is put back: ``sys.path``, the
    SIGINT and SIGTERM handlers (``ray.init`` installs its own) and torch's thread count (an engine thread's
    ``torch.set_num_threads`` is also the count of every thread that runs torch after it for the first time)."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    threads = torch.get_num_threads()

    def run(script: str, *args: str) -> None:
        assert importlib.import_module(script).main(list(args)) in (None, 0)

    yield run
    for number, handler in handlers.items():
        signal.signal(number, handler)
    torch.set_num_threads(threads)  # the count of threads yet to run torch (this thread's own never changed)
