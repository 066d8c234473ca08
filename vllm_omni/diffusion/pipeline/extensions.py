"""The features that wrap a pipeline call or a denoising step, as extensions in one ordered list (`EXTENSIONS`),
the way diffusers orders its hooks in one registry.

Each feature keeps its code in its own module, and there implements `Extension`: what it does when the pipeline
loads (`Extension.on_load`), the context it wraps around a request-mode pipeline call (`Extension.around_call`)
and around a step-mode denoising step (`Extension.around_step`), and the control verbs it refuses
(`Extension.refuse`). `DiffusionRunner` builds the call's arguments (`PipelineCall`), enters the extensions in
order with one `contextlib.ExitStack` (`Extensions.around_call`) and calls the pipeline.

The order, outermost first (the first entered is the last left):

1. ``quantization`` (diffusion/quantization.py): the weights themselves: its plan is made before the pipeline
   loads, which loads through it; it refuses sleep level 2 and weight updates of components its files cannot give
   back.
2. ``compile`` (here: compile has no module of its own): torch.compile of the denoisers with whatever the
   extensions below hooked into them (compilation happens at the first forward of each size); a size not warmed
   up is logged on first use.
3. ``lora`` (diffusion/lora.py): the stage's adapters, loaded with the pipeline; each row's adapters (prompt rows,
   latent rows) for the call.
4. ``step_cache`` (diffusion/step_cache.py): the cache hooks on the denoisers; each request's own cache state for
   the call.
5. ``sde`` (diffusion/sde.py): the scheduler's step replaced per request in its window; the trajectories after.
6. ``previews`` (diffusion/previews.py): the scheduler's step (``sde``'s, when it samples) keeps its prediction;
   its step hook makes the partial images due.
7. ``timings`` (diffusion/timings.py): hooks on the components; the call's denoising loop (its step hook ends
   each step); around a step-mode step, that step.
8. ``finite`` (diffusion/finite.py): marks outputs that are not finite in the pipeline's processors (which the
   timings' postprocess hook times).
9. ``ranks`` (diffusion/parallel.py): a replica of several ranks runs the call on them (no step callback) after
   refusing what they do not run; it refuses sleep and weight updates.

``on_load`` runs innermost first (``ranks`` to ``quantization``), once for the loaded pipeline and once per image
variant built on it (``variant=True``), so that an outer extension's hooks wrap an inner one's: the timings' hook
of ``postprocess`` wraps the finite check's, the step cache's hooks are on the denoisers before they are compiled.
``around_call`` and ``around_step`` enter outermost first. A step hook (what ``around_call`` yields) runs after each
step of the call, innermost first: the timings end the step before the previews are made. ``refuse`` asks them
outermost first.

Adding a feature that wraps the call is one class in the feature's module and one entry here (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.request import DiffusionRequest, PipelineCall
from vllm_omni.diffusion.features.previews import PreviewsExtension
from vllm_omni.diffusion.features.quantization import QuantizationExtension
from vllm_omni.diffusion.features.sde import SdeExtension
from vllm_omni.diffusion.features.step_cache import StepCacheExtension
from vllm_omni.diffusion.lora.adapters import LoraExtension
from vllm_omni.diffusion.parallel.ranks import RanksExtension
from vllm_omni.diffusion.pipeline.components import loaded_denoisers
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.diffusion.pipeline.finite import FiniteExtension
from vllm_omni.diffusion.pipeline.timings import TimingsExtension
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

StepHook = Callable[[], None]
"""Run after each step of a pipeline call (from the runner's step callback, once the requests' ``steps_done`` are
set)."""


ExtensionFactory = Callable[[OmniDiffusionConfig, torch.device, torch.dtype, tuple[str, ...]], Extension]
"""An extension's constructor: ``(od_config, device, dtype, skips)``."""


def parse_size(size: str) -> tuple[int, int, int | None]:
    """``WxH`` or ``WxHxF`` (a `compile_sizes` entry) as ``(width, height, frames)``."""
    width, height, *frames = map(int, size.split("x"))
    return width, height, frames[0] if frames else None


