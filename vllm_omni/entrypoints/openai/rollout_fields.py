"""The request fields of stochastic sampling for RL rollouts ([rl.md](rl.md)), shared by the Images and Videos
APIs under verl-omni's names, each copied into the request's ``extra_args`` (`vllm_omni.diffusion.features.sde` checks
and applies them), and what an answer carries of them: each output's log-probabilities."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from vllm_omni.entrypoints.openai.request_fields import Sampling
from vllm_omni.outputs import OmniRequestOutput


class RolloutFields(BaseModel):
    """Stochastic (SDE) sampling on flow-matching models (Flux, SD3, Wan, Qwen-Image); a 400 naming the field on
    other schedulers."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    sde_type: Annotated[Literal["sde", "cps", "dance_sde"] | None, Sampling(extra_args=True)] = None
    """Extension. Sample stochastically, as RL rollouts do ([rl.md](rl.md)): ``sde`` (Flow-GRPO), ``cps``
    (coefficients-preserving) or ``dance_sde`` (DanceGRPO). Unset: ``sde`` when another field below asks for
    stochastic sampling, else plain sampling."""
    noise_level: Annotated[float | None, Sampling(extra_args=True)] = Field(default=None, ge=0.0, le=10.0)
    """Extension. The SDE's noise level (at most 1 for ``cps``). Unset: 0.7."""
    sde_window_size: Annotated[StrictInt | None, Sampling(extra_args=True)] = Field(default=None, ge=1)
    """Extension. Only this many consecutive steps are stochastic, the others plain Euler. Unset: every step."""
    sde_window_range: Annotated[tuple[StrictInt, StrictInt] | None, Sampling(extra_args=True)] = None
    """Extension. ``[lo, hi]``: the window starts at a step drawn from the request's seed in ``[lo, hi − size]``.
    Needs ``sde_window_size``. Unset: all steps."""
    logprobs: Annotated[StrictBool | None, Sampling(extra_args=True)] = None
    """Extension. Answer each image (video) with ``log_probs``, the log-probability of each stochastic step; needs
    a JSON answer (not ``response_format: file``, not ``/v1/videos/sync``)."""


def output_log_probs(output: OmniRequestOutput) -> list[list[float] | None]:
    """Each output's log-probabilities of its stochastic steps; ``None`` each without ``logprobs``."""
    count = len(output.videos or output.images)
    if output.trajectory_log_probs is None:
        return [None] * count
    return [row.tolist() for row in output.trajectory_log_probs]
