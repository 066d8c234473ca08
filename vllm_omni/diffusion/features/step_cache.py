"""Step caching (``cache_backend``): diffusers' cache hooks on the denoiser, with each request's cache state its own;
and cache-dit, whose context covers a pipeline call of one request (`CallCache`).

diffusers' hooks keep what they reuse between steps (a residual, Taylor factors, an attention output) in one state
per hooked module, and decide for the whole input of a call: first-block's check is one mean over the tensor. Run
as is over a batch, a request's image would depend on the requests beside it, and state would carry over from one
request to the next. So here:

- every request has a `RequestCache`, the states of all the hooks for that request alone. It is made empty for the
  request (a request never sees another's state) and lives with it (one pipeline call in request mode, the
  request's `StepState` in step mode). A call that fails leaves every request's state as it was before it, so an
  out-of-memory retry in parts runs each step once;
- the denoiser runs once per request in the batch, over that request's rows only, with the hooks holding its
  states. Each request's decisions are the ones it makes alone, so its image is the same alone or in any batch;
  the batch still shares text encoding, decoding and the step schedule.

A request that opts out (``cache: false``) runs on an empty state at every call, on which every backend computes
every block.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import StateManager
from diffusers.models.cache_utils import CacheMixin

from vllm_omni.config.cache import WHOLE_CALL_BACKENDS, cache_hook_config
from vllm_omni.diffusion.pipeline.components import loaded_denoisers
from vllm_omni.diffusion.pipeline.extension import Extension

if TYPE_CHECKING:
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine.request import PipelineCall

_SPLIT_HOOK = "vllm_omni_request_split"


@dataclass(eq=False)
class RequestCache:
    """One request's step-cache state: the state of every cache hook, for this request only."""

    enabled: bool = True
    """Whether the request uses the cache (``cache: false`` opts out)."""

    states: dict[int, Any] = field(default_factory=dict)
    """Each hook's state for this request, by the hook's index in `StepCache`."""

    timestep: float | None = None
    """The request's current timestep in step mode, for the hooks that skip by timestep range; ``None``: the
    pipeline's own (request mode, where a batch shares its steps)."""

    steps: int | None = None
    """The request's denoising steps, which cache-dit sizes its context by (`CallCache`)."""


BROKEN_HOOKS: dict[tuple[str, str], str] = {
    ("first_block", "Flux2Transformer2DModel"): "diffusers 0.42's FirstBlockCache fails on the outputs of its blocks "
    "(TypeError at the first step, stock diffusers too); taylorseer, magcache and pab work",
}
"""(backend, denoiser class) pairs that diffusers declares but cannot run, with what happens."""


def no_cache_hooks(denoiser_class: type, backend: str | None = None) -> str | None:
    """Why diffusers' cache hooks (of ``backend``, when given) cannot go on a denoiser of ``denoiser_class``;
    ``None`` when they can."""
    if not issubclass(denoiser_class, CacheMixin):
        return f"{denoiser_class.__name__} has no diffusers cache hooks (it is not a CacheMixin model)"
    return None if backend is None else BROKEN_HOOKS.get((backend, denoiser_class.__name__))


