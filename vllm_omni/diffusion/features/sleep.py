"""Sleep and wake of one engine's pipeline (vLLM's levels and tags): `PipelineSleep` moves its weights off the
accelerator or drops them, and brings them back; the control verbs ``sleep``, ``wake_up`` and ``is_sleeping``
(`EngineCore.call`, at the end of this module) pause the batch scheduler around it.

- Level 0: nothing moves; the engine only stops starting requests.
- Level 1: every tensor of the pipeline's torch modules (transformer or UNet, text encoders, VAE) moves to CPU
  memory. On a CPU stage, and under ``cpu_offload``, they are in CPU memory already, so nothing moves.
- Level 2: every parameter and persistent buffer becomes a ``meta`` tensor of the same shape and dtype, so its
  memory is freed. `wake_up` reloads from the model's files what is still ``meta`` then (a weight that
  `update_weights` set meanwhile is not read again). Kept: non-persistent buffers (no file holds them: position
  ids, rotary tables) and the tensors of LoRA adapters, moved to CPU memory as at level 1.

Tensors are replaced in place (`torch.utils.swap_tensors`), so every holder of a parameter (tied weights, a
from_pipe variant, a LoRA layer) sees the change, and what it held is freed. All of it runs on the engine's thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from vllm_omni.diffusion.engine.control import done, handler
from vllm_omni.errors import SleepModeError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

SLEEP_LEVELS = (0, 1, 2)
"""vLLM's levels: 0 pauses only, 1 moves the weights to CPU memory, 2 drops them."""
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
"""vLLM's wake-up tags. A diffusion engine keeps no KV cache: ``kv_cache`` restores nothing, and is there so that
a client's two-phase wake-up (``weights``, then ``kv_cache``) works as on vLLM."""
_MEMORY_TAGS = frozenset({"weights", "kv_cache"})
"""What a sleep of level 1 or 2 puts to sleep; the engine serves again once none is asleep."""


def check_level(level: object, cpu_offload: str = "none", quantization: str = "none", load_format: str = "auto") -> int:
    """``level`` if it is one of `SLEEP_LEVELS`, else `SleepModeError` naming the allowed values (and level 2 under
    sequential CPU offload, whose hooks hold the weights where it cannot drop them, of a GGUF model, whose
    denoiser has no safetensors files to reload from, or of random weights, ``load_format`` ``dummy``, which no file
    holds)."""
    if not isinstance(level, int) or isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise SleepModeError("level", f"level must be one of {', '.join(map(str, SLEEP_LEVELS))}; got {level!r}")
    if level == 2 and cpu_offload == "sequential":
        raise SleepModeError(
            "level", "level 2 cannot drop weights that cpu_offload='sequential' holds in its hooks; use level 1"
        )
    if level == 2 and quantization == "gguf":
        raise SleepModeError(
            "level",
            "level 2 drops the weights and wake_up reloads them from each component's safetensors files; the GGUF "
            "denoiser (quantization 'gguf') has none, only its .gguf file's quantized blocks: use level 1",
        )
    if level == 2 and load_format == "dummy":
        raise SleepModeError(
            "level",
            "level 2 drops the weights and wake_up reloads them from the model's files; load_format 'dummy' made "
            "random ones that no file holds: use level 1",
        )
    return level


def check_tags(tags: Iterable[str] | None) -> list[str] | None:
    """``tags`` as a list (``None``: every tag), or `SleepModeError` naming the allowed values."""
    if tags is None:
        return None
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown:
        raise SleepModeError("tags", f"tags must be among {', '.join(WAKE_TAGS)}; got {unknown[0]!r}")
    return tags


class _Tensor:
    """One parameter or buffer of a component: its names (tied weights: several; the first names it), whether the
    model's files hold it (non-persistent buffers are not), and each ``(module's dict, key)`` that holds it."""

    def __init__(self, name: str, tensor: torch.Tensor, stored: bool):
        self.name, self.tensor, self.stored = name, tensor, stored
        self.names: list[str] = []
        self.holders: list[tuple[dict, str]] = []

    def replace(self, value: torch.Tensor) -> None:
        """Hold ``value`` instead, across devices (``meta`` too, which ``.data =`` refuses), in place
        (``torch.utils.swap_tensors``): every holder sees it, and the old memory is freed. Where torch cannot swap
        (a weak reference to it), each holder takes a new tensor."""
        tensor = self.tensor
        if isinstance(tensor, torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=tensor.requires_grad)
        try:
            torch.utils.swap_tensors(tensor, value)
        except RuntimeError:
            for holder, key in self.holders:
                holder[key] = value
            self.tensor = value


