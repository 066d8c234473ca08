"""`Omni`: offline, synchronous generation."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from vllm_omni.engine.omni_engine import AdmittedParams
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.errors import RequestFailedError
from vllm_omni.outputs import OmniRequestOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

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

    def add_lora(self, name: str, path: str) -> None:
        """Serve LoRA adapter ``name`` from ``path`` from now on (needs ``enable_lora``); every replica loads and
        checks it between batches. Raises `LoraLoadError` naming the file, ValueError if the name is taken."""
        self.engine.load_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (`UnknownLoraError` if it is not served); accepted requests keep it."""
        self.engine.unload_lora(name)

    def close(self) -> None:
        self.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
