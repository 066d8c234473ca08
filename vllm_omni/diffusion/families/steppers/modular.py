"""Step mode for the families that diffusers ships as modular pipelines: the family's own blocks run each group of
requests, and the denoiser calls of all groups are one forward.

A modular pipeline (``diffusers.modular_pipelines``) splits a family into blocks: the text encoder, the steps before
the denoising loop (inputs, initial latents, timesteps, position inputs), the loop, whose sub-blocks are one step
(``before_denoiser``, the ``denoiser`` with its guider, ``after_denoiser``), and the decoder. `ModularStepper`
encodes the prompts of one `encode_key` in one call of its text-encoder blocks, as a request-mode batch does, and
splits what they made back per request; it runs the blocks before the loop once for the requests that join at one
step and differ only in their prompts and seeds (`ModularStepper.start_all`), again split back per request; and each
engine step runs its loop's sub-blocks once per group of requests, as a request-mode batch runs them once:

1. the requests form groups whose guiders act alike at their steps (classifier-free guidance at one scale, on or
   off) and whose loop inputs can be put together (`batched`); each group's inputs become one block state of its
   rows (`_GroupPass`: latents and embeddings concatenated, masked embeddings padded, each row at its own timestep);
2. each group's ``before_denoiser`` and ``denoiser`` run with `DenoiserCalls` standing in for the denoiser, which
   records the call's arguments and answers zeros shaped like its input (the answers are thrown away);
3. the recorded calls of all groups are concatenated row-wise into as few forwards as their arguments allow, each
   row with its request's LoRA adapters and step cache;
4. the same sub-blocks run again, each call answered with its rows: the guider combines them as the family's
   maintainers wrote it (Qwen-Image's norm rescale included), and each request takes its rows of the prediction;
5. ``after_denoiser`` (the scheduler's update) runs per request, with its own scheduler, in `advance`.

A step whose requests form one group, whose guider makes one denoiser call (guidance off), runs its sub-blocks once:
`DenoiserCalls` answers the call with its forward as it is made, there being nothing to put together with it.

A split pipeline runs the same blocks in three stages: ``encode`` the ones that read a text encoder (what they
made is `Conditioning.blocks`), ``denoise`` the rest up to the loop and the loop, ``decode`` the blocks after it
(with what they read of the request's state besides the latents: `Latents.blocks`), in one call for the requests
whose inputs to them can be put together. Previews decode with those blocks too.

A request that samples stochastically (``sde_type``, RL rollouts) takes its `SdeSampler.step` after the family's
update: the update keeps the scheduler's own step index, and in the request's window the sampler's latents replace
the Euler step's, as request mode's `sde_sampling` replaces them around the stock pipeline's ``scheduler.step``.
At its first step it is a group of its own, so that the text inputs its denoiser sees are recorded as its own.

The family's blocks are the ones diffusers maps its pipeline class to; what it adds is a table entry
(`MODULAR_FAMILIES`, in modular_families.py): how a request's parameters become its guider, and what its blocks
cannot take. Image tasks (the hand-written steppers' ``image`` and ``inpaint``) are refused for these families in
step mode: diffusers' modular image-to-image blocks do not compute what the stock image pipelines do.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.modular_pipelines import BlockState, PipelineState

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.pipeline_facts import schedule_index
from vllm_omni.diffusion.families.steppers.base import Stepper, fresh_noise_scheduler, generators_for, scheduler_copy
from vllm_omni.diffusion.families.steppers.denoiser_calls import DenoiserCalls, batched, joined
from vllm_omni.diffusion.families.steppers.modular_families import MODULAR_FAMILIES
from vllm_omni.diffusion.families.steppers.state import Conditioning, Latents, StepState
from vllm_omni.diffusion.features.sde import EMBEDDING_NAMES, SDE_ARGS, record_first_step
from vllm_omni.diffusion.pipeline.components import TEXT_ENCODERS
from vllm_omni.errors import SamplingParamsError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def modular_blocks(pipeline) -> Any:
    """The modular blocks of ``pipeline``'s family as diffusers maps a pipeline to them (``XPipeline`` →
    ``XModularPipeline``, or the variant its config names: a step-distilled FLUX.2 [klein], a two-expert Wan); given
    a class name, its default variant."""
    from diffusers.modular_pipelines.modular_pipeline import MODULAR_PIPELINE_MAPPING

    class_name = pipeline if isinstance(pipeline, str) else type(pipeline).__name__
    name = class_name.removesuffix("Pipeline") + "ModularPipeline"
    config = None if isinstance(pipeline, str) else dict(pipeline.config)
    for map_fn in MODULAR_PIPELINE_MAPPING.values():
        if map_fn(None) == name:
            name = map_fn(config)
            break
    return getattr(diffusers, getattr(diffusers, name).default_blocks_name)()


class RequestComponents:
    """The modular pipeline's components as one request's blocks see them: its own scheduler (which keeps a step
    index and, for multistep solvers, history) and guider (its scale and step), and `DenoiserCalls` for the
    denoiser; everything else is the shared pipeline's. The pipeline's properties are read over this view, so that
    what they derive from the guider (``requires_unconditional_embeds``) is the request's."""

    def __init__(
        self,
        modular,
        scheduler,
        guider,
        denoisers: dict[str, DenoiserCalls | _Unloaded],
        execution_device: torch.device,
    ):
        self._modular, self.scheduler, self.guider = modular, scheduler, guider
        vars(self).update(denoisers)  # under the denoiser's component name: transformer, unet
        self._execution_device = execution_device
        """The modular pipeline's property of that name, as the stepper found it once (`ModularStepper`)."""

    def __getattr__(self, name: str) -> Any:
        owner: type = type(self._modular)
        found = _property(owner, name)
        return getattr(self._modular, name) if found is None else found.__get__(self)


