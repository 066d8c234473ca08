"""Stage roles: what a stage of each type does, in one table (`ROLES`; docs/stages.md, docs/architecture.md).

A role owns, for its stage type: the pipeline components the stage skips when it loads, whether it completes
sampling parameters, its batch key (`StageAdmission`, from the model's card alone), how a request begins
(`begin`: encode and start, or start from the previous stage's payload) and how requests end (`end`: decode to
images or videos, or hand latents on), and `run`, one batch in request mode. The engines (`request_mode.py`,
`step_mode.py`) run any role; the graph facts of a stage type (what it takes as input, whether it is final,
whether it denoises) live in `vllm_omni.config.stage_types.STAGE_TYPES`. Adding a stage type is one role here plus one
entry in each table.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_omni.config import STAGE_TYPES, OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine.denoise import denoise_step
from vllm_omni.diffusion.engine.request import BatchKey, DiffusionRequest
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.pipeline_facts import check_batchable
from vllm_omni.diffusion.families.steppers import (
    SPLIT,
    STEP_MODE,
    SUPPORTED_PIPELINES,
    Latents,
    Stepper,
    StepState,
    make_stepper,
    stepper_class,
)
from vllm_omni.diffusion.features.previews import Previews
from vllm_omni.diffusion.features.sde import SdeSampler, check_sde
from vllm_omni.diffusion.parallel.ranks import check_sequence_split
from vllm_omni.diffusion.pipeline.components import DENOISERS, TEXT_ENCODERS
from vllm_omni.diffusion.pipeline.runner import DiffusionRunner, read_model_index
from vllm_omni.errors import SamplingParamsError
from vllm_omni.outputs import IgnoredField
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


@dataclass(frozen=True)
class Admission:
    """A request's sampling parameters with the model's defaults filled in, and the batch key they give."""

    params: OmniDiffusionSamplingParams
    key: Hashable
    ignored: tuple[IgnoredField, ...] = ()
    """The fields the model would not use, dropped from ``params`` (`ModelCard.complete_params`)."""


class StageRole:
    """One stage type's behaviour; a subclass per type, registered in `ROLES`."""

    stage_type: ClassVar[str]
    skips: ClassVar[tuple[str, ...]] = ()
    """Pipeline components the stage does not load (a split stage holds only what it runs)."""
    completes_params: ClassVar[bool] = False
    """Whether the stage fills in the model's defaults: the stage that holds the denoiser (its config sizes them);
    the stages around it take complete parameters."""
    split: ClassVar[bool] = True
    """Whether it is one part of a split pipeline: it needs the model's stepper, and the other stages to run."""

    def __init__(self, od_config: OmniDiffusionConfig, runner: DiffusionRunner, on_oom_split: Callable[[], None]):
        """``on_oom_split``: what the engine does when a batch ran out of memory and is split (request mode's
        denoising loop isolates failures per forward, as step mode does)."""
        self.runner = runner
        self.on_oom_split = on_oom_split
        self.stepper = (
            make_stepper(runner.pipeline, runner.device, SPLIT if self.split else STEP_MODE)
            if self.uses_stepper(od_config.stage.execution_mode)
            else None
        )
        """The model's `Stepper` when the stage steps or splits the pipeline, else ``None``."""
        if self.stepper is not None:
            self.stepper.lora = runner.lora
            self.stepper.step_cache = runner.step_cache
        self.previews: Previews | None = None
        """The partial images of its requests: made where the denoiser runs, through the model's stepper (one made
        for them alone in request mode); ``None`` where the model has none (admission refuses them there)."""
        if self.completes_params:
            previewing = self.stepper or _stepper_for_previews(runner)
            self.previews = None if previewing is None else Previews(previewing, previewing.preview_method)

    @property
    def stepping(self) -> Stepper:
        """`stepper`, where the stage runs through it (a split stage, or step mode)."""
        assert self.stepper is not None, f"this {self.stage_type} stage runs no stepper"
        return self.stepper

    @classmethod
    def uses_stepper(cls, execution_mode: str) -> bool:
        """Whether the stage runs the model through its stepper: it steps, or it is part of a split pipeline."""
        return cls.split or execution_mode == "step"

    @classmethod
    def admission(cls, execution_mode: str, card: ModelCard, sequence_ranks: int = 1) -> StageAdmission:
        """How a stage of this type admits requests for the model of ``card`` (``sequence_ranks``: its
        `vllm_omni.config.parallel.sequence_ranks`)."""
        stepper = stepper_class(card.pipeline_name) if cls.uses_stepper(execution_mode) else None
        return StageAdmission(cls, card, stepper, sequence_ranks)

    @property
    def final(self) -> bool:
        """Whether its outputs are images or videos (else it hands a payload to the next stage)."""
        return STAGE_TYPES[self.stage_type].final

    @classmethod
    def batch_key(cls, card: ModelCard, stepper: type[Stepper] | None, params: OmniDiffusionSamplingParams) -> Hashable:
        """What must match for complete ``params`` to share a batch (or, stepping, a forward)."""
        assert stepper is not None, f"a {cls.stage_type} stage steps"
        return stepper.key(card, params)

    def run(self, batch: list[DiffusionRequest]) -> list[Any]:
        """Request mode: one batch; one result per request (what `build_output` takes), or the exception that
        failed that request alone."""
        raise NotImplementedError

    def begin_key(self, request: DiffusionRequest) -> Hashable:
        """What must match for requests to `begin` together (step mode groups the requests it starts by it)."""
        return None

    def begin(self, requests: list[DiffusionRequest]) -> list[StepState]:
        """Each request's denoising state: noise and its own schedule around its encoded prompt (requests of one
        `begin_key`)."""
        raise NotImplementedError(f"a {self.stage_type} stage does not denoise")

    def end(self, requests: list[DiffusionRequest]) -> list[Any]:
        """The results of requests whose denoising is done."""
        raise NotImplementedError(f"a {self.stage_type} stage does not denoise")

    def _denoise(self, batch: list[DiffusionRequest]) -> list[Any]:
        """Request mode of a role that denoises: the batch runs its steps together, one forward per step over the
        requests that still have steps (each on its own schedule), until all are done or all are aborted."""
        failed: dict[int, BaseException] = {}
        for request, state in zip(batch, self.begin(batch), strict=True):
            request.state = state
            request.total_steps = len(state.timesteps)
        while not all(request.aborted for request in batch):
            pending = [r for r in batch if id(r) not in failed and not r.state.done]
            if not pending:
                break
            around_step = self.runner.extensions.around_step
            for request, error in denoise_step(pending, self.stepping, self.on_oom_split, self.previews, around_step):
                failed[id(request)] = error
        finished = [r for r in batch if id(r) not in failed]
        results = iter(self.end(finished) if finished else [])
        return [failed[id(r)] if id(r) in failed else next(results) for r in batch]


