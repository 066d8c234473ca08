"""The errors a request or a control verb (``add_lora``, ``sleep``, ``start_profile``, ...) can end with, public and
raised by every layer; picklable, so that they cross to a Ray replica and back with their fields."""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """Sampling parameters this pipeline cannot run; ``param`` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.param, str(self))


class UnknownLoraError(SamplingParamsError):
    """A request (or an unload) names a LoRA adapter the server does not have; ``adapters`` are those it has."""

    def __init__(self, name: str, adapters: list[str]):
        known = ", ".join(sorted(adapters)) or "none"
        super().__init__("lora", f"The LoRA adapter '{name}' does not exist; adapters: {known}")
        self.name, self.adapters = name, adapters

    def __reduce__(self):
        return type(self), (self.name, self.adapters)


class RequestFailedError(RuntimeError):
    """A request failed on its own (its batch neighbours were re-run and unaffected)."""

    def __init__(self, request_id: str | None, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id = request_id
        self.reason = message

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.request_id, self.reason)


class NonFiniteOutputError(RequestFailedError):
    """A request's output holds NaN or inf (`vllm_omni.diffusion.pipeline.finite`): it is not answered as an image, and
    the message names the likely cause. Over HTTP a 422: the request was run, and its parameters made no image."""


class RequestAbortedError(RequestFailedError):
    """The request was aborted (``abort(request_id)`` or a cancelled caller) before it finished."""

    def __init__(self, request_id: str):
        super().__init__(request_id, "aborted")

    def __reduce__(self):
        return type(self), (self.request_id,)


class StageUnavailableError(RequestFailedError):
    """No replica of the stage could take the request: every replica is down (dead or restarting)."""

    def __init__(self, stage_id: int, message: str, request_id: str | None = None):
        unavailable = f"stage {stage_id} is unavailable: {message}"
        super().__init__(request_id, unavailable)
        if request_id is None:  # refused before it had an id in the engine: no "request ... failed" prefix
            self.args = (unavailable,)
        self.stage_id, self.reason = stage_id, message

    def __reduce__(self):
        return type(self), (self.stage_id, self.reason, self.request_id)


class WeightUpdateError(ValueError):
    """Weights that cannot be applied (``update_weights``, ``update_weights_from_distributed``): an unknown
    parameter, a wrong shape, a component the model lacks. Nothing of the update was applied; ``param`` names the
    parameter (``None`` when the update as a whole is refused)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.param, str(self))


class LoraLoadError(ValueError):
    """An adapter that cannot be served (``add_lora``, ``/v1/load_lora_adapter``); the message names its file."""


class SleepModeError(ValueError):
    """A ``sleep`` level or ``wake_up`` tag that is not vLLM's, or level 2 on a stage that cannot drop its weights
    (sequential CPU offload, a GGUF denoiser); ``param`` names the argument (``level`` or ``tags``) and the message
    the allowed values."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across processes (Ray replicas) with both arguments
        return type(self), (self.param, str(self))


class ProfilerStateError(RuntimeError):
    """A profile was asked for in the wrong state: not enabled, started twice, or stopped without a start. The
    message says what to do."""