@functools.cache  # a request's blocks read the pipeline's attributes hundreds of times; its class never changes
def _property(cls: type, name: str) -> property | None:
    """``cls``'s property of that name, or ``None``."""
    found = inspect.getattr_static(cls, name, None)
    return found if isinstance(found, property) else None


@dataclass(frozen=True)
class _Unloaded:
    """The denoiser of a stage that does not load it, as blocks that read only its dtype see it (HunyuanVideo 1.5's
    text-encoder blocks cast to it): the stage's own dtype, which its denoise stage runs when it has the same."""

    name: str
    dtype: torch.dtype

    def __getattr__(self, attr: str) -> Any:
        raise AttributeError(f"{self.name} is not loaded in this stage (its blocks asked for {attr!r})")


@dataclass(eq=False)
class ModularStepState(StepState):
    """A request stepped by its family's modular blocks: `StepState` plus the blocks' own state."""

    loop: Any = None
    """The ``BlockState`` of its denoising loop (latents, embeddings, timesteps, position inputs)."""
    pipeline: PipelineState | None = None
    """The pipeline state its blocks before the loop left, which its decoder blocks read (Flux.2's ``latent_ids``,
    LTX's ``num_frames``)."""
    components: RequestComponents | None = None
    """Its view of the pipeline's components."""
    inputs: tuple[str, ...] = ()
    """What its loop's sub-blocks read of its block state (`_loop_inputs`)."""


def _modular(state: StepState) -> ModularStepState:
    """``state`` as the modular stepper made it (`ModularStepper.start`)."""
    assert isinstance(state, ModularStepState), "a modular stepper steps the states it started"
    return state


class _LoopStarted(Exception):
    """Raised by a loop's first step in `_loop_start`, carrying the loop's block state."""


def _raise_at_first_step(components, block_state, **_: Any):
    raise _LoopStarted(block_state)


def _fill(block, state: PipelineState, inputs: dict[str, Any]) -> None:
    """Each input ``block`` names that ``state`` does not hold yet, from ``inputs`` or its default, as
    ``ModularPipeline.__call__`` fills the state."""
    for param in block.inputs:
        if param.name is not None and param.name not in state.values:
            state.set(param.name, inputs.get(param.name, param.default), param.kwargs_type)


def _loop_start(loop, components, state: PipelineState) -> Any:
    """The ``BlockState`` of ``loop`` as its own ``__call__`` has it at its first step: the wrapper's set-up before
    its loop (Qwen-Image's ``additional_cond_kwargs``) is the family's, so it runs, and the loop is the engine's."""
    loop.loop_step = _raise_at_first_step  # on the stepper's own copy of the family's loop block
    _fill(loop, state, {})
    try:
        loop(components, state)
    except _LoopStarted as started:
        return started.args[0]
    raise ValueError(f"{type(loop).__name__} ran no step: its request has no timesteps")


_PARAM_INPUTS = (
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "num_images_per_prompt",
    "num_videos_per_prompt",
)
"""The block inputs a request's parameters give (`ModularStepper._inputs`) besides its prompts and generator."""


def _is_loop(block) -> bool:
    return isinstance(block, diffusers.modular_pipelines.LoopSequentialPipelineBlocks)


_SPECS = ("inputs", "intermediate_outputs")
"""What diffusers' blocks build from templates at every read (a loop's from its sub-blocks' too) and read several
times per block call: the input and output specs, fixed for a block once it is made."""


def _pinned_spec(name: str) -> property:
    def read(block: Any) -> Any:
        return block.pinned_specs[name]

    return property(read)


_PINNING: dict[type, type] = {}
"""Per block class, its subclass whose specs (`_SPECS`) are the ones `_pinned` stored on the block: one per class, so
that a block's class is the same for every stepper (a test may patch it)."""


