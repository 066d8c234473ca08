"""The graph facts of each stage type (`STAGE_TYPES`: what it takes, whether it is final, what runs it) and the
check of a deploy's stage graph (`check_stage_graph`). A stage type's behaviour when it runs is its role
(``vllm_omni.diffusion.engine.roles``, ``vllm_omni.llm``)."""

from __future__ import annotations

import graphlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

StageEngine = Literal["diffusers", "vllm", "codec"]
"""What runs a stage: a diffusers pipeline on this project's engines, an LLM on vLLM's engine, or an audio codec
decoding a talker's code windows (``vllm_omni.codec``)."""


@dataclass(frozen=True)
class StageTypeSpec:
    """What the deploy graph knows about one stage type (one entry of `STAGE_TYPES`; its behaviour when it runs is
    its role)."""

    takes: str | None
    """The stage type it takes its one input from; ``None``: it takes the request itself and lists no inputs."""

    final: bool
    """Whether its outputs are the request's (images, videos or audio): a deploy ends with exactly one final stage."""

    denoises: bool
    """Whether it holds the denoiser: it fills in the model's defaults, reports progress and takes
    ``execution_mode``."""

    adapts: bool
    """Whether it serves LoRA adapters (it takes the LoRA knobs): it holds the whole pipeline, as diffusers loads an
    adapter into every component it targets at once."""

    runs: StageEngine = "diffusers"
    """Its engine: a diffusers pipeline (the pipeline knobs apply), vLLM (the llm keys apply) or a codec."""

    admits: bool | None = None
    """Whether it completes a request's parameters from the model's card (the stage that holds the denoiser, or a
    speech model's codec stage); ``None``: as ``denoises``."""

    writes_prompt: bool = False
    """Whether its output is the prompt of the stage that takes it (an llm stage's generated text), rather than a
    payload; such a stage may feed a stage that takes the request itself, and a request may skip it."""

    own_model: str | None = None
    """What the stage's own ``model`` key names, which it then requires (an llm stage's LLM, a codec stage's codec);
    ``None``: it runs the deploy's model."""

    backend: tuple[str, str] | None = None
    """The one ``distributed_executor_backend`` it runs on, and why; ``None``: any."""


STAGE_TYPES: dict[str, StageTypeSpec] = {
    "diffusion": StageTypeSpec(takes=None, final=True, denoises=True, adapts=True),
    "encode": StageTypeSpec(takes=None, final=False, denoises=False, adapts=False),
    "denoise": StageTypeSpec(takes="encode", final=False, denoises=True, adapts=False),
    "decode": StageTypeSpec(takes="denoise", final=True, denoises=False, adapts=False),
    "llm": StageTypeSpec(
        takes=None,
        final=False,
        denoises=False,
        adapts=False,
        runs="vllm",
        writes_prompt=True,
        own_model="the LLM's",
        backend=("ray", "an llm stage's replicas are Ray actors (vLLM's engine runs in a process of its own)"),
    ),
    "codec": StageTypeSpec(
        takes="llm",
        final=True,
        denoises=False,
        adapts=False,
        runs="codec",
        admits=True,
        own_model="the codec's",
        backend=("inline", "a codec stage runs inline in this release (its decoder is small beside the talker)"),
    ),
}
"""The stage types this release serves."""


def check_stage_keys(stage_type: str, stage_id: int, values: Mapping[str, Any], written: Callable[[str], str]) -> None:
    """The keys a stage type's table entry requires of its stage: its own model, its one executor backend."""
    spec, where = STAGE_TYPES[stage_type], f"stage {stage_id} ({stage_type})"
    if spec.own_model is not None and not values["model"]:
        raise ValueError(f"{where}: model is required: {spec.own_model} folder or Hugging Face repo id")
    if spec.backend is not None and values["distributed_executor_backend"] != spec.backend[0]:
        raise ValueError(
            f"{where}: {written('distributed_executor_backend')}: {spec.backend[1]}; set it to "
            f"{spec.backend[0]!r} or leave it unset"
        )


class StageNode(Protocol):
    """What the graph check reads of a stage (a `StageDeployConfig`): read-only, as a frozen config's fields are."""

    @property
    def stage_id(self) -> int: ...

    @property
    def stage_type(self) -> str: ...

    @property
    def inputs(self) -> Sequence[int]: ...


S = TypeVar("S", bound=StageNode)


def check_stage_graph(stages: list[S]) -> list[S]:
    """The stages in the order a request passes them; ValueError naming the stage and the problem for an unknown
    input, a cycle, an input of the wrong type, or not exactly one final stage."""
    by_id = {s.stage_id: s for s in stages}
    for stage in stages:
        unknown = [i for i in stage.inputs if i not in by_id]
        if unknown:
            raise ValueError(f"stage {stage.stage_id} lists unknown input(s) {unknown}; stage ids: {sorted(by_id)}")
    try:
        order = [by_id[i] for i in graphlib.TopologicalSorter({s.stage_id: s.inputs for s in stages}).static_order()]
    except graphlib.CycleError as exc:
        cycle = exc.args[1][::-1]  # graphlib lists it along the outputs (b, a: a takes b's output); we say a <- b
        raise ValueError(
            f"stage {cycle[0]}: inputs form a cycle ({' <- '.join(map(str, cycle))}, where a <- b means "
            "stage a takes stage b's output)"
        ) from None
    for stage in order:
        spec = STAGE_TYPES[stage.stage_type]
        # An llm stage's text is a prompt, but for the stage type that takes llm stages (codec) it is the input.
        prompts = [
            i
            for i in stage.inputs
            if STAGE_TYPES[by_id[i].stage_type].writes_prompt and by_id[i].stage_type != spec.takes
        ]
        inputs = [i for i in stage.inputs if i not in prompts]
        if prompts and (len(prompts) > 1 or spec.takes is not None or spec.runs != "diffusers"):
            raise ValueError(
                f"stage {stage.stage_id} ({stage.stage_type}) lists llm stage(s) {prompts} as inputs; an llm stage's "
                "text is the prompt of one stage that takes the request itself (diffusion or encode), and such a "
                "stage takes at most one"
            )
        if spec.takes is None and inputs:
            raise ValueError(
                f"stage {stage.stage_id} ({stage.stage_type}) takes the request itself, so it has no inputs "
                f"(but an llm stage's prompt); it lists {list(stage.inputs)}"
            )
        if spec.takes is not None and (len(inputs) != 1 or by_id[inputs[0]].stage_type != spec.takes):
            got = [f"{i} ({by_id[i].stage_type})" for i in stage.inputs]
            raise ValueError(
                f"stage {stage.stage_id} ({stage.stage_type}) takes exactly one input, a stage of type "
                f"{spec.takes!r}; it lists {got or 'none'}"
            )
    consumed = {i for s in stages for i in s.inputs}
    sinks = [s for s in order if s.stage_id not in consumed]
    final_types = [t for t, spec in STAGE_TYPES.items() if spec.final]
    if len(sinks) != 1 or not STAGE_TYPES[sinks[0].stage_type].final:
        ends = ", ".join(f"{s.stage_id} ({s.stage_type})" for s in sinks)
        raise ValueError(
            f"a deploy needs exactly one final stage, a {', '.join(final_types[:-1])} or {final_types[-1]} stage that "
            "no other stage "
            f"takes as input; the stages no other stage takes are: {ends}"
        )
    return order
