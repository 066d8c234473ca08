"""The parallel knobs of a stage (``cfg_parallel_size``, ``ulysses_degree``, ``ring_degree``,
``vae_patch_parallel_size``, ``tensor_parallel_size``; upstream vllm-omni's names): one request on several devices.
Their world size, and the combinations the resolver refuses before anything loads, naming each knob as written.

The checks against the model read its diffusers folder (``model_index.json`` and each denoiser's ``config.json``)
and import diffusers for the classes it names, only when a degree above 1 asks for them.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

PARALLEL_KNOBS = ("cfg_parallel_size", "ulysses_degree", "ring_degree", "vae_patch_parallel_size")
"""The degrees whose product is a stage's world size (its ranks per replica)."""

SEQUENCE_KNOBS = ("ulysses_degree", "ring_degree")
"""The degrees of diffusers' context parallelism (``ContextParallelConfig``), which split the denoiser's sequence."""

DENOISERS = ("transformer", "transformer_2", "unet")
"""The components of a diffusers folder that denoise."""


def check_tensor_parallel_size(value: Any) -> Any:
    """``tensor_parallel_size``: 1 only."""
    if value != 1:
        raise ValueError(
            "tensor_parallel_size is accepted as 1 only: diffusion stages do not shard the denoiser's weights; "
            "split one request over devices with ulysses_degree, ring_degree or cfg_parallel_size"
        )
    return value


def world_size(values: Mapping[str, Any]) -> int:
    """The ranks of one replica: the product of the parallel degrees."""
    return math.prod(values[k] for k in PARALLEL_KNOBS)


def sequence_ranks(stage: Any) -> int:
    """The ranks of a resolved stage that split its denoiser's sequence (``ulysses_degree × ring_degree``): a
    request's tokens must divide by them (`vllm_omni.diffusion.parallel.ranks.check_sequence_split`)."""
    return math.prod(getattr(stage, k) for k in SEQUENCE_KNOBS)


def check_parallel(stage_id: int, values: Mapping[str, Any], written: Callable[..., str], folder: str | None) -> None:
    """The parallel knobs together, against the devices given and, when ``folder`` (the model's diffusers folder)
    is known, against the model; ValueError naming each knob as it was written."""
    world = world_size(values)
    num_gpus = values["num_gpus"]
    if values["distributed_executor_backend"] == "inline" and num_gpus is not None and num_gpus != world:
        degrees = " x ".join(written(k) for k in PARALLEL_KNOBS if values[k] > 1) or "the parallel degrees (all 1)"
        raise ValueError(
            f"stage {stage_id}: {written('num_gpus')} is the replica's device count, one per rank, but {degrees} "
            f"make {world} rank(s): give num_gpus {world}, or set ulysses_degree, ring_degree, cfg_parallel_size "
            f"or vae_patch_parallel_size so that their product is {num_gpus:g}"
        )
    if world == 1:
        return
    given = " x ".join(written(k) for k in PARALLEL_KNOBS if values[k] > 1)
    devices = values["devices"]
    if devices is not None and world > len(devices.split(",")):
        raise ValueError(
            f"stage {stage_id}: {given} make {world} ranks per replica, one device each, but {written('devices')} "
            f"gives {len(devices.split(','))}: list {world} devices or lower the degrees"
        )
    if values["distributed_executor_backend"] == "ray" and num_gpus is not None and 0 < num_gpus < world:
        raise ValueError(
            f"stage {stage_id}: {given} make {world} ranks per replica, one GPU each, but {written('num_gpus')} "
            f"reserves fewer for each replica: set num_gpus to {world} or lower the degrees"
        )
    if folder is not None:
        _check_model(stage_id, values, written, folder)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def _check_model(stage_id: int, values: Mapping[str, Any], written: Callable[..., str], folder: str) -> None:
    """What the model's folder says of the degrees: a denoiser that diffusers' context parallelism can split
    (``_cp_plan``) into heads the Ulysses degree divides, and a pipeline with classifier-free guidance."""
    import diffusers

    index = _read_json(os.path.join(folder, "model_index.json"))
    sequence = [k for k in SEQUENCE_KNOBS if values[k] > 1]
    for name in (n for n in DENOISERS if isinstance(index.get(n), list) and index[n][1] is not None):
        cls = getattr(diffusers, index[name][1], None)  # one diffusers lacks: not known here
        if sequence and cls is not None and getattr(cls, "_cp_plan", None) is None:
            raise ValueError(
                f"stage {stage_id}: {' and '.join(written(k) for k in sequence)} split the denoiser's sequence with "
                f"diffusers' context parallelism, and {index[name][1]} ({name}) declares no _cp_plan for it: "
                "set them to 1 for this model"
            )
        heads = _read_json(os.path.join(folder, name, "config.json")).get("num_attention_heads")
        if values["ulysses_degree"] > 1 and isinstance(heads, int) and heads % values["ulysses_degree"]:
            raise ValueError(
                f"stage {stage_id}: {written('ulysses_degree')} gives each rank a share of the attention heads, and "
                f"{index[name][1]} ({name}) has {heads}, which it does not divide: use a divisor of {heads}, or "
                "ring_degree"
            )
    if values["cfg_parallel_size"] > 1:
        class_name = index.get("_class_name")  # [module, class] for the model's own pipeline class: not known here
        pipeline = getattr(diffusers, class_name, None) if isinstance(class_name, str) else None
        call = inspect.signature(pipeline.__call__).parameters if pipeline is not None else {}
        if pipeline is not None and not {"negative_prompt", "negative_prompt_embeds"} & set(call):
            raise ValueError(
                f"stage {stage_id}: {written('cfg_parallel_size')} runs the conditional and unconditional branches of "
                f"classifier-free guidance on two ranks, and {index.get('_class_name')} has no classifier-free "
                "guidance (its call takes no negative prompt): set cfg_parallel_size to 1"
            )