class DiffusionRole(StageRole):
    """``diffusion``: the whole pipeline. Request mode makes one pipeline call per batch; step mode encodes,
    steps and decodes through the model's stepper."""

    stage_type = "diffusion"
    completes_params = True
    split = False

    def __init__(self, od_config: OmniDiffusionConfig, runner: DiffusionRunner, on_oom_split: Callable[[], None]):
        super().__init__(od_config, runner, on_oom_split)
        if self.stepper is None:  # step mode batches forwards, not pipeline calls
            check_batchable(type(runner.pipeline), od_config.stage.max_num_seqs)

    @classmethod
    def batch_key(cls, card: ModelCard, stepper: type[Stepper] | None, params: OmniDiffusionSamplingParams) -> Hashable:
        if stepper is not None:
            return stepper.key(card, params)
        inputs = params.image is not None or params.video is not None
        if inputs and not card.for_task(params.task).batches_images:
            return (BatchKey.of(params), secrets.token_hex(8))  # a key no other request has: it runs alone
        return BatchKey.of(params)

    def run(self, batch: list[DiffusionRequest]) -> list[list[Any]]:
        return self.runner.run(batch, self.previews)

    def begin_key(self, request: DiffusionRequest) -> Hashable:
        return self.stepping.encode_key(self.stepping.card, request.params)

    def begin(self, requests: list[DiffusionRequest]) -> list[StepState]:
        # One text-encoder call for all the prompts, as a request-mode batch encodes them: on small models the
        # calls' fixed cost, paid once per request, was step mode's largest cost beside the forwards.
        stepper = self.stepping
        params = [r.params for r in requests]
        conditionings = stepper.encode([r.prompt for r in requests], params)
        started = stepper.start_all(conditionings, params, [r.seed for r in requests])
        return [_sampling(state, r) for state, r in zip(started, requests, strict=True)]

    def end(self, requests: list[DiffusionRequest]) -> list[list[Any]]:
        return self.stepping.decode([request.state for request in requests])


