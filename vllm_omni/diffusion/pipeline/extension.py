"""`Extension`, the base of every feature around the pipeline call (`vllm_omni.diffusion.pipeline.extensions` lists
them, in order): each hook does nothing until a feature overrides it, so a feature's module holds only what the
feature does. It imports nothing of the package, so that every feature module can subclass it."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar


class Extension:
    """A feature around the pipeline call. Built before the pipeline loads, from the stage's config, the device, the
    dtype and the components the stage skips (`ExtensionFactory`)."""

    name: ClassVar[str]
    """How docs and errors name it."""

    def __init__(self, od_config: Any, device: Any, dtype: Any, skips: tuple) -> None:
        """``od_config``: the replica's `OmniDiffusionConfig`; ``skips``: the components its stage does not load."""

    def on_load(self, pipeline: Any, variant: bool) -> None:
        """What it does to a loaded pipeline: the stage's (``variant`` False, once), then each image variant built
        on its components (``variant`` True: its modules are the loaded pipeline's, its processors its own)."""

    def around_call(self, call: Any) -> contextlib.AbstractContextManager[Any]:
        """The context of one request-mode pipeline call (a `PipelineCall`); it yields what runs after each step
        (a `StepHook`, or ``None``). It may refuse the call (raise on entry), set ``call.invoke`` or
        ``call.callback``."""
        return contextlib.nullcontext()

    def around_step(self, requests: Any) -> contextlib.AbstractContextManager[None]:
        """The context of one step-mode denoising step of ``requests`` (`denoise.denoise_step`)."""
        return contextlib.nullcontext()

    def refuse(self, verb: str, argument: Any) -> None:
        """Raise if it refuses control verb ``verb`` now (``sleep``: ``argument`` is the level; ``update_weights``:
        the component), with the error the verb answers."""
