"""CFG-parallel (``cfg_parallel_size`` 2): the conditional and unconditional denoiser calls of classifier-free
guidance run at once on two ranks, each rank running the whole pipeline.

The pipelines that guide with two denoiser calls per step (Flux's and Qwen-Image's true CFG, Wan) name them with
diffusers' ``cache_context("cond")`` and ``cache_context("uncond")``, the cond call first. A `CfgParallelHook` on
each denoiser reads that name: rank 0 computes the cond call and answers the uncond one with rank 1's; rank 1
answers the cond call with a zero tensor that it fills in place with rank 0's prediction when the two exchange, at
the uncond call, which it computes. The pipeline then combines the two as it always does, the same on both ranks, so
their latents stay equal.

The pipelines that guide with one denoiser call over both branches (SD3, SD, SDXL: the unconditional rows, then the
conditional ones, outside any ``cache_context``; LTX: in ``cache_context("cond_uncond")``) are split by rows
instead: each rank computes half the call's rows (rank 0 the first half: the unconditional branch) and the two
``all_gather`` the halves, so both return the whole prediction. The rows of a denoiser call are independent, so this
holds for any call of an even batch; a call of an odd batch runs whole on both ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

HOOK = "vllm_omni_cfg_parallel"


class _NoState(BaseState):
    """The hook keeps no state per context; its `StateManager` only learns which call runs."""

    def reset(self, *args, **kwargs) -> None:
        pass


class CfgParallelHook(ModelHook):
    """The cond / uncond split of one denoiser over a group of two ranks (this process is ``rank``)."""

    _is_stateful = True  # so that ``cache_context`` tells its StateManager the call's name

    def __init__(self, rank: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.rank = rank
        self.group = group
        """The two ranks' process group (``None``: the default one, of two ranks)."""
        # diffusers annotates state_cls as a BaseState instance; it takes (and instantiates) the class.
        self.calls = StateManager(_NoState)  # type: ignore[arg-type]
        self._cond: torch.Tensor | None = None
        """Rank 0: the cond prediction it computed; rank 1: the zeros it answered the cond call with."""

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.calls.reset()
        self._cond = None
        return module

    def _original_forward(self, *args, **kwargs) -> Any:
        """The denoiser's own forward (diffusers types ``original_forward`` as None, its value before the hook is
        registered)."""
        return cast(Callable[..., Any], self.fn_ref.original_forward)(*args, **kwargs)

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        try:
            name = self.calls.context.name
        except ValueError:  # no cache_context around this call
            name = None
        if name == "cond":
            if self.rank == 0:
                output = self._original_forward(*args, **kwargs)
                self._cond = _sample(output)
                return output
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self._cond = torch.zeros_like(hidden)  # the denoisers here predict in their input's shape
            return _with_sample(self._cond, kwargs.get("return_dict", True))
        if name in (None, "cond_uncond"):  # one call over both branches (LTX names it)
            return self._by_rows(args, kwargs)
        if name != "uncond":
            return self._original_forward(*args, **kwargs)
        if self._cond is None:
            raise RuntimeError("cfg_parallel_size 2: an uncond denoiser call came before its cond call")
        output = self._original_forward(*args, **kwargs) if self.rank == 1 else None
        mine = self._cond if self.rank == 0 else _sample(output)
        if mine.shape != self._cond.shape:
            raise RuntimeError(
                f"cfg_parallel_size 2: the denoiser's prediction {tuple(mine.shape)} is not of its input's shape "
                f"{tuple(self._cond.shape)}, which rank 1 answers the cond call with"
            )
        both = [torch.empty_like(mine), torch.empty_like(mine)]
        dist.all_gather(both, mine.contiguous(), group=self.group)
        cond, uncond = both
        if self.rank == 0:
            self._cond = None
            return _with_sample(uncond, kwargs.get("return_dict", True))
        self._cond.copy_(cond)  # the tensor the pipeline holds as its cond prediction
        self._cond = None
        return output

    def _by_rows(self, args: tuple, kwargs: dict):
        """One call over both branches: this rank's half of the rows, then both halves from the exchange."""
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0 or hidden.shape[0] % 2:
            return self._original_forward(*args, **kwargs)
        rows, half = hidden.shape[0], hidden.shape[0] // 2
        mine = slice(self.rank * half, (self.rank + 1) * half)
        output = self._original_forward(*_rows(args, rows, mine), **_rows(kwargs, rows, mine))
        sample = _sample(output).contiguous()
        both = [torch.empty_like(sample), torch.empty_like(sample)]
        dist.all_gather(both, sample, group=self.group)
        return _with_sample(torch.cat(both), kwargs.get("return_dict", True))


def _rows(value, rows: int, mine: slice):
    """``value`` with each tensor of ``rows`` rows (in tuples, lists and dicts too: SDXL's ``added_cond_kwargs``)
    cut to the rows ``mine``; anything else (a scalar timestep, token ids without a batch) as it is."""
    if isinstance(value, torch.Tensor):
        return value[mine] if value.dim() > 0 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {key: _rows(item, rows, mine) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(item, rows, mine) for item in value)
    return value


def _sample(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(sample: torch.Tensor, return_dict: bool):
    if not return_dict:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def enable_cfg_parallel(denoisers: list[torch.nn.Module], rank: int, group: dist.ProcessGroup | None = None) -> None:
    """Split the cond and uncond calls of each denoiser over two ranks: those of ``group`` (the initialized process
    group by default), this process being ``rank`` of them. Registered after diffusers' context parallelism, whose
    hooks then run inside this one: each branch's call is split over its own context-parallel ranks."""
    if dist.get_world_size(group) != 2:
        raise ValueError(f"cfg_parallel_size 2 runs on a group of 2 ranks, not {dist.get_world_size(group)}")
    for denoiser in denoisers:
        HookRegistry.check_if_exists_or_initialize(denoiser).register_hook(CfgParallelHook(rank, group), HOOK)