class EncodeRole(StageRole):
    """``encode``: the text encoders, once for a whole batch of prompts (a text-shaped key), and the VAE's encoder
    for each image task's input image."""

    stage_type = "encode"
    skips = DENOISERS

    @classmethod
    def batch_key(cls, card: ModelCard, stepper: type[Stepper] | None, params: OmniDiffusionSamplingParams) -> Hashable:
        assert stepper is not None, "an encode stage steps"
        return stepper.encode_key(card, params)

    def run(self, batch: list[DiffusionRequest]) -> list[Any]:
        return self.stepping.encode([r.prompt for r in batch], [r.params for r in batch])


class DenoiseRole(StageRole):
    """``denoise``: starts from the encoded prompt of the ``encode`` stage and hands the final latents on."""

    stage_type = "denoise"
    skips = TEXT_ENCODERS  # the VAE stays: its config sizes the latents
    completes_params = True

    def run(self, batch: list[DiffusionRequest]) -> list[Any]:
        return self._denoise(batch)

    def begin(self, requests: list[DiffusionRequest]) -> list[StepState]:
        started = self.stepping.start_all(
            [r.payload for r in requests], [r.params for r in requests], [r.seed for r in requests]
        )
        return [_sampling(state, r) for state, r in zip(started, requests, strict=True)]

    def end(self, requests: list[DiffusionRequest]) -> list[Latents]:
        return [
            Latents(r.state.latents, r.params, r.trajectory, self.stepping.decode_inputs(r.state)) for r in requests
        ]


class DecodeRole(StageRole):
    """``decode``: the VAE, once for a whole batch of latents (a latent-shaped key), then each request's images or
    frames."""

    stage_type = "decode"
    skips = TEXT_ENCODERS + DENOISERS

    @classmethod
    def batch_key(cls, card: ModelCard, stepper: type[Stepper] | None, params: OmniDiffusionSamplingParams) -> Hashable:
        assert stepper is not None, "a decode stage steps"
        return stepper.decode_key(card, params)

    def run(self, batch: list[DiffusionRequest]) -> list[list[Any]]:
        # The denoise stage may run on another device or in another dtype; on the same ones nothing is copied.
        device, dtype = self.stepping.device, self.stepping.pipeline.vae.dtype
        for request in batch:  # the denoise stage's record becomes this final stage's output
            request.trajectory = request.payload.trajectory
        payloads = [r.payload for r in batch]
        return self.stepping.decode([Latents(p.latents.to(device, dtype), p.params, blocks=p.blocks) for p in payloads])


def _sampling(state: StepState, request: DiffusionRequest) -> StepState:
    """``state`` with the request's stochastic sampler (`sde.SdeSampler`), which records the text inputs its
    denoiser sees; none for plain sampling."""
    state.sde = SdeSampler.of(request.params, request.seed, len(state.timesteps))
    if state.sde is not None:
        state.sde.record_embeds(state.cond, state.uncond)
    return state


