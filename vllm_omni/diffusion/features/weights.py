"""New weights for a loaded pipeline's component, applied on the engine's thread (the control verb
``update_weights``, `EngineCore.call`), and `WeightUpdateGroup`, the torch.distributed group a trainer broadcasts
them over (``init_weight_update_group``, ``update_weights_from_distributed``; docs/rl.md, "Weight updates"). The
verbs' handlers are at the end of this module.

An update names its tensors as the component's ``state_dict()`` does. Every tensor is checked against the parameter
or buffer it replaces (its name, its shape) before the first is copied, so an update is applied whole or not at
all; each is cast to the dtype and device of what it replaces. One that ``sleep(level=2)`` dropped (a tensor on the
``meta`` device of the same shape and dtype) is materialised from the update instead, in place
(``torch.utils.swap_tensors``: modules, tied weights and hooks keep the same object).
"""

from __future__ import annotations

import datetime
import difflib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from vllm_omni.diffusion.engine.control import handler
from vllm_omni.diffusion.features.gguf import is_gguf_module
from vllm_omni.errors import WeightUpdateError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""What ``update_weights`` takes: a mapping, or an iterable of (name as in the component's ``state_dict()``,
tensor)."""


class WeightsApplied(NamedTuple):
    """What a replica answers to an applied update."""

    version: int
    """Its weights version from now on (every output it makes reports it)."""
    complete: bool
    """Whether the update replaced every tensor of the component's ``state_dict()``."""


def as_weights(weights: Weights) -> dict[str, torch.Tensor]:
    """``weights`` as one dict, read once (an iterator may be consumed only once, and every replica takes the same);
    a name given twice is refused."""
    items: list[tuple[Any, ...]]
    if isinstance(weights, Mapping):
        items = list(weights.items())
    elif isinstance(weights, (str, bytes, torch.Tensor)):
        raise WeightUpdateError(None, f"weights are a mapping or (name, tensor) pairs, not a {type(weights).__name__}")
    else:
        items = [tuple(item) for item in weights]
    out: dict[str, torch.Tensor] = {}
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str):
            raise WeightUpdateError(None, f"weights are (name, tensor) pairs; got {item!r:.80}")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(name, f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in out:
            raise WeightUpdateError(name, f"weight {name!r} is given twice")
        out[name] = tensor
    if not out:
        raise WeightUpdateError(None, "the update holds no weights")
    return out


def pipeline_components(pipeline) -> tuple[str, ...]:
    """The pipeline's torch components (what an update may name): its loaded ``nn.Module``s."""
    return tuple(name for name, value in pipeline.components.items() if isinstance(value, torch.nn.Module))


def component_of(pipeline, component: str) -> torch.nn.Module:
    module = getattr(pipeline, component, None)
    if not isinstance(module, torch.nn.Module):
        held = ", ".join(pipeline_components(pipeline))
        raise WeightUpdateError(None, f"this stage's pipeline holds no component {component!r}; it holds: {held}")
    return module


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s ``state_dict`` entries (the tensors themselves) by the names diffusers gives them: a layer that
    PEFT wrapped for a LoRA adapter keeps its name (``to_q.weight``, not ``to_q.base_layer.weight``), and the
    adapters' own tensors are left out (an update replaces the model's weights, not an adapter's)."""
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if not any(part.startswith("lora_") for part in name.split("."))
    }