def _pinned(block):
    """A copy of ``block`` and of its sub-blocks whose specs are computed once: on tiny Qwen-Image, building them
    at each read was a third of a request's blocks before the loop (cProfile: 0.45 of 1.45 ms), and it is paid again
    by each pass of the loop's sub-blocks. A copy, because diffusers' block classes share sub-block instances."""
    block = copy.copy(block)
    subs = getattr(block, "sub_blocks", None)
    if subs:
        block.sub_blocks = type(subs)((name, _pinned(sub)) for name, sub in subs.items())
    block.pinned_specs = {name: getattr(block, name) for name in _SPECS}
    cls = type(block)
    if cls not in _PINNING:
        specs = {name: _pinned_spec(name) for name in _SPECS}
        _PINNING[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__doc__": cls.__doc__, **specs})
    block.__class__ = _PINNING[cls]
    return block


def _encodes_text(block) -> bool:
    return any(spec.name in TEXT_ENCODERS for spec in block.expected_components)


def _on_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return [_on_device(v, device) for v in value] if isinstance(value, list) else value


_LOOP_OWN = ("timesteps", "num_warmup_steps", "num_inference_steps")
"""What a loop's block state holds for the loop itself (the engine's now): a group's sub-blocks see its first
request's, which its guider key covers (`ModularStepper._guided_alike`)."""


def _loop_inputs(state: ModularStepState) -> dict[str, Any]:
    """What of the request's loop state its group puts together: what its block state held when its loop started
    (not what a pass of the sub-blocks left, its last prediction), but the loop's own values, and a dict of
    values the state holds by name too (Qwen-Image's ``denoiser_input_fields``), which `_GroupPass` makes again."""
    values = vars(state.loop)
    return {name: values[name] for name in state.inputs}


def _input_names(loop: Any) -> tuple[str, ...]:
    """The names `_loop_inputs` reads of a loop state as it started."""
    values = vars(loop)
    return tuple(name for name, value in values.items() if name not in _LOOP_OWN and _alias(value, values) is None)


def _alias(value: Any, values: dict[str, Any]) -> list[str] | None:
    """The names of a dict whose every entry the block state holds by that name too, or ``None``."""
    if isinstance(value, dict) and value and all(k in values and values[k] is v for k, v in value.items()):
        return list(value)
    return None


class _Joined:
    """A group's loop inputs but its latents, put together (`joined`; a request alone: its own), with what each
    request held when they were, and the group's block state. Kept from step to step while the same requests hold
    the same inputs (`ModularStepper._joined`): they change only when a request joins or leaves, and putting the
    embeddings together again at every step was most of the stepper's own time per step beside the blocks."""

    def __init__(self, states: list[ModularStepState]):
        self.states = states
        """Kept, so that no other request's state takes the id of one of them while it is kept."""
        self.inputs = [_loop_inputs(state) for state in states]
        self.layout = [(state.latents.shape[1:], state.latents.dtype) for state in states]
        rest = [{k: v for k, v in values.items() if k != "latents"} for values in self.inputs]
        counts = [len(state.latents) for state in states]
        self.merged = joined(rest, counts) if len(states) > 1 else rest[0]
        self.loop: Any = None
        """The group's ``BlockState`` as its last step's passes left it (`_GroupPass`): carried from step to step, as
        the stock loop carries its own."""

    def holds(self, states: list[ModularStepState]) -> bool:
        """Whether ``states`` (the same requests, in order) still hold what it was put together from."""
        return len(states) == len(self.states) and all(
            state is mine
            and (state.latents.shape[1:], state.latents.dtype) == layout
            and all(vars(state.loop).get(k) is v for k, v in kept.items() if k != "latents")
            for state, mine, kept, layout in zip(states, self.states, self.inputs, self.layout, strict=True)
        )


class _GroupPass:
    """A group of requests in one step's passes of the loop's sub-blocks: their loop inputs put together as one
    block state (rows in the group's order), each row's timestep, and the denoiser stand-in of its calls."""

    def __init__(self, states: list[ModularStepState], inputs: _Joined, components, recorder: DenoiserCalls):
        self.states, self.components, self.recorder = states, components, recorder
        self.counts = [len(state.latents) for state in states]
        first = states[0]
        latents = torch.cat([state.latents for state in states]) if len(states) > 1 else first.latents
        if inputs.loop is None:
            values = vars(first.loop)
            # a copy of each dict: the sub-blocks fill some each step (Qwen-Image's additional_cond_kwargs)
            merged = {k: dict(v) if isinstance(v, dict) else v for k, v in inputs.merged.items()}
            merged |= {name: values[name] for name in _LOOP_OWN if name in values}
            merged |= {name: {k: merged[k] for k in keys} for name, v in values.items() if (keys := _alias(v, values))}
            inputs.loop = BlockState(**merged)
        self.loop: Any = inputs.loop
        self.loop.latents = latents
        same = all(
            (state.timesteps is first.timesteps and state.step == first.step) or state.timestep.equal(first.timestep)
            for state in states
        )
        rows = zip(states, self.counts, strict=True)
        self.timestep = first.timestep if same else torch.cat([state.timestep.expand(n) for state, n in rows])
        """One for all its rows where they are at the same timestep (as a request alone), else each row's."""
        self.answers: dict[int, Any] = {}
        """Each recorded call's rows of the forwards, by the call's id."""

    def owners(self, rows: int) -> list[ModularStepState]:
        """The request of each row of one of its calls (a call of several times its rows repeats them)."""
        each = [state for state, n in zip(self.states, self.counts, strict=True) for _ in range(n)]
        assert rows % len(each) == 0, f"a call of {rows} rows from a group of {len(each)}"
        return each * (rows // len(each))


def _one_call(group: _GroupPass) -> bool:
    """Whether the group's guider makes one denoiser call at its step: classifier-free guidance off (its state set
    for the step by `ModularStepper._guided_alike`)."""
    guider = group.components.guider
    return type(guider) is ClassifierFreeGuidance and guider.num_conditions == 1


def _cache_timesteps(passes: list[_GroupPass], step_cache: Any) -> None:
    """Each request's timestep, where the step-cache hooks that skip by timestep range read it (with a step cache:
    reading a timestep's value waits for the device)."""
    if step_cache is None:
        return
    for group in passes:
        for state in group.states:
            state.cache.timestep = float(state.timestep)


def _per_prompt(made: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """What the text-encoder blocks made for ``count`` prompts, per prompt: a value with the rows of every prompt
    (as many per prompt as ``prompt_embeds`` has: its outputs per prompt, for the families that repeat there) split
    in ``count`` equal parts, any other value (a negative prompt's embeddings encoded once for all) whole to each."""
    if count == 1:
        return [made]
    per_prompt = len(made["prompt_embeds"]) // count
    rows = [
        name
        for name, value in made.items()
        if isinstance(value, torch.Tensor | list) and getattr(value, "ndim", 1) > 0 and len(value) == count * per_prompt
    ]
    parts = [dict(made) for _ in range(count)]
    for name in rows:
        value = made[name]
        for i, part in enumerate(parts):
            part[name] = value[i * per_prompt : (i + 1) * per_prompt]
    return parts


def _per_row(batched: Any, alone: Any, count: int) -> Any:
    """How a value that the blocks made for ``count`` requests holds each request's: ``True``, rows (a tensor or
    list of ``count`` where one request's has 1), ``False``, one value for all, or per key of a dict."""
    if isinstance(batched, dict) and isinstance(alone, dict):
        return {k: _per_row(v, alone.get(k), count) for k, v in batched.items()}
    rows = getattr(batched, "ndim", 1) > 0 and isinstance(batched, torch.Tensor | list) and len(batched) == count
    return rows and isinstance(alone, torch.Tensor | list) and getattr(alone, "ndim", 1) > 0 and len(alone) == 1


def _row(value: Any, rows: Any, index: int) -> Any:
    """Request ``index``'s part of a value (`_per_row`)."""
    if isinstance(rows, dict):
        return {k: _row(v, rows[k], index) for k, v in value.items()}
    return value[index : index + 1] if rows else value


class _Rows:
    """Which values of the pipeline state and of the loop's block state that the blocks before the loop leave
    hold a row per request, found by comparing a group's with its first request's started alone, once per set of
    values made (a value of the family's blocks is per request or not whatever the request)."""

    def __init__(self, state: PipelineState, loop: Any, alone: ModularStepState, count: int):
        assert alone.pipeline is not None, "set by start"
        mine = alone.pipeline.values
        self.state = {k: _per_row(v, mine.get(k), count) for k, v in state.values.items()}
        self.loop = {
            k: _per_row(v, vars(alone.loop).get(k), count) for k, v in vars(loop).items() if k not in _LOOP_OWN
        }

    def part(self, state: PipelineState, loop: Any, index: int) -> tuple[PipelineState, Any]:
        """Request ``index``'s pipeline state and loop block state (a dict the loop state holds by name too made
        again of its own values)."""
        own = PipelineState(
            {k: _row(v, self.state.get(k, False), index) for k, v in state.values.items()},
            {k: list(v) for k, v in state.kwargs_mapping.items()},
        )
        values = vars(loop)
        mine = {k: _row(v, self.loop.get(k, False), index) for k, v in values.items() if _alias(v, values) is None}
        mine |= {k: {name: mine[name] for name in names} for k, v in values.items() if (names := _alias(v, values))}
        return own, BlockState(**mine)


class ModularStepper(Stepper):
    """Any family of `MODULAR_FAMILIES`, stepped by its modular blocks (see the module's docstring)."""

    pipeline_classes = tuple(MODULAR_FAMILIES)
    preview_method = "vae"  # its latents are the family's packed layout, which only its decoder blocks unpack
    extra_args = SDE_ARGS.union(*(f.extra_args for f in MODULAR_FAMILIES.values()))

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.family = MODULAR_FAMILIES[type(pipeline).__name__]
        blocks = modular_blocks(pipeline).get_execution_blocks(prompt="")
        # Copies (`_pinned`): diffusers' block classes share their sub-block instances, and `_loop_start` sets the
        # loop's step.
        leaves = [_pinned(block) for block in blocks.sub_blocks.values()]
        loop = next(i for i, b in enumerate(leaves) if _is_loop(b))
        self.loop, self.after = leaves[loop], leaves[loop + 1 :]
        # The encode stage: the blocks that read a text encoder; the rest before the loop start a request.
        self.encode_blocks = [b for b in leaves[:loop] if _encodes_text(b)]
        self.start_blocks = [b for b in leaves[:loop] if not _encodes_text(b)]
        self.encoded = {out.name: out.kwargs_type for b in self.encode_blocks for out in b.intermediate_outputs}
        """What the encode blocks hand on (`Conditioning.blocks`), with the kind of input each is."""
        self.decoded = [param.name for b in self.after for param in b.inputs if param.name]  # the decoder's inputs
        required = {param.name for param in self.loop.inputs if param.required}
        self.encodes_negatives = any(name.startswith("negative_") and name in required for name in self.encoded)
        """Whether its loop takes negative embeddings even unguided (LTX: its guider then ignores them), so that
        every prompt is encoded with its negative."""
        names = list(self.loop.sub_blocks)
        update = next(i for i, name in enumerate(names) if name.startswith("after_denoiser"))
        self.predict_blocks = [self.loop.sub_blocks[name] for name in names[:update]]
        self.update_blocks = [self.loop.sub_blocks[name] for name in names[update:]]
        self.loop.set_progress_bar_config(disable=True)  # its loop is the engine's
        self.modular = blocks.init_pipeline()
        self.guider = getattr(pipeline, "guider", None) or ClassifierFreeGuidance()
        """What each request's guider is a copy of: the pipeline's own where it has one."""
        self.modular.update_components(**{k: v for k, v in pipeline.components.items() if v is not None})
        self.execution_device = self.modular._execution_device
        """Where its blocks run, as the modular pipeline's property finds it, once: the property walks every module of
        every component for offload hooks (8 ms on tiny Qwen-Image on the CPU), and a request's blocks ask for it three
        times, where the stock pipeline asks once per batch."""
        self.denoiser_name = "transformer" if "transformer" in pipeline.components else "unet"
        """The component the family's blocks call the denoiser by."""
        self.input_name = (
            None if self.denoiser is None else next(iter(inspect.signature(self.denoiser.forward).parameters))
        )
        """The denoiser's first argument, whose length is a call's row count."""
        self.signature = None if self.denoiser is None else inspect.signature(self.denoiser.forward)
        """Its forward's, found once (`DenoiserCalls` names positional arguments by it)."""
        self._rows: dict[tuple[frozenset[str], frozenset[str]], _Rows] = {}
        """Which values of the blocks before the loop are per request, by the names they made (guided requests'
        blocks make more), found at the first `_start_group` that made them."""
        self._joined: dict[tuple[int, ...], _Joined] = {}
        """The last step's groups' inputs that the next may use again, by their requests' states' ids (`_Joined`)."""

    @classmethod
    @functools.cache  # read at each admission that asks for previews; the blocks of a class never change
    def request_mode_previews_refusal(cls, pipeline_name: str) -> str | None:
        # A preview decodes with the family's decoder blocks; in request mode it has only the latents and the
        # request's parameters, not what the blocks before the loop made.
        leaves = list(modular_blocks(pipeline_name).get_execution_blocks(prompt="").sub_blocks.values())
        given, needs = {"latents", "output_type", *_PARAM_INPUTS}, set()
        for block in leaves[next(i for i, b in enumerate(leaves) if _is_loop(b)) + 1 :]:
            needs |= {p.name for p in block.inputs if p.required and p.name not in given}
            given |= {out.name for out in block.intermediate_outputs}
        if not needs:
            return None
        return f"in execution_mode 'request': its decoder blocks read {', '.join(sorted(needs))}; use 'step'"

    @classmethod
    def check_params(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> None:
        super().check_params(card, params)
        if MODULAR_FAMILIES[card.pipeline_name].one_output_per_prompt and params.num_outputs_per_prompt > 1:
            raise SamplingParamsError(
                "num_outputs_per_prompt",
                f"num_outputs_per_prompt must be 1 for {card.pipeline_name} in execution_mode 'step' or split into "
                f"stages (its modular blocks make one output per prompt), got {params.num_outputs_per_prompt}; "
                "serve it with execution_mode 'request' for more",
            )

    @classmethod
    def key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        return (params.height, params.width, params.num_frames)

    @classmethod
    def encode_key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        """What the text-encoder blocks read besides the prompts, equal for prompts encoded in one call: outputs per
        prompt, whether negatives are encoded (the guider's), whether negative prompts are given, and the
        family's ``extra_args``."""
        family = MODULAR_FAMILIES[card.pipeline_name]
        guided = family.guidance is None or family.guidance(params) is not None
        extra = tuple(sorted((k, str(v)) for k, v in params.extra_args.items() if k in family.extra_args))
        return (params.num_outputs_per_prompt, guided, params.negative_prompt is not None, extra)

    def _inputs(self, prompt: str | None, params: OmniDiffusionSamplingParams, seed: int | None) -> dict[str, Any]:
        n = params.num_outputs_per_prompt
        sizes = (params.height, params.width, params.num_frames, params.num_inference_steps, n, n)
        inputs = {
            **dict(zip(_PARAM_INPUTS, sizes, strict=True)),
            "prompt": prompt,
            "negative_prompt": params.negative_prompt,
            "generator": None if seed is None else generators_for(seed, n),
            "output_type": params.output_type,
            **{k: v for k, v in params.extra_args.items() if k in self.family.extra_args},
        }
        return {k: v for k, v in inputs.items() if v is not None}  # unset: the block's default

    @staticmethod
    def _run(blocks: list, components, state: PipelineState, inputs: dict[str, Any]) -> PipelineState:
        """``blocks`` in order on ``state``, with each input they name that is not set yet taken from ``inputs`` or
        its default (as ``ModularPipeline.__call__`` fills the state)."""
        for block in blocks:
            _fill(block, state, inputs)
            components, state = block(components, state)
        return state

    def _components(self, params: OmniDiffusionSamplingParams, scheduler: Any = None) -> RequestComponents:
        """The request's own view of the components: its guider, its scheduler (``scheduler``, else a fresh one), the
        denoiser stand-in."""
        guider = copy.copy(self.guider)  # not a new one: each guider's __init__ logs that guiders are experimental
        if self.family.guidance is not None:
            scale = self.family.guidance(params)
            guider.guidance_scale = scale or 1.0
            if scale is None:
                guider.disable()
        if scheduler is None:
            scheduler = fresh_noise_scheduler(self.pipeline, self.card.scheduler_overrides(params))
        denoiser: Any = self.denoiser  # its blocks before the loop read its config; the loop's passes call a stand-in
        if self.denoiser is None or self.input_name is None:  # an encode or decode stage (the two go together)
            loaded = self.pipeline.components.items()
            dtype = next((c.dtype for n, c in loaded if n in TEXT_ENCODERS and c is not None), self.pipeline.vae.dtype)
            denoiser = _Unloaded(self.denoiser_name, dtype)
        return RequestComponents(self.modular, scheduler, guider, {self.denoiser_name: denoiser}, self.execution_device)

    def encode(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        """The prompts (their params share an `encode_key`) through the family's text-encoder blocks in one call, as
        a request-mode batch encodes them; what the blocks made split back per request (`_per_prompt`)."""
        components = self._components(params[0], self.pipeline.scheduler)  # the text blocks never step it
        if self.encodes_negatives:  # a guider that guides, whatever the request's scale
            components.guider = copy.copy(self.guider)
            components.guider.enable()
        inputs = self._inputs(None, params[0], None) | {"prompt": list(prompts)}
        if params[0].negative_prompt is not None:
            inputs["negative_prompt"] = [q.negative_prompt for q in params]
        with torch.no_grad(), self._adapters(text=[q.lora for q in params]):
            state = self._run(self.encode_blocks, components, PipelineState(), inputs)
        made = {name: state.get(name) for name in self.encoded}
        return [Conditioning({}, None, {}, blocks=blocks) for blocks in _per_prompt(made, len(prompts))]

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        """The family's blocks before its loop, from the encoded prompt: inputs, noise, timesteps, positions."""
        assert conditioning.blocks is not None, "a modular family's encode stage hands on its blocks' outputs"
        components = self._components(params)
        state, loop = self._start_blocks(components, conditioning.blocks, self._inputs(None, params, seed))
        return self._step_state(params, components, state, loop)

    def _start_blocks(self, components, encoded: dict[str, Any], inputs: dict[str, Any]) -> tuple[PipelineState, Any]:
        """The blocks before the loop on what the encode blocks made: the pipeline state they leave, and the loop's
        block state at its first step."""
        state = PipelineState()
        for name, value in encoded.items():
            state.set(name, _on_device(value, self.device), self.encoded[name])
        with torch.no_grad():
            state = self._run(self.start_blocks, components, state, inputs)
            return state, _loop_start(self.loop, components, state)

    @staticmethod
    def _step_state(params: OmniDiffusionSamplingParams, components, state: PipelineState, loop) -> StepState:
        # Its denoiser inputs are its loop's (cond, uncond and shared stay empty).
        blocks = {"loop": loop, "pipeline": state, "components": components, "inputs": _input_names(loop)}
        return ModularStepState(params, loop.latents, components.scheduler, loop.timesteps, {}, None, {}, **blocks)

    def start_all(
        self, conditionings: list[Conditioning], params: list[OmniDiffusionSamplingParams], seeds: list[int]
    ) -> list[StepState]:
        """`start` of each request, the blocks before the loop run once for the requests that differ only in their
        prompt's rows and seed (`_start_key`), as a request-mode batch runs them once, and what they made split
        back per request (`_Rows`): on tiny Qwen-Image a request's blocks before the loop cost about what four
        requests' do, as its text encoder did."""
        groups: dict[Hashable, list[int]] = {}
        for i, (conditioning, request) in enumerate(zip(conditionings, params, strict=True)):
            groups.setdefault(self._start_key(conditioning, request, i), []).append(i)
        states: dict[int, StepState] = {}
        for group in groups.values():
            started = (
                self._start_group(
                    [conditionings[i] for i in group], [params[i] for i in group], [seeds[i] for i in group]
                )
                if len(group) > 1
                else [self.start(conditionings[group[0]], params[group[0]], seeds[group[0]])]
            )
            states.update(zip(group, started, strict=True))
        return [states[i] for i in range(len(params))]

    def _start_key(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, index: int) -> Hashable:
        """Equal for requests whose blocks before the loop can run in one call: one output each, the same sizes,
        steps, schedule, guidance and block inputs, and encoded rows of the same shapes (the prompts of one encode
        call are padded alike). A request's index where it starts alone."""
        assert conditioning.blocks is not None, "a modular family's encode stage hands on its blocks' outputs"
        encoded: list[tuple[str, Any]] = []
        for name, value in conditioning.blocks.items():
            if isinstance(value, torch.Tensor):
                encoded.append((name, (tuple(value.shape), value.dtype)))
            elif isinstance(value, list) and all(isinstance(row, torch.Tensor) for row in value):
                encoded.append((name, len(value)))  # a tensor per row, of its own length (Z-Image's embeddings)
            elif value is None:
                encoded.append((name, None))
            else:
                return ("alone", index)
        if params.num_outputs_per_prompt != 1:
            return ("alone", index)
        guidance = None if self.family.guidance is None else self.family.guidance(params)
        overrides = tuple(sorted(self.card.scheduler_overrides(params).items()))
        inputs = self._inputs(None, params, None)
        return (tuple(sorted((k, repr(v)) for k, v in inputs.items())), guidance, overrides, tuple(encoded))

    def _start_group(
        self, conditionings: list[Conditioning], params: list[OmniDiffusionSamplingParams], seeds: list[int]
    ) -> list[StepState]:
        """The blocks before the loop once for requests of one `_start_key`: their encoded rows concatenated (a
        value all of them share, once), one generator per request (diffusers draws each row's noise with its own,
        so each request's noise is the one it draws alone), then each request's rows of what they made. The first
        group whose blocks make a set of values also starts its first request alone, which tells `_Rows` which of them
        are per request."""
        encoded: dict[str, Any] = {}
        for name, first in conditionings[0].blocks.items():  # type: ignore[union-attr]  # checked by _start_key
            values = [c.blocks[name] for c in conditionings]  # type: ignore[index]
            if all(v is first for v in values):
                encoded[name] = first
            else:
                encoded[name] = torch.cat(values) if isinstance(first, torch.Tensor) else [r for v in values for r in v]
        components = self._components(params[0])
        inputs = self._inputs(None, params[0], None) | {"generator": [generators_for(seed, 1)[0] for seed in seeds]}
        state, loop = self._start_blocks(components, encoded, inputs)
        names = (frozenset(state.values), frozenset(vars(loop)))
        alone, rows = None, self._rows.get(names)
        if rows is None:
            alone = self.start(conditionings[0], params[0], seeds[0])
            rows = self._rows[names] = _Rows(state, loop, _modular(alone), len(params))
        started = []
        for i, request in enumerate(params):
            if i == 0 and alone is not None:
                started.append(alone)
                continue
            # its own scheduler, the group's timesteps set: the group's own for the last request
            scheduler = components.scheduler if i == len(params) - 1 else scheduler_copy(components.scheduler)
            mine, own_loop = rows.part(state, loop, i)
            started.append(self._step_state(request, self._components(request, scheduler), mine, own_loop))
        return started

    def predict(self, steps: list[StepState]) -> list[torch.Tensor]:
        """Each group of requests whose loop inputs can be put together (`_groups`) runs the loop's sub-blocks up to
        the update once on its rows, twice in all: the first pass records the denoiser calls, which are made as few
        forwards over all groups as their arguments allow (`_forwards`), the second answers them; once where one
        group makes one call (`_answered_at_once`)."""
        joined_before, self._joined = self._joined, {}
        passes = [
            self._group_pass(group, kept) for group, kept in self._groups(list(map(_modular, steps)), joined_before)
        ]
        with torch.no_grad():
            if len(passes) == 1 and _one_call(passes[0]):
                self._answered_at_once(passes[0])
            else:
                for group in passes:
                    self._sub_blocks(group, self.predict_blocks)
                    self._record_first_steps(group)
                self._forwards(passes)
                for group in passes:
                    self._sub_blocks(group, self.predict_blocks)
        predictions: dict[int, torch.Tensor] = {}
        for group in passes:
            predictions.update(zip(map(id, group.states), group.loop.noise_pred.split(group.counts), strict=True))
        return [predictions[id(state)] for state in steps]

    def _groups(
        self, states: list[ModularStepState], joined_before: dict[tuple[int, ...], _Joined]
    ) -> list[tuple[list[ModularStepState], _Joined | None]]:
        """The requests in groups whose loop sub-blocks run once on their rows: a guider that acts alike at their
        steps (`_guided_alike`), and loop inputs that can be put together (`batched`: per-row tensors and lists
        concatenated, masked embeddings padded, anything else equal; found once while a group stays as it is); each
        with its inputs as the last step put them together, where it was one group then and nothing changed since."""
        alike: dict[Hashable, list[ModularStepState]] = {}
        for state in states:
            alike.setdefault(self._guided_alike(state), []).append(state)
        groups: list[tuple[list[ModularStepState], _Joined | None]] = []
        for members in alike.values():
            kept = joined_before.get(tuple(map(id, members)))
            if kept is not None and kept.holds(members):
                groups.append((members, kept))
                continue
            values = [_loop_inputs(state) for state in members]
            groups += [([members[i] for i in group], None) for group in batched(values, "latents")]
        return groups

    @staticmethod
    def _guided_alike(state: ModularStepState) -> Hashable:
        """What its guider does at its step, for requests whose guiders can be one: classifier-free guidance at
        the same scale, on or off at this step. Any other guider (one that keeps state across steps), and a
        request whose denoiser inputs the SDE sampler records at this step, runs alone."""
        assert state.components is not None, "set by start"
        guider = state.components.guider
        if type(guider) is not ClassifierFreeGuidance or (state.sde is not None and state.step == 0):
            return id(state)
        guider.set_state(step=state.step, num_inference_steps=len(state.timesteps), timestep=state.timestep)
        return (guider.guidance_scale, guider.guidance_rescale, guider.use_original_formulation, guider.num_conditions)

    def _group_pass(self, group: list[ModularStepState], kept: _Joined | None) -> _GroupPass:
        """The group's pass, whose sub-blocks see its first request's guider (all act alike) and `DenoiserCalls`;
        its inputs as they were put together at the last step (``kept``, where nothing changed), kept for the next
        unless one of its requests ends at this step."""
        first = group[0].components
        assert first is not None and self.denoiser is not None and self.input_name is not None, "a denoise stage"
        inputs = _Joined(group) if kept is None else kept
        if all(state.step + 1 < len(state.timesteps) for state in group):
            self._joined[tuple(map(id, group))] = inputs
        recorder = DenoiserCalls(self.denoiser, self.input_name, self.signature)
        denoisers: dict[str, DenoiserCalls | _Unloaded] = {self.denoiser_name: recorder}
        components = RequestComponents(self.modular, first.scheduler, first.guider, denoisers, self.execution_device)
        return _GroupPass(group, inputs, components, recorder)

    def _sub_blocks(self, group: _GroupPass, blocks: list) -> None:
        components, first = group.components, group.states[0]
        for block in blocks:
            components, group.loop = block(components, group.loop, i=first.step, t=group.timestep)

    def _record_first_steps(self, group: _GroupPass) -> None:
        """The text inputs a stochastic request's denoiser sees, as request mode records them (it runs alone)."""
        state = group.states[0]
        if state.sde is not None and state.step == 0:
            seen = [{k: v for k, v in call.items() if k in EMBEDDING_NAMES} for call in group.recorder.calls]
            record_first_step([state.sde], seen, state.params.num_outputs_per_prompt)

    def _answered_at_once(self, group: _GroupPass) -> None:
        """A step's only group, whose guider makes one denoiser call: one pass of its sub-blocks, the call answered
        by its forward as it is made (a recording pass would find nothing to put together with it)."""
        _cache_timesteps([group], self.step_cache)
        group.recorder.answer = lambda call: self._forward([(group, call)])[0]
        self._sub_blocks(group, self.predict_blocks)
        self._record_first_steps(group)

    def _forwards(self, passes: list[_GroupPass]) -> None:
        """The recorded calls of every group as few forwards as their arguments allow; each call answered with its
        rows."""
        assert self.input_name is not None, "the stage that steps loads the denoiser"
        calls = [(group, call) for group in passes for call in group.recorder.calls]
        _cache_timesteps(passes, self.step_cache)
        for indices in batched([call for _, call in calls], self.input_name):
            members = [calls[i] for i in indices]
            for (group, call), rows in zip(members, self._forward(members), strict=True):
                group.answers[id(call)] = rows
        for group in passes:
            group.recorder.answers = [group.answers[id(call)] for call in group.recorder.calls]

    def _forward(self, members: list[tuple[_GroupPass, dict[str, Any]]]) -> list[Any]:
        """One forward of recorded calls (each with its group) whose arguments can be put together, each row with its
        request's adapters and step cache; each call's rows of its output."""
        assert self.denoiser is not None and self.input_name is not None, "the stage that steps loads the denoiser"
        counts = [len(call[self.input_name]) for _, call in members]
        per_row = self.lora is not None or self.step_cache is not None  # who owns each row: for adapters, caches
        owners = (
            [state for group, call in members for state in group.owners(len(call[self.input_name]))] if per_row else []
        )
        kwargs = members[0][1] if len(members) == 1 else joined([call for _, call in members], counts)
        cached = (
            contextlib.nullcontext() if self.step_cache is None else self.step_cache.rows([s.cache for s in owners])
        )
        with self._adapters(denoiser=[state.params.lora for state in owners]), cached:
            output = self.denoiser(**kwargs)[0]
        starts = [sum(counts[:i]) for i in range(len(counts))]  # the output is a tensor, or a list of rows (Z-Image)
        return [output[start : start + n] for start, n in zip(starts, counts, strict=True)]

    def advance(self, steps: list[StepState], predictions: list[torch.Tensor]) -> None:
        for state, prediction in zip(map(_modular, steps), predictions, strict=True):
            assert state.components is not None, "set by start"
            x, scheduler, t = state.loop.latents, state.components.scheduler, state.timestep
            sde = state.sde
            index = None if sde is None else schedule_index(scheduler, t)  # before the update moves it on
            state.loop.noise_pred = prediction
            components = state.components
            for block in self.update_blocks:  # its own scheduler's step
                components, state.loop = block(components, state.loop, i=state.step, t=t)
            if sde is not None and index is not None:
                taken = sde.step(x, prediction, t, scheduler.sigmas, index)
                if taken is not None:
                    state.loop.latents = taken.to(state.loop.latents.dtype)
            state.latents = state.loop.latents
            state.step += 1

    def decode_inputs(self, state: StepState) -> dict[str, Any] | None:
        """What its decoder blocks read of the request's state besides the latents (`Latents.blocks`)."""
        pipeline_state = _modular(state).pipeline
        assert pipeline_state is not None, "set by start"
        made = pipeline_state.values
        return {name: made[name] for name in self.decoded if name != "latents" and made.get(name) is not None}

    def decode(self, states: list[Latents] | list[StepState]) -> list[list[Any]]:
        """The requests' latents through the family's decoder blocks: one call for the requests whose decoder inputs
        can be put together as a step's denoiser calls are (`batched`: per-row tensors such as FLUX.2's
        ``latent_ids`` concatenated, any other input equal), where the family decodes batches."""
        requests = []
        for state in states:
            known = state.blocks if isinstance(state, Latents) else self.decode_inputs(state)
            inputs = self._inputs(None, state.params, None) | (known or {}) | {"latents": state.latents}
            requests.append({name: inputs[name] for name in self.decoded if name in inputs})
        outputs: list[list[Any]] = [[] for _ in states]
        for group in batched(requests, "latents") if self.family.batched_decode else [[i] for i in range(len(states))]:
            rows = [len(requests[i]["latents"]) for i in group]
            with torch.no_grad():
                decoded = self._run(
                    self.after, self.modular, PipelineState(), joined([requests[i] for i in group], rows)
                )
            items = list(decoded.get("images" if states[group[0]].params.num_frames is None else "videos"))
            for i, n in zip(group, rows, strict=True):
                outputs[i], items = items[:n], items[n:]
        return outputs