def _stepper_for_previews(runner: DiffusionRunner) -> Stepper | None:
    """The model's stepper for making previews only: they need its latents' layout and decode, which every
    configuration of a family shares (so `Stepper.check_pipeline` does not apply)."""
    cls = stepper_class(runner.card.pipeline_name)
    return None if cls is None else cls(runner.pipeline, runner.device)


ROLES: dict[str, type[StageRole]] = {
    role.stage_type: role for role in (DiffusionRole, EncodeRole, DenoiseRole, DecodeRole)
}
"""The role of each stage type this release serves."""


@dataclass(frozen=True)
class StageAdmission:
    """How a stage admits a request, from its model's card alone: the stage that holds the denoiser fills in the
    model's defaults, a stage that steps checks what its stepper can run, and every stage gives the batch key. Plain
    data, so it runs where the request arrives: a Ray stage admits on the driver, with no call to a replica."""

    role: type[StageRole]
    card: ModelCard
    stepper: type[Stepper] | None
    """The model's stepper class when the stage steps or is split, else ``None``."""
    sequence_ranks: int = 1
    """The ranks that split the denoiser's sequence (``ulysses_degree × ring_degree``), which must divide a
    request's tokens."""

    def admit(self, params: OmniDiffusionSamplingParams) -> Admission:
        """``params`` completed and checked, without the fields the model would not use, with their batch key
        (raises `SamplingParamsError`)."""
        ignored: tuple[IgnoredField, ...] = ()
        if self.role.completes_params:
            params, ignored = self.card.complete_params(params)
            assert params.num_inference_steps is not None, "complete params"
            if params.num_inference_steps < self.card.min_steps:  # its schedule would be NaN: a black image
                raise SamplingParamsError(
                    "num_inference_steps",
                    f"{self.card.pipeline_name}'s scheduler makes no finite noise schedule below "
                    f"{self.card.min_steps} steps: give num_inference_steps >= {self.card.min_steps}",
                )
            check_sde(self.card, params)
            if self.sequence_ranks > 1:
                check_sequence_split(self.card, params, self.sequence_ranks)
            if params.partial_images:
                self._check_previews()
        if self.stepper is not None:
            self.stepper.check_params(self.card, params)
        return Admission(params, self.key(params), ignored)

    def _check_previews(self) -> None:
        name = self.card.pipeline_name
        cls = stepper_class(name)
        why = f"previews are made for {', '.join(SUPPORTED_PIPELINES)}" if cls is None else None
        if self.card.output == "audio":
            why = "it makes audio, and a preview is an image of the partial result"
        if cls is not None and self.stepper is None:  # request mode: the stock pipeline's loop, not the stepper's
            why = cls.request_mode_previews_refusal(name)
            if why is None and "callback_on_step_end" not in self.card.call_args:  # HunyuanVideo 1.5
                why = "in execution_mode 'request': its call takes no callback_on_step_end; use 'step'"
        if why is not None:
            raise SamplingParamsError(
                "partial_images", f"{name} cannot show partial images ({why}); set partial_images to 0"
            )

    def key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        """The batch key of complete ``params``."""
        return self.role.batch_key(self.card, self.stepper, params)


def check_splittable(model: str, stage_configs: list[StageDeployConfig]) -> None:
    """Fail before anything loads when a split stage is asked of a pipeline that has no split."""
    split = [s for s in stage_configs if s.stage_type in ROLES and ROLES[s.stage_type].split]
    if not split:
        return
    name = read_model_index(model).get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"stage {split[0].stage_id} ({split[0].stage_type}): {name} cannot be split into encode / denoise / "
            f"decode stages; splittable pipelines: {', '.join(SUPPORTED_PIPELINES)}. Serve it as one stage with "
            "stage_type: diffusion"
        )