def check_weights(module: torch.nn.Module, weights: Mapping[str, torch.Tensor], component: str) -> dict:
    """What each of ``weights`` replaces in ``module`` (`named_tensors`), or `WeightUpdateError` naming the first
    unknown name (and the closest known one) or wrong shape, or a GGUF-quantized ``module``."""
    if is_gguf_module(module):
        raise WeightUpdateError(
            None,
            f"{component} is GGUF-quantized (loaded from a .gguf file): its weights are the file's quantized blocks, "
            "which an update cannot replace; serve the base model's diffusers folder to update them",
        )
    targets = named_tensors(module)
    for name, tensor in weights.items():
        target = targets.get(name)
        if target is None:
            close = difflib.get_close_matches(name, list(targets), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise WeightUpdateError(name, f"{component} has no parameter {name!r}{hint}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightUpdateError(
                name,
                f"{component}.{name} has shape {list(target.shape)}; the update gives {list(tensor.shape)}",
            )
    return targets


def apply_weights(
    module: torch.nn.Module, weights: Mapping[str, torch.Tensor], component: str, device: torch.device | str
) -> bool:
    """Check all of ``weights`` (`check_weights`), then copy them into ``module``; whether they replaced every
    entry of its ``state_dict``. A dropped (meta) tensor is materialised on ``device``."""
    targets = check_weights(module, weights, component)
    with torch.no_grad():
        for name, tensor in weights.items():
            target = targets[name]
            if not target.is_meta:
                target.copy_(tensor)  # casts to its dtype and device
                continue
            _materialise(module, name, target, tensor.to(device=device, dtype=target.dtype, copy=True))
    return set(weights) >= set(targets)


def _materialise(module: torch.nn.Module, name: str, target: torch.Tensor, data: torch.Tensor) -> None:
    """Replace the meta tensor ``target`` (``module``'s ``name``) with ``data``, keeping its object where torch can."""
    new = (
        torch.nn.Parameter(data, requires_grad=target.requires_grad) if isinstance(target, torch.nn.Parameter) else data
    )
    try:
        torch.utils.swap_tensors(target, new)
    except RuntimeError:  # other references to it (weakrefs): the modules that hold it take the new tensor instead
        for owner in module.modules():
            holders: list[dict[str, Any]] = [owner._parameters, owner._buffers]  # new is a Parameter where target is
            for holder in holders:
                for key, value in holder.items():
                    if value is target:
                        holder[key] = new


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise WeightUpdateError(None, f"{dtype!r} is not a torch dtype")
    return value


class WeightUpdateGroup:
    """One member of a torch.distributed group between a trainer and the replicas it updates (vLLM's RLHF
    pattern): the trainer joins with the rank it chose (usually 0), each replica with ``rank_offset + i``.

    The group is made from its own ``TCPStore`` at ``master_address:master_port`` (rank 0 hosts it), never from the
    process's default group: a trainer with a torch.distributed world of its own, and several replicas in one
    process, each join as a separate member. gloo on the CPU, NCCL on CUDA (``backend`` overrides; every member
    must use the same). Joining blocks until all ``world_size`` members have joined.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        timeout_s: float = 600.0,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of world_size {world_size}")
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        self._store = store  # rank 0 serves it as long as the group lives
        prefixed = dist.PrefixStore("vllm-omni-weights", store)
        self._group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"backend {self.backend!r}: use 'gloo' or 'nccl'")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Send ``tensor`` from rank ``src`` to every member (each passes a tensor of the same shape and dtype on
        the group's device, which receives it in place); returns it."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        # torch's stubs declare broadcast on ProcessGroup alone; its backends (Gloo, NCCL) have it too
        self._group.broadcast([tensor], options).wait()  # type: ignore[union-attr]
        return tensor

    def receive(self, names_dtypes_shapes: Iterable[tuple[str, Any, Any]], src: int = 0) -> dict[str, torch.Tensor]:
        """One broadcast from ``src`` per ``(name, dtype, shape)``, in order, each into a new tensor."""
        return {
            name: self.broadcast(torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=self.device), src)
            for name, dtype, shape in names_dtypes_shapes
        }


@handler("update_weights")
def update_weights(core, weights: dict, component: str) -> Future:
    """Apply ``weights`` to ``component`` on the engine's thread once the requests in progress have finished,
    before any other starts (a batch finishes on the weights it started with); the future holds
    `WeightsApplied`, or fails with `WeightUpdateError` and nothing applied."""
    return core.scheduler.call(lambda: _apply(core, weights, component), drain=True)


@handler("init_weight_update_group")
def init_weight_update_group(
    core, master_address: str, master_port: int, rank: int, world_size: int, backend: str | None = None
) -> Future:
    """Join a trainer's `WeightUpdateGroup` as ``rank`` (gloo, or NCCL on CUDA), replacing any earlier group. It
    joins on a thread of its own: joining blocks until every member has joined, and it runs no tensor op, so the
    engine keeps serving meanwhile; the future resolves once it has joined."""
    future: Future = Future()
    device = "cpu" if backend == "gloo" else core.runner.device

    def join() -> None:
        try:
            core.weight_group = WeightUpdateGroup(
                master_address, master_port, rank, world_size, device=device, backend=backend
            )
        except BaseException as exc:  # noqa: BLE001 - the caller's future says why
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=join, name=f"vllm-omni-weight-group-{core.od_config.replica}", daemon=True).start()
    return future


@handler("update_weights_from_distributed")
def update_weights_from_distributed(core, names_dtypes_shapes: list, component: str, src: int) -> Future:
    """`update_weights` with tensors received from rank ``src`` of the weight group, one broadcast each, on the
    engine's thread once it has drained. Every broadcast is received before anything is checked, so the
    trainer's broadcasts complete even when the update is refused."""

    def receive() -> WeightsApplied:
        if core.weight_group is None:
            raise WeightUpdateError(None, "this replica has not joined a group: call init_weight_update_group")
        return _apply(core, core.weight_group.receive(names_dtypes_shapes, src), component)

    return core.scheduler.call(receive, drain=True)


def _apply(core, weights: dict, component: str) -> WeightsApplied:
    core.runner.refuse("update_weights", component)  # the extensions': a replica of ranks, quantized weights
    if core.od_config.stage.cpu_offload == "sequential":
        raise WeightUpdateError(
            None, "cpu_offload='sequential' keeps the weights in accelerate's hooks: serve with 'model' or 'none'"
        )
    module = component_of(core.runner.pipeline, component)
    # A dropped weight comes back where its component's weights are now: in CPU memory while they sleep.
    home = "cpu" if "weights" in core.sleeper.asleep else core.sleeper.home
    complete = apply_weights(module, weights, component, home)
    core.weights_version += 1
    logger.info("Applied %d tensors to %s: weights version %d", len(weights), component, core.weights_version)
    return WeightsApplied(core.weights_version, complete)
