"""Step mode scripted for checks against the stock pipeline: requests join a running batch at given engine steps,
as they do in the step engine (tests/diffusion/families/test_steppers.py, benchmarks/gpu_check.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from vllm_omni.diffusion.families.steppers import Stepper, StepState
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


def run_joined(
    stepper: Stepper,
    script: Iterable[tuple[int, str, str, OmniDiffusionSamplingParams, int]],
    begin: Callable[[str, OmniDiffusionSamplingParams, int], StepState] | None = None,
) -> tuple[dict[str, list[Any]], int]:
    """``script``: per request (engine step it joins at, name, prompt, complete params, seed). One forward per
    engine step over all running requests, each on its own schedule; a request is decoded when its last step is
    done. ``begin(prompt, params, seed)`` makes a request's state (default `Stepper.prepare`: one diffusion stage;
    a split pipeline starts from another stage's encoding). Returns each request's outputs by name, and the most
    requests one forward held."""
    begin = begin or stepper.prepare
    pending = sorted(script, key=lambda entry: entry[0])
    running: list[tuple[str, StepState]] = []
    outputs: dict[str, list[Any]] = {}
    largest, step = 0, 0
    with torch.inference_mode():
        while pending or running:
            while pending and pending[0][0] <= step:
                _, name, prompt, params, seed = pending.pop(0)
                running.append((name, begin(prompt, params, seed)))
            states = [state for _, state in running]
            if states:
                largest = max(largest, len(states))
                stepper.advance(states, stepper.predict(states))
                finished = [(name, state) for name, state in running if state.done]
                if finished:
                    decoded = stepper.decode([state for _, state in finished])
                    outputs.update({name: items for (name, _), items in zip(finished, decoded, strict=True)})
                running = [(name, state) for name, state in running if not state.done]
            step += 1
    return outputs, largest