def compile_denoisers(pipeline, mode: str) -> list[str]:
    """torch.compile the pipeline's denoisers in place (``regional``: diffusers' ``compile_repeated_blocks``);
    returns their names. Compilation itself happens on the first forward of each shape."""
    names = loaded_denoisers(pipeline)
    for name in names:
        module = getattr(pipeline, name)
        if mode == "full":
            module.compile()
        elif not getattr(module, "_repeated_blocks", None):
            raise ValueError(
                f"compile='regional': {type(module).__name__} lists no repeated blocks for diffusers' "
                "compile_repeated_blocks; use compile 'full'"
            )
        else:
            module.compile_repeated_blocks()
    return names


class CompileExtension(Extension):
    """``compile`` (and ``compile_sizes``): the denoisers compiled when the pipeline loads."""

    name = "compile"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.stage = od_config.stage
        self.compiled: set[tuple[int, int, int | None]] | None = None
        """The sizes the compiled denoiser has been asked for (warm-up ones first); ``None``: not compiled."""

    def on_load(self, pipeline: Any, variant: bool) -> None:
        if self.stage.compile == "none" or variant:
            return
        names = compile_denoisers(pipeline, self.stage.compile)
        self.compiled = {parse_size(size) for size in self.stage.compile_sizes}
        logger.info("Compiling %s (%s) of stage %d", ", ".join(names), self.stage.compile, self.stage.stage_id)

    def note_size(self, params) -> None:
        """Log the first request of a size the compiled denoiser was not warmed up for: it compiles on first use."""
        if self.compiled is None:
            return
        size = (params.width, params.height, params.num_frames)
        if size not in self.compiled:
            self.compiled.add(size)
            shown = "x".join(str(n) for n in size if n is not None)
            logger.info("Stage compiles the denoiser for %s on first use (not in compile_sizes)", shown)


EXTENSIONS: tuple[ExtensionFactory, ...] = (
    QuantizationExtension,
    CompileExtension,
    LoraExtension,
    StepCacheExtension,
    SdeExtension,
    PreviewsExtension,
    TimingsExtension,
    FiniteExtension,
    RanksExtension,
)
"""The extensions, outermost first (module docstring): the order the runner builds and enters them."""

E = TypeVar("E")


class Extensions:
    """One stage's extensions, built in `EXTENSIONS` order."""

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.all: list[Extension] = [make(od_config, device, dtype, skips) for make in EXTENSIONS]
        self._stepping = [e for e in self.all if type(e).around_step is not Extension.around_step]
        """The extensions that wrap a step-mode step: entered at every step, where the others' ``nullcontext``s and
        their exit stack cost more than the timings' own step (tens of microseconds on the CPU)."""

    def get(self, kind: type[E]) -> E:
        """The extension of class ``kind``."""
        return next(extension for extension in self.all if isinstance(extension, kind))

    def on_load(self, pipeline: Any, variant: bool = False) -> None:
        """Every extension's `Extension.on_load`, innermost first."""
        for extension in reversed(self.all):
            extension.on_load(pipeline, variant)

    @contextlib.contextmanager
    def around_call(self, call: PipelineCall) -> Iterator[list[StepHook]]:
        """Every extension's context around ``call``, entered in order; yields their step hooks, innermost first."""
        with contextlib.ExitStack() as stack:
            hooks = [stack.enter_context(extension.around_call(call)) for extension in self.all]
            yield [hook for hook in reversed(hooks) if hook is not None]

    def around_step(self, requests: list[DiffusionRequest]) -> contextlib.AbstractContextManager[None]:
        """Every extension's context around one step-mode step of ``requests``, entered in order (those that have
        one)."""
        if len(self._stepping) == 1:
            return self._stepping[0].around_step(requests)
        return self._around_steps(requests)

    @contextlib.contextmanager
    def _around_steps(self, requests: list[DiffusionRequest]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for extension in self._stepping:
                stack.enter_context(extension.around_step(requests))
            yield

    def refuse(self, verb: str, argument: Any) -> None:
        """Raise the first refusal of control verb ``verb`` (`Extension.refuse`)."""
        for extension in self.all:
            extension.refuse(verb, argument)
