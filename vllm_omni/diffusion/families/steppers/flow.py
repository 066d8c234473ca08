"""Flow-matching DiTs (Flux, SD3, Wan): per-request schedules, one forward, a vectorised Euler update.

``FlowMatchEulerDiscreteScheduler.step`` is ``x + (σ_next − σ)·v``; `FlowMatchStepper.advance` does it for
the whole batch at once with each request's own σ pair, with the scheduler's exact dtype steps, and a request that
samples stochastically (RL rollouts) takes its own `SdeSampler.step` in its window instead. Any other scheduler
(UniPC-flow, the scheduler's own stochastic_sampling) keeps a per-request ``scheduler.step``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.steppers.base import (
    Conditioning,
    Latents,
    Stepper,
    StepState,
    fresh_noise_scheduler,
    generators_for,
    guidance_scale,
    negative_prompts,
    split_rows,
)
from vllm_omni.diffusion.features.sde import SDE_ARGS, steps_flow_euler
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


class FlowMatchStepper(Stepper):
    """What Flux, SD3 and Wan share: the denoiser is ``pipeline.transformer``, the update is flow-matching Euler."""

    extra_args = frozenset({"max_sequence_length", "flow_shift"}) | SDE_ARGS

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.transformer = pipeline.transformer
        self.vectorised = steps_flow_euler(pipeline.scheduler)

    @classmethod
    def max_sequence_length(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> int:
        """Text length every prompt is padded to (no mask reaches the denoiser, so it is part of the key)."""
        return int(params.extra_args.get("max_sequence_length", card.call_defaults["max_sequence_length"]))

    @classmethod
    def key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        return (params.height, params.width, params.num_frames, cls.max_sequence_length(card, params))

    @classmethod
    def encode_key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        return (*super().encode_key(card, params), cls.max_sequence_length(card, params))

    def advance(self, states: list[StepState], predictions: list[torch.Tensor]) -> None:
        if not self.vectorised:
            return super().advance(states, predictions)
        v = torch.cat(predictions)
        dt = torch.cat([(self.sigma(s, 1) - self.sigma(s)).expand(len(s.latents)) for s in states]).view(
            -1, *[1] * (v.dim() - 1)
        )
        x = torch.cat([s.latents.float() for s in states])
        # As the scheduler does it: the 0-d σ difference is cast to v's dtype and multiplied in it (in bf16 the
        # difference rounds first), the sum is float32, the result is cast to v's dtype.
        updated = (x + dt.to(v.device, v.dtype) * v).to(v.dtype)
        start = 0
        for state, prediction in zip(states, predictions, strict=True):
            n = len(state.latents)
            stochastic = None
            if state.sde is not None:
                index = state.offset + state.step
                stochastic = state.sde.step(
                    state.latents, prediction, state.timestep, state.noise_scheduler.sigmas, index
                )
            state.latents = updated[start : start + n] if stochastic is None else stochastic
            state.step += 1
            if state.inpaint is not None:
                self.blend(state)
            start += n

    @staticmethod
    def sigma(state: StepState, ahead: int = 0) -> torch.Tensor:
        """The σ of the request's current timestep, or of the one ``ahead`` of it."""
        return state.noise_scheduler.sigmas[state.offset + state.step + ahead]

    def latent_space(self, sample: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        config = self.pipeline.vae.config
        return (sample - config.shift_factor) * config.scaling_factor

    def noised(self, state: StepState, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        # The scheduler's scale_noise, at the request's own step: the vectorised advance leaves its scheduler's
        # step index unset.
        sigma = self.sigma(state).to(image_latents.device, image_latents.dtype)
        return sigma * noise + (1.0 - sigma) * image_latents


class FluxStepper(FlowMatchStepper):
    """FLUX.1 (schnell- and dev-like): guidance is a per-row denoiser input; true CFG adds negative rows."""

    pipeline_classes = ("FluxPipeline",)
    extra_args = frozenset({"max_sequence_length", "true_cfg_scale", "flow_shift"}) | SDE_ARGS
    tasks = frozenset({"text", "image", "inpaint"})
    full_strength_inpaints_noise = False

    @classmethod
    def negative_rows(cls, params: OmniDiffusionSamplingParams) -> bool:
        return float(params.extra_args.get("true_cfg_scale", 1.0)) > 1 and params.negative_prompt is not None

    def encode_prompts(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        p, n, msl = self.pipeline, params[0].num_outputs_per_prompt, self.max_sequence_length(self.card, params[0])

        def encode(texts: list[str]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
            embeds, pooled, text_ids = p.encode_prompt(
                prompt=texts, prompt_2=None, device=self.device, num_images_per_prompt=n, max_sequence_length=msl
            )
            rows = zip(split_rows(embeds, n, len(texts)), split_rows(pooled, n, len(texts)), strict=True)
            return [{"encoder_hidden_states": e, "pooled_projections": q} for e, q in rows], text_ids

        cond, text_ids = encode(prompts)
        uncond = encode(negative_prompts(params))[0] if self.negative_rows(params[0]) else [None] * len(cond)
        return [Conditioning(c, u, {"txt_ids": text_ids}) for c, u in zip(cond, uncond, strict=True)]

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        p, n, steps = self.pipeline, params.num_outputs_per_prompt, params.num_inference_steps
        assert steps is not None, "complete params"
        cond, uncond = self.on_device(conditioning.cond), self.on_device(conditioning.uncond)
        if self.transformer.config.guidance_embeds:
            assert params.guidance_scale is not None, "complete params of a guidance-distilled Flux"
            guidance = torch.full([n], params.guidance_scale, device=self.device, dtype=torch.float32)
            cond = cond | {"guidance": guidance}
            uncond = None if uncond is None else uncond | {"guidance": guidance}
        generators, dtype = generators_for(seed, n), cond["encoder_hidden_states"].dtype
        image_latents = self.draw_image_latents(conditioning, params, generators, dtype)
        latents, image_ids = p.prepare_latents(
            n,
            self.transformer.config.in_channels // 4,
            params.height,
            params.width,
            dtype,
            self.device,
            generators,
        )
        scheduler = fresh_noise_scheduler(p, self.card.scheduler_overrides(params))
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        mu = calculate_shift(
            latents.shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        # diffusers annotates sigmas as list[float]; its own Flux pipeline passes this numpy array
        timesteps, _ = retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)  # type: ignore[arg-type]
        scheduler.set_begin_index(0)
        state = StepState(
            params=params,
            latents=latents,
            noise_scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            shared={"txt_ids": self.on_device(conditioning.shared)["txt_ids"], "img_ids": image_ids},
            guidance=float(params.extra_args.get("true_cfg_scale", 1.0)),
        )
        if image_latents is not None:
            self.start_image(state, conditioning, image_latents, latents, generators)
        return state

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline._pack_latents(latents, *latents.shape)

    def forward(self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], shared: dict) -> torch.Tensor:
        return self.transformer(
            hidden_states=x,
            timestep=t.to(x.dtype) / 1000,
            guidance=rows.get("guidance"),
            pooled_projections=rows["pooled_projections"],
            encoder_hidden_states=rows["encoder_hidden_states"],
            txt_ids=shared["txt_ids"],
            img_ids=shared["img_ids"],
            return_dict=False,
        )[0]

    def to_vae(self, latents: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        p, config = self.pipeline, self.pipeline.vae.config
        unpacked = p._unpack_latents(latents, params.height, params.width, p.vae_scale_factor)
        return (unpacked / config.scaling_factor) + config.shift_factor


class SD3Stepper(FlowMatchStepper):
    """Stable Diffusion 3 / 3.5: CFG rows in the stock ``[uncond, cond]`` order."""

    pipeline_classes = ("StableDiffusion3Pipeline",)
    tasks = frozenset({"text", "image", "inpaint"})

    def encode_prompts(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        p, n, cfg, count = self.pipeline, params[0].num_outputs_per_prompt, self.negative_rows(params[0]), len(prompts)
        negative = None if params[0].negative_prompt is None else [q.negative_prompt for q in params]
        embeds, negative_embeds, pooled, negative_pooled = p.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=n,
            do_classifier_free_guidance=cfg,
            negative_prompt=negative,
            max_sequence_length=self.max_sequence_length(self.card, params[0]),
        )
        cond = zip(split_rows(embeds, n, count), split_rows(pooled, n, count), strict=True)
        uncond = zip(split_rows(negative_embeds, n, count), split_rows(negative_pooled, n, count), strict=True)
        return [
            Conditioning(
                {"encoder_hidden_states": e, "pooled_projections": q},
                {"encoder_hidden_states": ne, "pooled_projections": nq} if cfg else None,
                {},
            )
            for (e, q), (ne, nq) in zip(cond, uncond, strict=True)
        ]

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        p, n = self.pipeline, params.num_outputs_per_prompt
        cond, uncond = self.on_device(conditioning.cond), self.on_device(conditioning.uncond)
        generators, dtype = generators_for(seed, n), cond["encoder_hidden_states"].dtype
        image_latents = self.draw_image_latents(conditioning, params, generators, dtype)
        latents = p.prepare_latents(
            n, self.transformer.config.in_channels, params.height, params.width, dtype, self.device, generators
        )
        scheduler = fresh_noise_scheduler(p, self.card.scheduler_overrides(params))
        config, kwargs = scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            patch = self.transformer.config.patch_size
            seq_len = (latents.shape[2] // patch) * (latents.shape[3] // patch)
            kwargs["mu"] = calculate_shift(
                seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, params.num_inference_steps, self.device, **kwargs)
        state = StepState(
            params=params,
            latents=latents,
            noise_scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            shared={},
            guidance=guidance_scale(params),
        )
        if image_latents is not None:
            self.start_image(state, conditioning, image_latents, latents, generators)
        return state

    def forward(self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], shared: dict) -> torch.Tensor:
        return self.transformer(
            hidden_states=x,
            timestep=t,
            encoder_hidden_states=rows["encoder_hidden_states"],
            pooled_projections=rows["pooled_projections"],
            return_dict=False,
        )[0]

    def to_vae(self, latents: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        config = self.pipeline.vae.config
        # diffusers' SD3 inpaint pipeline decodes without the VAE's shift_factor; its requests here too, so that
        # step mode and request mode give the same image.
        shift = 0.0 if params.task == "inpaint" else config.shift_factor
        return latents / config.scaling_factor + shift


class WanStepper(FlowMatchStepper):
    """Wan 2.1-style text-to-video. The stock pipeline runs cond and uncond as two forwards; here they are rows
    of one forward (equal up to batching arithmetic)."""

    pipeline_classes = ("WanPipeline",)

    @classmethod
    def check_pipeline(cls, pipeline) -> None:
        if pipeline.config.get("boundary_ratio") is not None or getattr(pipeline, "transformer_2", None) is not None:
            raise ValueError(
                "two-expert Wan pipelines (boundary_ratio / transformer_2): requests on either side of the boundary "
                "need different weights"
            )
        if pipeline.config.get("expand_timesteps"):
            raise ValueError("Wan pipelines with expand_timesteps (per-token timesteps)")

    def encode_prompts(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        p, n, cfg, count = self.pipeline, params[0].num_outputs_per_prompt, self.negative_rows(params[0]), len(prompts)
        negative = None if params[0].negative_prompt is None else [q.negative_prompt for q in params]
        embeds, negative_embeds = p.encode_prompt(
            prompt=prompts,
            negative_prompt=negative,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=n,
            max_sequence_length=self.max_sequence_length(self.card, params[0]),
            device=self.device,
        )
        return [
            Conditioning({"encoder_hidden_states": e}, {"encoder_hidden_states": ne} if cfg else None, {})
            for e, ne in zip(split_rows(embeds, n, count), split_rows(negative_embeds, n, count), strict=True)
        ]

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        p, n = self.pipeline, params.num_outputs_per_prompt
        scheduler = fresh_noise_scheduler(p, self.card.scheduler_overrides(params))
        scheduler.set_timesteps(params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        latents = p.prepare_latents(
            n,
            self.transformer.config.in_channels,
            params.height,
            params.width,
            params.num_frames,
            torch.float32,
            self.device,
            generators_for(seed, n),
        )
        return StepState(
            params=params,
            latents=latents,
            noise_scheduler=scheduler,
            timesteps=scheduler.timesteps,
            cond=self.on_device(conditioning.cond),
            uncond=self.on_device(conditioning.uncond),
            shared={},
            guidance=guidance_scale(params),
        )

    def model_input(self, state: StepState) -> torch.Tensor:
        return state.latents.to(self.transformer.dtype)

    def forward(self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], shared: dict) -> torch.Tensor:
        return self.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=rows["encoder_hidden_states"], return_dict=False
        )[0]

    def to_vae(self, latents: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inverse_std + mean

    def decode(self, states: list[Latents] | list[StepState]) -> list[list[Any]]:
        latents = torch.cat([self.to_vae(s.latents, s.params) for s in states])
        videos = self.pipeline.vae.decode(latents, return_dict=False)[0]
        outputs, start = [], 0
        for state in states:
            n = len(state.latents)
            chunk = self.pipeline.video_processor.postprocess_video(
                videos[start : start + n], output_type=state.params.output_type
            )
            outputs.append([list(video) for video in chunk])
            start += n
        return outputs
