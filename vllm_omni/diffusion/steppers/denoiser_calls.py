"""The denoiser calls of many requests' modular blocks, made one forward (`vllm_omni.diffusion.steppers.modular`):
each request's blocks call `DenoiserCalls` instead of the denoiser, and `batched` groups the recorded calls whose
arguments can be concatenated row-wise."""

from __future__ import annotations

from typing import Any

import torch


class DenoiserCalls:
    """Stands in for the denoiser in one request's loop sub-blocks (`modular.ModularStepper.predict`): while recording,
    each call's arguments are kept and answered with zeros shaped like its input; then each call is answered with
    its rows of the batched forward, in the order it was made. Other attributes are the denoiser's."""

    def __init__(self, denoiser: torch.nn.Module, input_name: str):
        self._denoiser, self._input = denoiser, input_name
        self.calls: list[dict[str, Any]] = []
        self.answers: list[Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._denoiser, name)

    def __call__(self, **kwargs: Any) -> tuple[Any]:
        if self.answers is None:
            self.calls.append(kwargs)
            x = kwargs[self._input]
            return ([torch.zeros_like(e) for e in x] if isinstance(x, list) else torch.zeros_like(x),)
        return (self.answers.pop(0),)


def _rows(value: Any, n: int) -> bool:
    return isinstance(value, list | torch.Tensor) and len(value) == n and not isinstance(value, str)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.equal(b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _fits(group: list[dict[str, Any]], call: dict[str, Any], n: int, input_name: str) -> bool:
    """Whether ``call`` (``n`` rows) can join the forward of ``group``: per-row tensors of the same trailing shape
    and dtype, per-row lists, and every other argument equal."""
    first = group[0]
    m = len(first[input_name])
    if first.keys() != call.keys():
        return False
    for name, value in call.items():
        other = first[name]
        if _rows(value, n) and _rows(other, m):
            if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
                return False
            if isinstance(value, torch.Tensor) and (value.shape[1:] != other.shape[1:] or value.dtype != other.dtype):
                return False
        elif not _same(value, other):
            return False
    return True


def batched(calls: list[dict[str, Any]], input_name: str) -> list[list[int]]:
    """The recorded ``calls`` in groups that can share one forward (indices, in order)."""
    groups: list[list[int]] = []
    for index, call in enumerate(calls):
        n = len(call[input_name])
        group = next((g for g in groups if _fits([calls[i] for i in g], call, n, input_name)), None)
        if group is None:
            groups.append([index])
        else:
            group.append(index)
    return groups


def concat_rows(values: list[Any], counts: list[int]) -> Any:
    """One argument of a group's calls (``counts`` rows each) as one forward takes it: per-row tensors and lists
    concatenated, any other argument (equal across the group) once."""
    first = values[0]
    if not _rows(first, counts[0]):
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    return [row for value in values for row in value]
