"""`AsyncOmni`: asyncio generation, one request per `generate` call."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from vllm_omni.diffusion.features.previews import previews_until
from vllm_omni.diffusion.features.weights import Weights
from vllm_omni.entrypoints.omni_base import LoraSource, OmniBase
from vllm_omni.errors import RequestAbortedError
from vllm_omni.orchestrator.replica import warm_up_params
from vllm_omni.outputs import AudioChunk, OmniRequestOutput, Preview
from vllm_omni.sampling_params import AdmittedParams, OmniDiffusionSamplingParams


class AsyncOmni(OmniBase):
    """Concurrent ``generate`` calls are batched by the engine up to ``max_num_seqs``."""

    async def generate(
        self,
        prompt: str,
        sampling_params: OmniDiffusionSamplingParams | AdmittedParams | None = None,
        request_id: str | None = None,
    ) -> AsyncGenerator[OmniRequestOutput, None]:
        """Yield the request's previews as they are made (``partial_images`` of them, or fewer when it has too few
        steps: each ``finished=False`` with ``partial_image_index``), then its output when it finishes. A speech
        model's request yields its audio chunks as they are decoded (each ``finished=False``, ``audios`` holding the
        chunk), then its output with the whole waveform.
        ``sampling_params`` from `admit` are not completed again.

        Raises `RequestFailedError` if the request fails; ends without output if it is aborted. Cancelling the
        consuming task, or closing the generator before its output, aborts the request and frees its slot.
        """
        request_id = request_id or f"omni-{uuid.uuid4().hex}"
        admitted = self._admitted(request_id, sampling_params or OmniDiffusionSamplingParams())
        loop = asyncio.get_running_loop()
        previews: asyncio.Queue[Preview | AudioChunk] = asyncio.Queue()

        def hand_over(preview: Preview | AudioChunk) -> None:  # on the engine's thread
            loop.call_soon_threadsafe(previews.put_nowait, preview)

        speech = self.speech_card is not None
        on_preview = hand_over if admitted.params.partial_images or speech else None
        future = self.engine.add_request(request_id, prompt, admitted, on_preview)
        result = asyncio.wrap_future(future)
        try:
            async for preview in previews_until(result, previews):
                yield _partial(request_id, prompt, preview)
            try:
                output = await result
            except RequestAbortedError:
                return
            yield output
        finally:
            if not future.done():  # cancelled, or closed before its output
                result.add_done_callback(_retrieve)  # it ends RequestAbortedError, which no one awaits now
                self.engine.abort(request_id)

    async def warm_up(self) -> None:
        """Run one step at the model's default size through the whole stage graph, once per replica of the widest
        stage: routing sends each request to the replica with the fewest outstanding requests, so every replica
        initialises its components before the first real request. Then the same at each of the denoising stage's
        ``compile_sizes``, so that its compiled denoiser has compiled them."""

        async def one(params: OmniDiffusionSamplingParams) -> None:
            async for _ in self.generate("warm-up", params, request_id=f"warmup-{uuid.uuid4().hex}"):
                pass

        compile_sizes = next((stage.compile_sizes for stage in self.stage_configs if stage.denoises), ())
        for params in warm_up_params(self.speech_card or self.model_card, compile_sizes):
            await asyncio.gather(*(one(params) for _ in range(max(stage.num_replicas for stage in self.stage_configs))))

    async def add_lora(self, name: str, source: LoraSource, peft_config: Any = None) -> None:
        """`Omni.add_lora`: serve adapter ``name`` from its path, or from its tensors with their ``peft_config``."""
        await asyncio.to_thread(self.engine.load_lora, name, *self._lora_source(name, source, peft_config))

    async def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (`UnknownLoraError` if it is not served); accepted requests keep it."""
        await asyncio.to_thread(self.engine.unload_lora, name)

    async def update_weights(self, weights: Weights, component: str = "transformer") -> None:
        """`Omni.update_weights`: returns once every replica that holds ``component`` serves ``weights``."""
        await asyncio.to_thread(self.engine.weights.update_weights, weights, component)

    async def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        component: str = "transformer",
        backend: str | None = None,
    ) -> int:
        """`Omni.init_weight_update_group`: returns how many replicas joined, once every member has."""
        return await asyncio.to_thread(
            self.engine.weights.init_weight_update_group,
            master_address,
            master_port,
            rank_offset,
            world_size,
            component,
            backend,
        )

    async def update_weights_from_distributed(
        self, names_dtypes_shapes: Iterable[tuple[str, Any, Any]], component: str = "transformer", src: int = 0
    ) -> None:
        """`Omni.update_weights_from_distributed`: returns once every replica serves the broadcast tensors."""
        await asyncio.to_thread(
            self.engine.weights.update_weights_from_distributed, names_dtypes_shapes, component, src
        )

    async def sleep(self, level: int = 1) -> None:
        """`Omni.sleep`: returns once every replica of every diffusers stage sleeps; requests wait for `wake_up`."""
        await asyncio.to_thread(self.engine.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`Omni.wake_up`: returns once every replica has woken the memory of ``tags`` (``None``: all)."""
        await asyncio.to_thread(self.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        """Whether every replica of every diffusers stage sleeps."""
        return self.engine.is_sleeping

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """`Omni.start_profile`: returns once every engine process records."""
        await asyncio.to_thread(self.profiler.start, profile_prefix)

    async def stop_profile(self) -> list[str]:
        """`Omni.stop_profile`: returns the trace files once they are written."""
        return await asyncio.to_thread(self.profiler.stop)

    async def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if it is not in flight."""
        return self.engine.abort(request_id)

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.shutdown()


def _partial(request_id: str, prompt: str, partial: Preview | AudioChunk) -> OmniRequestOutput:
    """A preview's or an audio chunk's unfinished output."""
    if isinstance(partial, AudioChunk):
        return OmniRequestOutput(
            request_id=request_id,
            prompt=prompt,
            audios=[partial.samples],
            sample_rate=partial.sample_rate,
            finished=False,
        )
    return OmniRequestOutput(
        request_id=request_id,
        prompt=prompt,
        images=partial.images,
        finished=False,
        partial_image_index=partial.index,
    )


def _retrieve(result: asyncio.Future) -> None:
    if not result.cancelled():
        result.exception()
