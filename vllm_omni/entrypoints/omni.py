"""`Omni`: offline, synchronous generation."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_omni.diffusion.features.weights import Weights
from vllm_omni.entrypoints.omni_base import LoraSource, OmniBase
from vllm_omni.errors import RequestFailedError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import AdmittedParams, OmniDiffusionSamplingParams

Params = OmniDiffusionSamplingParams | AdmittedParams
"""Sampling parameters, or parameters `admit` completed already."""


class Omni(OmniBase):
    """Generate for a list of prompts at once; the engine batches them up to ``max_num_seqs``.

    Use as a context manager, or call `close` when done.
    """

    def generate(
        self,
        prompts: str | Sequence[str],
        sampling_params: Params | Sequence[Params] | None = None,
    ) -> list[OmniRequestOutput]:
        """One output per prompt, in order. A request that fails has ``error`` set and no images;
        the other requests are unaffected. Parameters from `admit` are not completed again."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if sampling_params is None or isinstance(sampling_params, Params):
            params_list = [sampling_params or OmniDiffusionSamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(params_list)} sampling_params; give one, or one per prompt"
                )
        for params in params_list:
            if (params.params if isinstance(params, AdmittedParams) else params).partial_images:
                raise ValueError("partial_images are yielded by AsyncOmni.generate; Omni.generate returns outputs only")
        submitted = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = f"omni-{uuid.uuid4().hex}"
                admitted = self._admitted(request_id, params)
                submitted.append((request_id, prompt, self.engine.add_request(request_id, prompt, admitted)))
            outputs = []
            for request_id, prompt, future in submitted:
                try:
                    outputs.append(future.result())
                except RequestFailedError as exc:
                    outputs.append(OmniRequestOutput(request_id=request_id, prompt=prompt, error=str(exc)))
            return outputs
        except BaseException:
            for request_id, _, future in submitted:
                if not future.done():
                    self.engine.abort(request_id)
            raise

    def add_lora(self, name: str, source: LoraSource, peft_config: Any = None) -> None:
        """Serve LoRA adapter ``name`` from now on (needs ``enable_lora``): ``source`` is its path (a folder or
        file, as ``lora_modules`` takes), or its tensors, keyed as diffusers' ``save_lora_weights`` writes them
        (``transformer.….lora_A.weight``; keys without a component are the denoiser's), with their ``peft_config``
        (a ``peft.LoraConfig`` or its keywords). Every replica loads and checks it between batches. Raises
        `LoraLoadError` naming the file, ValueError if the name is taken or the tensors lack a config."""
        self.engine.load_lora(name, *self._lora_source(name, source, peft_config))

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (`UnknownLoraError` if it is not served); accepted requests keep it."""
        self.engine.unload_lora(name)

    def update_weights(self, weights: Weights, component: str = "transformer") -> None:
        """Serve new weights from now on (docs/rl.md, "Weight updates"). ``weights``: a mapping, or an iterable of
        ``(name, tensor)``, named as ``pipeline.<component>.state_dict()`` names them; each is cast to its
        parameter's dtype and device. Returns once every replica of every stage whose pipeline holds ``component``
        serves them: a request given after it returns runs on them, a batch already running finishes on the old
        ones, and each output's ``metrics.weights_version`` says which it ran with (+1 per update). Raises
        `WeightUpdateError` naming the parameter for an unknown name or a wrong shape (nothing is applied), or the
        components there are for a ``component`` no stage holds."""
        self.engine.weights.update_weights(weights, component)

    def init_weight_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        component: str = "transformer",
        backend: str | None = None,
    ) -> int:
        """Join a trainer's torch.distributed group (vLLM's RLHF pattern): every replica that holds ``component``
        joins as ``rank_offset + i``, while the trainer joins with `WeightUpdateGroup` (usually as rank 0, which
        hosts the group's store at ``master_address:master_port``); gloo on the CPU, NCCL on CUDA. Returns how
        many replicas joined, once every member has."""
        return self.engine.weights.init_weight_update_group(
            master_address, master_port, rank_offset, world_size, component, backend
        )

    def update_weights_from_distributed(
        self, names_dtypes_shapes: Iterable[tuple[str, Any, Any]], component: str = "transformer", src: int = 0
    ) -> None:
        """`update_weights` with tensors that rank ``src`` of the group broadcasts (`WeightUpdateGroup.broadcast`),
        one per ``(name, dtype, shape)``, in that order, while this call waits."""
        self.engine.weights.update_weights_from_distributed(names_dtypes_shapes, component, src)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (docs/rl.md, "Sleep and wake"): every replica of every diffusers stage finishes its
        running batch, then stops starting requests; requests given meanwhile wait for `wake_up`. ``level`` 0 only
        pauses, 1 also moves the weights to CPU memory (where a CPU stage has them already), 2 drops them
        (`wake_up` reloads from the model's files whatever `update_weights` has not set meanwhile). Returns once
        every replica sleeps; sleeping again at the same or a lower level changes nothing. Raises `SleepModeError`
        for a level that is not one of those, or level 2 on a stage that cannot drop its weights."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the memory of ``tags`` (vLLM's: ``weights``, ``kv_cache``, ``scheduling``; ``None``: all); once none
        sleeps, requests start again. Returns once every replica has; harmless when awake. Raises `SleepModeError`
        for another tag."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether every replica of every diffusers stage sleeps."""
        return self.engine.is_sleeping

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's ``start_profile`` (docs/observability.md, "Profiling"; needs ``profiler_config``): the torch
        profiler records every engine process (this one, with its inline replicas, and each Ray replica) until
        `stop_profile`. ``profile_prefix`` begins each trace file's name. Raises `ProfilerStateError` when
        profiling is off or a profile records already."""
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> list[str]:
        """Stop the profile; returns its trace files (one per process) once they are written. Raises
        `ProfilerStateError` when none records."""
        return self.profiler.stop()

    def close(self) -> None:
        self.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
