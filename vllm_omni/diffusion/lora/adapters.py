"""LoRA adapters: loaded by diffusers into PEFT layers, applied per row, so one forward serves requests with
different adapters, scales or none (docs/lora.md).

diffusers' ``load_lora_weights`` reads an adapter (its own format, PEFT's, or a kohya-style file it converts) and
wraps each targeted linear or convolution in a PEFT ``LoraLayer``. We keep PEFT's own forward off (adapters
disabled: it returns the base layer's output) and add each row's delta in a forward hook instead:
``lora_B(lora_A(x)) · scaling · scale`` for every adapter the row's request selected, which is PEFT's formula with
the request's scale where ``set_adapters`` would put one scale for the whole batch. No weight is merged.

Which row belongs to which request is set around each call (`LoraAdapters.rows`): one list for the text encoders
(one entry per prompt row) and one for the denoiser (one per latent row). A call whose batch is a multiple of the
list is the list repeated (classifier-free guidance concatenates negative and positive rows); anything else is an
error, never a guess.

The control verbs ``load_lora`` and ``unload_lora`` (`EngineCore.call`) are at the end of this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.engine.control import handler
from vllm_omni.diffusion.lora.tensors import TENSOR_SOURCE, LoraTensors, adapter_metadata
from vllm_omni.diffusion.pipeline.components import DENOISERS, TEXT_ENCODERS
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.errors import LoraLoadError
from vllm_omni.logger import init_logger
from vllm_omni.sampling_params import LoraSelection

if TYPE_CHECKING:
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine.request import DiffusionRequest, PipelineCall

logger = init_logger(__name__)

Selection = tuple[LoraSelection, ...]
"""What one row applies: its request's ``lora`` (empty: the base model)."""

COMPONENT_KINDS = dict.fromkeys(TEXT_ENCODERS, "text") | dict.fromkeys(DENOISERS, "denoiser")
"""Which row list (`LoraAdapters.rows`) each pipeline component that may carry LoRA layers reads."""


_MALLOC_TRIM: Callable[[int], int] | None
try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
except AttributeError:  # not glibc
    _MALLOC_TRIM = None


def _release_freed_memory() -> None:
    """Hand the memory an eviction (or a load's temporary state dict) freed back to the system: glibc keeps freed
    pages in its arenas, and the process would otherwise hold a few adapters' worth more than it uses."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _per_row_layers() -> tuple[type, ...]:
    from peft.tuners.lora.layer import Linear, _ConvNd

    return (Linear, _ConvNd)


_STORAGE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""Dtypes that weights are stored in but not computed in (layerwise casting's)."""


def no_lora_loader(pipeline_class: type) -> str | None:
    """Why adapters cannot load into a pipeline of ``pipeline_class``; ``None`` when they can."""
    if callable(getattr(pipeline_class, "load_lora_weights", None)):
        return None
    return f"{pipeline_class.__name__} has no load_lora_weights (it is none of diffusers' LoRA loader pipelines)"