def _tensors(module: torch.nn.Module) -> dict[str, _Tensor]:
    """Each parameter and buffer of ``module`` once, by its first name."""
    found: dict[int, _Tensor] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        entries = [(owner._parameters, n, True) for n in owner._parameters]
        entries += [(owner._buffers, n, n not in owner._non_persistent_buffers_set) for n in owner._buffers]
        for holder, key, stored in entries:
            tensor = holder[key]
            if tensor is not None:
                entry = found.setdefault(id(tensor), _Tensor(dot + key, tensor, stored))
                entry.names.append(dot + key)
                entry.holders.append((holder, key))
    return {entry.name: entry for entry in found.values()}


def _adapter_tensors(module: torch.nn.Module) -> set[int]:
    """The ids of the LoRA adapters' tensors (PEFT's adapter layers): no file of the model holds them."""
    ids: set[int] = set()
    for owner in module.modules():
        for attr in getattr(owner, "adapter_layer_names", ()):
            container = getattr(owner, attr, None)
            if isinstance(container, torch.nn.Module):
                ids.update(id(t) for t in container.parameters())
                ids.update(id(t) for t in container.buffers())
    return ids


def _file_key(name: str) -> str:
    """A parameter's name in the model's files (PEFT wraps a layer with a LoRA adapter as ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def _release_freed_memory(device: torch.device) -> None:
    """Give freed memory back: the CUDA allocator's cache, and glibc's free heap pages (tensors below its mmap
    threshold live on the heap, which ``free`` keeps)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PipelineSleep:
    """The sleep state of one pipeline (module docstring); every method runs on the engine's thread."""

    def __init__(self, pipeline, model: str, device: torch.device, cpu_offload: str = "none"):
        """``model``: the diffusers folder it was loaded from; ``device``: the stage's. Its weights live there while
        awake, or in CPU memory under ``cpu_offload``."""
        self.pipeline, self.model = pipeline, model
        self.home = device if cpu_offload == "none" else torch.device("cpu")
        self.level: int | None = None
        """The level it sleeps at; ``None`` awake."""
        self.asleep: set[str] = set()
        """The `WAKE_TAGS` of memory asleep (``weights``, ``kv_cache``)."""
        self._dropped: dict[str, list[str]] = {}
        """The names of the tensors that level 2 dropped, by component."""

    @property
    def dropped(self) -> bool:
        """Whether level 2 dropped weights that `wake_up` has not reloaded yet."""
        return bool(self._dropped)

    def components(self) -> dict[str, torch.nn.Module]:
        return {n: c for n, c in self.pipeline.components.items() if isinstance(c, torch.nn.Module)}

    def sleep(self, level: int) -> None:
        """Sleep at ``level`` (a deeper level than the current one goes deeper; a shallower one changes nothing)."""
        if self.level is not None and level <= self.level:
            return
        self.level = level
        if level == 0:
            return
        self.asleep |= _MEMORY_TAGS
        for name, module in self.components().items():
            keep = _adapter_tensors(module) if level == 2 else set()
            for entry in _tensors(module).values():
                tensor = entry.tensor
                if tensor.is_meta:
                    continue
                if level == 2 and entry.stored and id(tensor) not in keep:
                    entry.replace(torch.empty_like(tensor, device="meta"))
                    self._dropped.setdefault(name, []).append(entry.name)
                elif tensor.device.type != "cpu":
                    entry.replace(tensor.to("cpu"))
        _release_freed_memory(self.home)
        dropped = sum(len(names) for names in self._dropped.values())
        logger.info("Asleep at level %d (%d tensors dropped)", level, dropped)

    def wake_up(self, tags: list[str] | None) -> bool:
        """Wake the memory of ``tags`` (``None``: all): ``weights`` reloads what level 2 dropped and is still
        ``meta``, and moves the weights home. Returns whether no memory sleeps any more."""
        if "weights" in self.asleep and (tags is None or "weights" in tags):
            self._reload()
            self._move_home()
        self.asleep -= _MEMORY_TAGS if tags is None else set(tags)
        if not self.asleep:
            self.level = None
        return not self.asleep

    def _move_home(self) -> None:
        if self.home.type == "cpu":
            return
        for module in self.components().values():
            for entry in _tensors(module).values():
                if not entry.tensor.is_meta and entry.tensor.device != self.home:
                    entry.replace(entry.tensor.to(self.home))

    def _reload(self) -> None:
        """Each dropped tensor still ``meta`` from its component's safetensors files; what they lack (a key they
        name otherwise) from the component's ``from_pretrained``."""
        for name, dropped in list(self._dropped.items()):
            module = self.components()[name]
            # By their names in the files: a layer PEFT wrapped since (``base_layer``) is found too.
            by_key = {_file_key(n): entry for entry in _tensors(module).values() for n in entry.names}
            found = (by_key.get(_file_key(n)) for n in dropped)
            entries = list({id(e): e for e in found if e is not None and e.tensor.is_meta}.values())
            wanted = {_file_key(n): entry for entry in entries for n in entry.names}
            folder = os.path.join(self.model, name)
            for key, value in _read_safetensors(folder, list(wanted)):
                self._load(wanted[key], value)
            missing = [entry for entry in entries if entry.tensor.is_meta]
            if missing:
                model_class: Any = type(module)  # a diffusers or transformers model: both have from_pretrained
                fresh = _tensors(model_class.from_pretrained(folder, local_files_only=True))
                values = {_file_key(n): entry.tensor for entry in fresh.values() for n in entry.names}
                for entry in missing:
                    in_model = next((_file_key(n) for n in entry.names if _file_key(n) in values), None)
                    if in_model is None:
                        raise RuntimeError(f"wake_up: {name}.{entry.name} is in neither {folder}'s files nor its model")
                    self._load(entry, values[in_model])
                del fresh, values
            del self._dropped[name]
            logger.info("Reloaded %d dropped tensors of %s from %s", len(entries), name, folder)

    def _load(self, entry: _Tensor, value: torch.Tensor) -> None:
        """A dropped tensor from ``value`` (read from the files), in its own dtype, on the home device."""
        if entry.tensor.is_meta:
            entry.replace(value.to(device=self.home, dtype=entry.tensor.dtype).contiguous())