def too_few_blocks(denoiser: torch.nn.Module, backend: str) -> str | None:
    """Why ``backend`` cannot go on this model of a class it supports: first_block caches the blocks between a
    head and a tail block, so it needs two (diffusers fails with an IndexError on one, as tiny test models have)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    if backend != "first_block":
        return None
    lists = [m for n, m in denoiser.named_children() if n in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS]
    blocks = sum(len(m) for m in lists if isinstance(m, torch.nn.ModuleList))
    return None if blocks >= 2 else f"first_block needs two transformer blocks or more; this model has {blocks}"


class _SkipCount:
    """The computations a step cache skipped, since start-up, in calls that succeeded (a failed call's are not: its
    retry makes the decisions again); ``on_skip`` gets each call's count (the engine's metric)."""

    skipped: int = 0
    on_skip: Callable[[int], None] | None = None

    def _count_skips(self, skipped: int) -> None:
        self.skipped += skipped
        if skipped and self.on_skip is not None:
            self.on_skip(skipped)


class StepCache(_SkipCount):
    """diffusers' cache hooks (``cache_backend``) on a pipeline's denoisers, run per request (module docstring)."""

    def __init__(self, pipeline, denoisers: Sequence[torch.nn.Module], backend: str, options: dict[str, Any] | None):
        self._timestep: float | None = None
        config = cache_hook_config(backend, options or {}, self._current_timestep(pipeline))
        self._holders: list[tuple[Any, str, Any]] = []
        """Every stateful hook's state holder: (owner, attribute, the empty state a request starts from)."""
        self._hooked: dict[int, int] = {}
        """The modules the hooks wrap (by id), each counted once per call when it skips its computation."""
        self._unconfirmed = 0
        """Skips of the calls inside `rows` so far, counted once it has succeeded."""
        self._rows: list[RequestCache] | None = None
        self._managers: list[StateManager] = []
        """The hooks' state managers: they hold the cache context a call runs in."""
        for denoiser in denoisers:
            if (why := no_cache_hooks(type(denoiser), backend) or too_few_blocks(denoiser, backend)) is not None:
                raise ValueError(f"cache_backend={backend!r}: {why}; set cache_backend to 'none'")
            # a CacheMixin (checked above), which nn.Module's attribute typing (Tensor | Module) does not know
            cast(CacheMixin, denoiser).enable_cache(config)
            for module in denoiser.modules():
                registry = getattr(module, "_diffusers_hook", None)
                if registry is None:
                    continue
                for name in registry._hook_order:
                    hook = registry.hooks[name]
                    for attribute, value in vars(hook).items():
                        if isinstance(value, StateManager):  # its states by cache context, all of one request
                            self._holders.append((value, "_state_cache", {}))
                            self._managers.append(value)
                        elif attribute == "state" and hook._is_stateful:  # pab, faster_cache: one state object
                            self._holders.append((hook, "state", copy.deepcopy(value)))
                if module is not denoiser and registry._hook_order:
                    self._count_computations(module, registry.hooks[registry._hook_order[0]])
            HookRegistry.check_if_exists_or_initialize(denoiser).register_hook(_RequestSplit(self), _SPLIT_HOOK)

    def _current_timestep(self, pipeline) -> Callable[[], Any]:
        return lambda: pipeline.current_timestep if self._timestep is None else self._timestep

    def _count_computations(self, module: torch.nn.Module, innermost) -> None:
        """Count the calls of ``module``'s own forward (the innermost hook's ``original_forward``): a call that
        does not reach it skipped the module."""
        key = id(module)
        self._hooked[key] = 0
        forward = innermost.fn_ref.original_forward

        def counted(*args, **kwargs):
            self._hooked[key] += 1
            return forward(*args, **kwargs)

        innermost.fn_ref.original_forward = counted

    @contextlib.contextmanager
    def rows(self, rows: Sequence[RequestCache]) -> Iterator[None]:
        """The denoiser calls inside serve these requests: ``rows`` has one entry per latent row (a call of a
        multiple of its length is it repeated: classifier-free guidance concatenates negative and positive rows)."""
        self._rows = list(rows)
        before = {id(r): (r, _checkpoint(r.states)) for r in self._rows}
        try:
            yield
        except BaseException:
            # A failed call (out of memory: the engine retries it in parts) must not move any request's state:
            # the requests before the failing one have already run their part of it.
            for request, states in before.values():
                request.states.clear()
                request.states.update(states)
            raise
        else:
            self._count_skips(self._unconfirmed)
        finally:
            self._rows, self._unconfirmed = None, 0

    def run(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        """One denoiser call: once per request over its rows, each with its own states (`_RequestSplit`)."""
        batch = _batch_size(args, kwargs)
        rows = self._rows or [RequestCache(enabled=False)]
        if batch % len(rows):
            raise RuntimeError(f"the denoiser got {batch} rows for {len(rows)} requests' rows: they cannot be matched")
        rows = rows * (batch // len(rows))
        groups: dict[int, tuple[RequestCache, list[int]]] = {}
        for index, request in enumerate(rows):
            groups.setdefault(id(request), (request, []))[1].append(index)
        if len(groups) == 1:
            return self._call(next(iter(groups.values()))[0], forward, args, kwargs)
        outputs, order = [], []
        for request, indices in groups.values():
            positions = torch.tensor(indices, device=_first_tensor(args, kwargs).device)
            sub_args = tuple(_take(value, positions, batch) for value in args)
            sub_kwargs = {k: v if k.endswith("_ids") else _take(v, positions, batch) for k, v in kwargs.items()}
            outputs.append(self._call(request, forward, sub_args, sub_kwargs))
            order += indices
        inverse = torch.argsort(torch.tensor(order, device=positions.device))
        return _combine(outputs, inverse)

    def _call(self, request: RequestCache, forward: Callable, args: tuple, kwargs: dict) -> Any:
        states = request.states if request.enabled else {}  # opted out: an empty state computes everything
        for i, (holder, attribute, empty) in enumerate(self._holders):
            if i not in states:
                states[i] = copy.deepcopy(empty)
            setattr(holder, attribute, states[i])
        for key in self._hooked:
            self._hooked[key] = 0
        self._timestep = request.timestep
        try:
            output = forward(*args, **kwargs)
        finally:
            self._timestep = None
        skipped = sum(calls == 0 for calls in self._hooked.values())
        if self._rows is None:
            self._count_skips(skipped)
        else:
            self._unconfirmed += skipped
        return output


class CallCache(_SkipCount):
    """cache-dit (``cache_backend: cache_dit``) on the denoisers: its cache context is made fresh for every pipeline
    call and decides for all the call's rows together, so the resolver lets it serve one request per call
    (``max_num_seqs`` 1, request mode) and the context is that request's alone. A request that opts out runs with
    no cached step allowed. Skips are the calls of the denoiser's repeated blocks that did not run."""

    def __init__(self, denoisers: Sequence[torch.nn.Module], options: dict[str, Any] | None):
        import cache_dit

        self._config = cache_hook_config("cache_dit", options or {})
        self._denoisers = list(denoisers)
        self._calls = {"expected": 0, "ran": 0}
        """Block calls of the current pipeline call: those of a full denoiser call, and those that ran."""
        for denoiser in self._denoisers:
            names = set(getattr(denoiser, "_repeated_blocks", None) or ())
            blocks = [m for m in denoiser.modules() if type(m).__name__ in names]
            # a denoiser that names no repeated blocks (Stable Audio's DiT): the blocks cache-dit caches
            blocks = blocks or list(getattr(denoiser, "transformer_blocks", None) or ())
            computed = self._config.Fn_compute_blocks + self._config.Bn_compute_blocks
            if blocks and computed >= len(blocks):  # cache-dit would only assert at the first request
                raise ValueError(
                    f"cache_backend='cache_dit': cache_config Fn_compute_blocks {self._config.Fn_compute_blocks} + "
                    f"Bn_compute_blocks {self._config.Bn_compute_blocks} leave none of the {len(blocks)} blocks of "
                    f"{type(denoiser).__name__} to cache: lower them"
                )
            try:
                cache_dit.enable_cache(denoiser, cache_config=self._config)
            except (
                AssertionError
            ) as exc:  # its adapter registry matches by name: StableAudio3DiTModel as Stable Audio's
                raise ValueError(f"cache-dit cannot take {type(denoiser).__name__}: {exc}") from exc
            denoiser.register_forward_pre_hook(functools.partial(self._count, "expected", len(blocks)))
            for block in blocks:
                block.register_forward_pre_hook(functools.partial(self._count, "ran", 1))

    def _count(self, kind: str, calls: int, module, args) -> None:
        self._calls[kind] += calls

    @contextlib.contextmanager
    def rows(self, rows: Sequence[RequestCache]) -> Iterator[None]:
        """The pipeline call inside serves ``rows`` (one request's, the resolver sees to it)."""
        import cache_dit

        overrides = {"num_inference_steps": rows[0].steps}
        if not rows[0].enabled:
            overrides["max_cached_steps"] = 0
        for denoiser in self._denoisers:
            cache_dit.refresh_context(denoiser, cache_config=dataclasses.replace(self._config, **overrides))
        self._calls.update(expected=0, ran=0)
        yield
        self._count_skips(self._calls["expected"] - self._calls["ran"])


class StepCacheExtension(Extension):
    """The step cache (``cache_backend``) as an extension (`vllm_omni.diffusion.pipeline.extensions`): put on the
    denoisers when the pipeline loads, and each request's own cache state around a request-mode call (step mode's
    stepper hands each request's state to its forward)."""

    name = "step_cache"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.stage = od_config.stage
        self.cache: StepCache | CallCache | None = None
        """The step cache on the denoisers: diffusers' hooks run per request, or cache-dit per call of one request;
        ``None``: no step cache."""

    def on_load(self, pipeline: Any, variant: bool) -> None:
        if variant or self.stage.cache_backend == "none":  # a variant shares the hooked denoisers
            return
        denoisers = [getattr(pipeline, name) for name in loaded_denoisers(pipeline)]
        if self.stage.cache_backend in WHOLE_CALL_BACKENDS:
            self.cache = CallCache(denoisers, self.stage.cache_config)
        else:
            self.cache = StepCache(pipeline, denoisers, self.stage.cache_backend, self.stage.cache_config)

    def around_call(self, call: PipelineCall) -> contextlib.AbstractContextManager[None]:
        if self.cache is None:
            return contextlib.nullcontext()
        caches = [RequestCache(enabled=r.params.cache, steps=r.params.num_inference_steps) for r in call.batch]
        return self.cache.rows([cache for cache in caches for _ in range(call.n)])


class _RequestSplit(ModelHook):
    """The hook on the denoiser itself, outermost: it hands each call to `StepCache.run`. Without a cache context
    (step mode calls the denoiser directly), the call runs in diffusers' ``cond`` one."""

    def __init__(self, cache: StepCache):
        super().__init__()
        self.cache = cache

    def new_forward(self, module: torch.nn.Module, *args, **kwargs):
        managers = self.cache._managers
        # diffusers types original_forward as None, its value before the hook is registered
        forward = cast(Callable[..., Any], self.fn_ref.original_forward)
        if managers and managers[0]._context is None:
            with cast(CacheMixin, module).cache_context("cond"):
                return self.cache.run(forward, args, kwargs)
        return self.cache.run(forward, args, kwargs)


def _checkpoint(value: Any) -> Any:
    """A copy of hook states that a later call cannot change: new state objects, lists and dicts around the same
    tensors. diffusers' cache hooks replace the tensors and numbers they keep, and write into none of them."""
    if isinstance(value, dict):
        return {k: _checkpoint(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_checkpoint(v) for v in value]
    if isinstance(value, torch.Tensor) or not hasattr(value, "__dict__"):
        return value
    clone = copy.copy(value)
    vars(clone).update({k: _checkpoint(v) for k, v in vars(value).items()})
    return clone


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))


def _batch_size(args: tuple, kwargs: dict) -> int:
    """The rows of the call: those of its latents (``hidden_states``, or its first tensor)."""
    latents = kwargs.get("hidden_states")
    return (latents if isinstance(latents, torch.Tensor) else _first_tensor(args, kwargs)).shape[0]


def _take(value: Any, index: torch.Tensor, batch: int) -> Any:
    """The rows ``index`` of a per-row input; anything else (position ids, shared tensors, options) as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value.index_select(0, index)
    return value


def _combine(outputs: list[Any], inverse: torch.Tensor) -> Any:
    """The per-request outputs as one, back in the call's row order."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs).index_select(0, inverse)
    if isinstance(first, dict):  # diffusers' ModelOutput
        return type(first)(**{k: _combine([o[k] for o in outputs], inverse) for k in first})
    return type(first)(_combine([o[i] for o in outputs], inverse) for i in range(len(first)))
