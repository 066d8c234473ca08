"""One torch profiler per process (orchestrator/profiler.py): started on a thread of its own, it records the work of an
engine thread that was running before it started, and writes one trace file; a second start and a stop without a
start are refused."""

import gzip
import json
import queue
import threading

import pytest
import torch

from vllm_omni.config.profiler import profiler_config
from vllm_omni.errors import ProfilerStateError
from vllm_omni.orchestrator.engine_profiler import EngineProfiler
from vllm_omni.orchestrator.profiler import ProcessProfiler, trace_name


@pytest.fixture
def engine_thread():
    """A thread that runs torch work on demand, as an engine's does, started before any profile."""
    work, done = queue.Queue(), queue.Queue()

    def run():
        while (size := work.get()) is not None:
            with torch.profiler.record_function("engine_step"):
                done.put(torch.mm(torch.ones(size, size), torch.ones(size, size)).sum().item())

    thread = threading.Thread(target=run, name="engine", daemon=True)
    thread.start()
    yield work, done
    work.put(None)
    thread.join()


def test_the_profile_records_an_engine_thread_that_ran_before_it_started(engine_thread, tmp_path):
    work, done = engine_thread
    work.put(4)
    assert done.get() == 64.0  # the thread has run torch work: its state predates the profile
    profiler = ProcessProfiler()
    config = profiler_config(
        {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": True}
    )
    profiler.start(config, trace_name("test")).result()
    assert profiler.active
    work.put(8)
    assert done.get() == 512.0
    path = profiler.stop().result()
    assert not profiler.active and [p.name for p in tmp_path.iterdir()] == [path.rsplit("/", 1)[1]]
    assert path.endswith(".pt.trace.json.gz") and trace_name("test") in path
    with gzip.open(path, "rt") as trace:
        events = json.load(trace)["traceEvents"]
    steps = [e for e in events if e.get("name") == "engine_step"]
    mms = [e for e in events if e.get("name") == "aten::mm"]
    assert len(steps) == 1 and mms and {e["tid"] for e in mms} == {steps[0]["tid"]}
    assert steps[0]["tid"] != threading.get_native_id()  # not the thread that asked for the profile


def test_a_second_start_and_a_stop_without_start_are_refused(tmp_path):
    profiler = ProcessProfiler()
    config = profiler_config({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    with pytest.raises(ProfilerStateError, match="is not being profiled: start a profile first"):
        profiler.stop().result()
    profiler.start(config, "first").result()
    with pytest.raises(ProfilerStateError, match=r"is being profiled already \(first\): stop it first"):
        profiler.start(config, "second").result()
    assert profiler.stop().result().endswith(".pt.trace.json.gz")


def test_without_a_config_the_engine_profiler_says_how_to_turn_it_on():
    profiler = EngineProfiler([], None)
    with pytest.raises(ProfilerStateError, match='--profiler-config \'{"profiler": "torch"'):
        profiler.start()
    with pytest.raises(ProfilerStateError, match="no profile is being recorded"):
        profiler.stop()