def _read_safetensors(folder: str, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``keys`` that the folder's safetensors files hold (not a variant's: ``*.fp16.safetensors``), read one by
    one."""
    from safetensors import safe_open

    if not keys or not os.path.isdir(folder):
        return
    remaining = set(keys)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors") and f.count(".") == 1)
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt", device="cpu") as f:
            for key in remaining.intersection(f.keys()):
                remaining.discard(key)
                yield key, f.get_tensor(key)


@handler("sleep")
def sleep(core, level: int = 1) -> Future:
    """Sleep at ``level`` (`PipelineSleep`) once the requests in progress have finished: from then on no request
    starts (those that arrive wait) until `wake_up`; calls still run. The future is done once it sleeps."""
    stage = core.od_config.stage
    check_level(level, stage.cpu_offload, stage.quantization, stage.load_format)
    core.runner.refuse("sleep", level)  # the extensions' refusals: a replica of ranks, quantized weights
    return core.scheduler.call(lambda: _sleep(core, level), drain=True)


def _sleep(core, level: int) -> None:
    core.scheduler.pause(True)
    core.sleeper.sleep(level)


@handler("wake_up")
def wake_up(core, tags: list[str] | None = None) -> Future:
    """Wake the memory of ``tags`` (``None``: all; `WAKE_TAGS`) on the engine's thread, after a sleep that is
    still to run; requests start again once no memory sleeps. The future holds whether it serves again."""
    tags = check_tags(tags)
    return core.scheduler.call(lambda: _wake_up(core, tags), drain=True)


def _wake_up(core, tags: list[str] | None) -> bool:
    awake = core.sleeper.wake_up(tags)
    if awake and core.scheduler.paused:
        core.scheduler.pause(False)
    return awake


@handler("is_sleeping")
def is_sleeping(core) -> Future:
    """Whether it sleeps (takes requests, starts none), answered at once."""
    return done(core.scheduler.paused)