class LoraAdapters:
    """The adapters resident in one pipeline (at most ``max_loras``, least recently used evicted first) and the
    hooks that apply them per row."""

    def __init__(self, pipeline, max_loras: int, max_lora_rank: int, dtype: torch.dtype = torch.float32):
        """``dtype``: the stage's; adapters compute in it where PEFT made them in a layer's storage dtype (the float8
        of ``fp8_storage``, which no matmul takes)."""
        self.pipeline = pipeline
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.resident: OrderedDict[str, str] = OrderedDict()
        """Loaded adapters (name → path, or the source tag of one given as tensors), least recently used first."""
        self._tensors: dict[str, tuple[str, LoraTensors]] = {}
        """The adapters given as tensors (name → source tag, tensors), kept while served: one that was evicted
        loads again from them."""
        self._retired: set[str] = set()
        """Tensor adapters no longer served but still resident: their tensors go when they are evicted."""
        self._plans: dict[str, _RowPlan | None] = {"text": None, "denoiser": None}
        self._hooked: set[int] = set()
        self.lock = threading.Lock()
        """Held around every denoiser call with adapters and every load or eviction: on CUDA in step mode an
        adapter loads on the encode worker while the loop thread runs the denoiser."""

    def components(self) -> Iterator[tuple[str, str, torch.nn.Module]]:
        """The loaded components that may carry LoRA layers: name, the row list it reads, module."""
        for name, kind in COMPONENT_KINDS.items():
            module = getattr(self.pipeline, name, None)
            if isinstance(module, torch.nn.Module):
                yield name, kind, module

    # Loading and eviction.

    def load(self, name: str, path: str, keep: Iterable[str] = (), tensors: LoraTensors | None = None) -> None:
        """Make adapter ``name`` resident from ``path``, evicting the least recently used adapter not in ``keep``
        when ``max_loras`` are resident (raises `LoraLoadError` naming the file). ``tensors``: an adapter given as
        tensors, whose source tag is ``path``; they are kept, so that it loads again after an eviction."""
        protected = set(keep)
        if tensors is not None and self._tensors.get(name, ("",))[0] != path:
            self._tensors[name] = (path, tensors.copy())
            self._retired.discard(name)
        elif not path.startswith(TENSOR_SOURCE):
            self._tensors.pop(name, None)
        if name in self.resident:
            if self.resident[name] == path:
                self.resident.move_to_end(name)
                return
            if name in protected:
                raise LoraLoadError(
                    f"cannot load adapter {name!r} from {path}: requests in flight still use it from "
                    f"{self.resident[name]}; retry once they finish"
                )
            self.unload(name)  # registered again under another path
        while len(self.resident) >= self.max_loras:
            victim = next((n for n in self.resident if n not in protected), None)
            if victim is None:
                raise LoraLoadError(
                    f"cannot load adapter {name!r}: all {self.max_loras} resident adapters are in use "
                    "(raise --max-loras)"
                )
            self.unload(victim)
        # Normal tensors even when the caller runs in inference mode: PEFT sets requires_grad on every adapter's
        # weights when another loads or goes, which inference tensors refuse.
        with self.lock, torch.inference_mode(False):
            try:
                self._load(name, path)
            except LoraLoadError:
                if tensors is not None:
                    self._tensors.pop(name, None)
                raise
            finally:
                _release_freed_memory()
        self.resident[name] = path

    def _load(self, name: str, path: str) -> None:
        given = self._tensors.get(name)
        if path.startswith(TENSOR_SOURCE) and (given is None or given[0] != path):
            raise LoraLoadError(
                f"LoRA adapter {name!r} was given as tensors ({path}), which this replica does not hold"
            )
        if not path.startswith(TENSOR_SOURCE) and not os.path.exists(path):
            raise LoraLoadError(f"LoRA adapter {name!r}: {path} does not exist")
        if (why := no_lora_loader(type(self.pipeline))) is not None:
            raise LoraLoadError(f"LoRA adapter {name!r} from {path} cannot be loaded: {why}")
        folder, weight_name = (path, None) if os.path.isdir(path) else os.path.split(path)
        try:
            if path.startswith(TENSOR_SOURCE):
                assert given is not None, "checked above: this replica holds the tensors"
                state, metadata = given[1].state_dict(self.pipeline)
                expected = self._layers_in_file(dict(state))
                with adapter_metadata(self.pipeline, metadata):
                    self.pipeline.load_lora_weights(state, adapter_name=name)
            else:
                expected = self._layers_in_file(folder, weight_name=weight_name)
                self.pipeline.load_lora_weights(folder, weight_name=weight_name, adapter_name=name)
        except Exception as exc:  # noqa: BLE001 - any loader error is the file's
            self._delete(name)
            raise LoraLoadError(f"LoRA adapter {name!r} from {path} cannot be loaded: {exc}") from exc
        all_layers = self._layers()
        layers = {m: component for m, (component, _) in all_layers.items() if name in m.lora_A}
        problem = None
        if not layers:
            problem = "it targets no layer of this model"
        elif any(name in getattr(m, "lora_embedding_A", {}) for m in all_layers):
            problem = "it adapts embedding layers, which are not supported"
        elif short := {c: n for c, n in expected.items() if Counter(layers.values())[c] < n}:
            # Fewer layers than the file has: some target modules this model lacks. More is fine: diffusers adds
            # zero layers where a model has modules the adapter's base lacked (Wan text-to-video → image-to-video).
            loaded = Counter(layers.values())
            missed = ", ".join(f"{n - loaded[c]} of its {n} {c} layers" for c, n in short.items())
            problem = f"{missed} target modules this model does not have (is it for another model?)"
        elif any(module.use_dora.get(name, False) for module in layers):
            problem = "it is a DoRA adapter, which is not supported"
        elif unsupported := sorted({type(m).__name__ for m in layers if not isinstance(m, _per_row_layers())}):
            problem = f"it adapts {', '.join(unsupported)} layers; per-row deltas support linear and convolution layers"
        else:
            rank = max(module.r[name] for module in layers)
            if rank > self.max_lora_rank:
                problem = f"its rank {rank} is above --max-lora-rank {self.max_lora_rank}"
        if problem is not None:
            self._delete(name)
            raise LoraLoadError(f"LoRA adapter {name!r} from {path} cannot be served: {problem}")
        for module, (_, kind) in all_layers.items():
            self._hook(module, kind)
        for module in layers:
            module.enable_adapters(False)  # PEFT's forward returns the base output; the hook adds the deltas
            for adapter in (module.lora_A[name], module.lora_B[name]):
                if adapter.weight.dtype in _STORAGE_DTYPES:  # PEFT takes its base layer's dtype: fp8_storage's
                    adapter.to(self.dtype)
        logger.info("Loaded LoRA adapter %r from %s (%d layers)", name, path, len(layers))

    def unload(self, name: str) -> bool:
        """Evict adapter ``name`` if it is resident; whether it was."""
        if self.resident.pop(name, None) is None:
            return False
        if name in self._retired:
            self._retired.discard(name)
            self._tensors.pop(name, None)
        with self.lock, torch.inference_mode(False):
            self._delete(name)
        _release_freed_memory()
        logger.info("Evicted LoRA adapter %r", name)
        return True

    def retire(self, name: str, in_use: Iterable[str]) -> bool:
        """An adapter no longer served: evicted now if no request in flight uses it (then True), else made the
        next to evict."""
        if name in self._tensors:
            self._retired.add(name)
        if name not in in_use:
            evicted = self.unload(name)
            self._retired.discard(name)
            self._tensors.pop(name, None)
            return evicted
        if name in self.resident:
            self.resident.move_to_end(name, last=False)
        return False

    def _delete(self, name: str) -> None:
        for module in self._layers():
            if name in module.lora_A or name in getattr(module, "lora_magnitude_vector", {}):
                module.delete_adapter(name)
        for _, _, component in self.components():
            config = getattr(component, "peft_config", None)
            if config is not None:
                config.pop(name, None)

    def _layers(self) -> dict:
        """Every PEFT LoRA layer of the components, with its component's name and the row list it reads."""
        from peft.tuners.lora import LoraLayer

        return {m: (name, kind) for name, kind, c in self.components() for m in c.modules() if isinstance(m, LoraLayer)}

    def _layers_in_file(self, source: str | dict, **kwargs) -> Counter:
        """The layers an adapter file (or state dict) holds per component, as diffusers reads (and converts) it:
        each layer has one down (``lora_A``) matrix."""
        state = self.pipeline.lora_state_dict(source, **kwargs)
        state = state[0] if isinstance(state, tuple) else state  # some families add network alphas
        return Counter(key.split(".")[0] for key in state if key.rsplit(".", 2)[-2] in ("lora_A", "down"))

    def _hook(self, module, kind: str) -> None:
        if id(module) in self._hooked:
            return
        module.register_forward_hook(lambda layer, args, output: self._add_deltas(kind, layer, args[0], output))
        self._hooked.add(id(module))

    # Applying.

    @contextlib.contextmanager
    def rows(self, *, text: Sequence[Selection] | None = None, denoiser: Sequence[Selection] | None = None):
        """Apply each row's adapters to the calls made inside: ``text`` per prompt row of the text encoders,
        ``denoiser`` per latent row of the denoiser (all rows empty: the base model). The denoiser's calls hold
        `lock`: on CUDA an adapter loads on the encode worker while the loop thread runs the denoiser, and the
        text encoders run on that worker itself."""
        given = {kind: list(rows) for kind, rows in (("text", text), ("denoiser", denoiser)) if rows is not None}
        missing = {s.name for rows in given.values() for row in rows for s in row} - set(self.resident)
        if missing:
            raise RuntimeError(f"LoRA adapter(s) {', '.join(sorted(missing))} are not resident")
        with self.lock if denoiser is not None else contextlib.nullcontext():
            for kind, rows in given.items():
                self._plans[kind] = _RowPlan(rows) if any(rows) else None
            try:
                yield
            finally:
                for kind in given:
                    self._plans[kind] = None

    def _add_deltas(self, kind: str, layer, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        plan = self._plans[kind]
        if plan is None:
            return None
        for name, index, scales in plan.groups(x.shape[0], x.device, x.dtype):
            if name not in layer.lora_A:
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            inputs = x.to(lora_a.weight.dtype)
            if index is None:  # every row applies it at one scale: PEFT's own expression
                output = output + (lora_b(lora_a(inputs)) * (scales * layer.scaling[name])).to(output.dtype)
                continue
            delta = lora_b(lora_a(inputs.index_select(0, index))) * layer.scaling[name]
            delta = delta * scales.view(-1, *[1] * (delta.dim() - 1))
            output = output.index_add(0, index, delta.to(output.dtype))
        return output


class _RowPlan:
    """One call's row selections, grouped per adapter once per batch shape (each LoRA layer of the call reuses it)."""

    def __init__(self, rows: list[Selection]):
        self.rows = rows
        self.uniform = all(selection == rows[0] for selection in rows)
        self._groups: dict[tuple, list[tuple[str, torch.Tensor | None, Any]]] = {}

    def groups(self, n: int, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor | None, Any]]:
        """Per adapter: the rows of an ``n``-row input that apply it and their scales; ``None`` rows (and a float
        scale) when every row applies it alike."""
        key = (n, device, dtype)
        if key not in self._groups:
            self._groups[key] = self._group(n, device, dtype)
        return self._groups[key]

    def _group(self, n: int, device: torch.device, dtype: torch.dtype) -> list[tuple[str, torch.Tensor | None, Any]]:
        if self.uniform:
            return [(chosen.name, None, chosen.scale) for chosen in self.rows[0]]
        if n % len(self.rows):
            raise RuntimeError(
                f"a LoRA layer got {n} rows for {len(self.rows)} row selections: this call does not batch rows as "
                "the mixed-adapter forward expects"
            )
        picks: dict[str, list[tuple[int, float]]] = {}
        for i, selection in enumerate(self.rows * (n // len(self.rows))):
            for chosen in selection:
                picks.setdefault(chosen.name, []).append((i, chosen.scale))
        return [
            (
                name,
                torch.tensor([i for i, _ in rows], device=device),
                torch.tensor([scale for _, scale in rows], device=device, dtype=dtype),
            )
            for name, rows in picks.items()
        ]


class LoraExtension(Extension):
    """LoRA as an extension (`vllm_omni.diffusion.pipeline.extensions`): the stage's adapters, made and loaded
    (``lora_modules``) when the pipeline loads, and each row's adapters around a request-mode call (step mode's
    stepper applies them around each forward)."""

    name = "lora"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.stage = od_config.stage
        self.dtype = dtype
        self.adapters: LoraAdapters | None = None
        """The LoRA adapters resident in the pipeline; ``None`` when the stage serves none."""

    def on_load(self, pipeline: Any, variant: bool) -> None:
        if variant or not self.stage.lora_enabled:  # a variant shares the loaded pipeline's modules and adapters
            return
        self.adapters = LoraAdapters(pipeline, self.stage.max_loras, self.stage.max_lora_rank, self.dtype)
        for module in self.stage.lora_modules:  # each is checked now; the last max_loras stay resident
            self.adapters.load(module.name, module.path)

    def load_adapters(self, requests: Iterable[DiffusionRequest], keep: Iterable[str] = ()) -> None:
        """Make the adapters of ``requests`` resident, evicting only adapters outside ``keep`` (those of the
        requests in flight) and theirs."""
        wanted = {s.name: s.path for request in requests for s in request.params.lora}
        if wanted:
            assert self.adapters is not None, "requests name adapters only where the stage serves them"
            protected = set(keep) | set(wanted)
            for name, path in wanted.items():
                assert path is not None, "the engine sets an adapter's path when it admits the request"
                self.adapters.load(name, path, protected)

    def around_call(self, call: PipelineCall) -> contextlib.AbstractContextManager[None]:
        if self.adapters is None:
            return contextlib.nullcontext()
        # the prompt rows of the text encoders, the latent rows of the denoiser
        text = [r.params.lora for r in call.batch for _ in range(call.rows)]
        return self.adapters.rows(text=text, denoiser=[r.params.lora for r in call.batch for _ in range(call.n)])


@handler("load_lora")
def load_lora(core, name: str, path: str, tensors: LoraTensors | None = None) -> Future:
    """Load adapter ``name`` from ``path`` on the engine's thread at the next boundary (it checks the file, and
    evicts only adapters no request in flight uses); the future fails with `LoraLoadError` naming the file.
    ``tensors``: an adapter given as tensors, ``path`` its source tag (`LoraAdapters.load`)."""
    lora = _adapters(core)

    def load() -> None:
        if core.sleeper.dropped:  # PEFT would make the adapter's layers on the meta device, and lose it
            raise ValueError(f"this replica sleeps at level 2 (its weights dropped): wake it up to load {name!r}")
        lora.load(name, path, keep=core.scheduler.adapters_in_use(), tensors=tensors)

    return core.scheduler.call(load)


@handler("unload_lora")
def unload_lora(core, name: str) -> Future:
    """Evict adapter ``name`` at the next boundary, or, while a request in flight uses it, make it the next to
    evict (`LoraAdapters.retire`); the future holds whether it was evicted now."""
    lora = _adapters(core)
    return core.scheduler.call(lambda: lora.retire(name, core.scheduler.adapters_in_use()))


def _adapters(core) -> LoraAdapters:
    if core.runner.lora is None:
        raise RuntimeError(f"stage {core.od_config.stage.stage_id} serves no LoRA adapters")
    return core.runner.lora
