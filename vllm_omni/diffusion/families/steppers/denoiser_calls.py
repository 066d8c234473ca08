"""The denoiser calls of many requests' modular blocks, made one forward
(`vllm_omni.diffusion.families.steppers.modular`): each group's blocks call `DenoiserCalls` instead of the denoiser,
and `batched` groups the recorded calls whose arguments can be concatenated row-wise. The loop inputs and the decoder
blocks' inputs of many requests are put together the same way."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


class DenoiserCalls:
    """Stands in for the denoiser in one pass of a group's loop sub-blocks (`modular.ModularStepper.predict`): while
    recording, each call's arguments are kept and answered with zeros shaped like its input (or, with ``answer``,
    with its own forward at once); then each call is answered with its rows of the batched forward, in the order it
    was made. Other attributes are the denoiser's."""

    def __init__(self, denoiser: torch.nn.Module, input_name: str, signature: inspect.Signature | None = None):
        self._denoiser, self._input = denoiser, input_name
        self._signature = signature or inspect.signature(denoiser.forward)
        """Its forward's, to name positional arguments (given: found once by the stepper, not per group and step)."""
        self.calls: list[dict[str, Any]] = []
        self.answers: list[Any] | None = None
        self.answer: Callable[[dict[str, Any]], Any] | None = None
        """Where set, what answers each call as it is recorded (its forward): the pass is the only one."""

        def forward(*args: Any, **kwargs: Any) -> tuple[Any]:
            return self(*args, **kwargs)

        # Qwen-Image's loop reads inspect.signature(transformer.forward) at every step: the denoiser's, found once
        # (a bound method's is found again at each call: about 0.1 ms on the CPU).
        forward.__signature__ = self._signature  # type: ignore[attr-defined]
        self.forward = forward
        """Called as the denoiser is (its calls recorded), with the denoiser's signature."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._denoiser, name)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any]:
        if args:  # a UNet's blocks pass its sample and timestep by position: recorded by name
            kwargs = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        if self.answers is None:
            x = kwargs[self._input]
            for name in _TIMESTEPS:  # one timestep for the call's rows (UNet): each row's, to batch other steps
                if isinstance(kwargs.get(name), torch.Tensor) and kwargs[name].dim() == 0:
                    kwargs[name] = kwargs[name].expand(len(x))
            self.calls.append(kwargs)
            if self.answer is not None:
                return (self.answer(kwargs),)
            return ([torch.zeros_like(e) for e in x] if isinstance(x, list) else torch.zeros_like(x),)
        return (self.answers.pop(0),)


_TIMESTEPS = ("timestep", "t")
"""The denoisers' timestep arguments, which take one value per row as well as one for the whole call."""


def _rows(value: Any, n: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and len(value) == n
    return isinstance(value, list) and len(value) == n


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.equal(b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _joins(value: Any, n: int, other: Any, m: int) -> bool:
    """Whether argument ``value`` of a call of ``n`` rows can be put together with ``other`` of one of ``m``: per-row
    tensors of the same trailing shape and dtype, per-row lists, dicts (UNet's ``added_cond_kwargs``) key by key,
    and any other argument equal."""
    if isinstance(value, dict) and isinstance(other, dict):
        return value.keys() == other.keys() and all(_joins(value[k], n, other[k], m) for k in value)
    if _rows(value, n) and _rows(other, m):
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
            return value.shape[1:] == other.shape[1:] and value.dtype == other.dtype
        return not isinstance(value, torch.Tensor) and not isinstance(other, torch.Tensor)
    return _same(value, other)


def _masked(call: dict[str, Any]) -> set[str]:
    """The arguments of ``call`` that come with a ``<name>_mask`` (Qwen-Image's text embeddings), and their masks:
    these may be padded along their second dimension, as the stock pipelines pad a batch of prompts."""
    names = {
        n for n, v in call.items() if isinstance(v, torch.Tensor) and isinstance(call.get(f"{n}_mask"), torch.Tensor)
    }
    return names | {f"{name}_mask" for name in names}


def _call_joins(call: dict[str, Any], n: int, other: dict[str, Any], m: int) -> bool:
    if call.keys() != other.keys():
        return False
    masked = _masked(call)
    for name, value in call.items():
        if name in masked and name in _masked(other):
            if value.shape[2:] != other[name].shape[2:] or value.dtype != other[name].dtype:
                return False
        elif not _joins(value, n, other[name], m):
            return False
    return True


def batched(calls: list[dict[str, Any]], input_name: str) -> list[list[int]]:
    """The recorded ``calls`` in groups that can share one forward (indices, in order)."""
    groups: list[list[int]] = []
    for index, call in enumerate(calls):
        n = len(call[input_name])
        group = next((g for g in groups if _call_joins(call, n, calls[g[0]], len(calls[g[0]][input_name]))), None)
        if group is None:
            groups.append([index])
        else:
            group.append(index)
    return groups


def joined(calls: list[dict[str, Any]], counts: list[int]) -> dict[str, Any]:
    """The arguments of one forward for a group of ``calls`` (``counts`` rows each): masked arguments padded with
    zeros (masked out) to the longest, then each argument put together (`concat_rows`)."""
    masked = _masked(calls[0])
    longest = {name: max(call[name].shape[1] for call in calls) for name in masked}
    padded = [
        {
            name: torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, longest[name] - value.shape[1]))
            if name in masked
            else value
            for name, value in call.items()
        }
        for call in calls
    ]
    return {name: concat_rows([call[name] for call in padded], counts) for name in calls[0]}


def concat_rows(values: list[Any], counts: list[int]) -> Any:
    """One argument of a group's calls (``counts`` rows each) as one forward takes it: per-row tensors and lists
    concatenated, any other argument (equal across the group) once."""
    first = values[0]
    if isinstance(first, dict):
        return {k: concat_rows([value[k] for value in values], counts) for k in first}
    if not _rows(first, counts[0]):
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    return [row for value in values for row in value]
