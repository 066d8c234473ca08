"""UNet pipelines (Stable Diffusion 1.x/2.x and SDXL): each request's own scheduler steps its own latents.

Any diffusers scheduler keeps its exact semantics this way (DDIM, Euler, Euler-ancestral, DPM++, UniPC,
Heun): ``scale_model_input`` and ``step`` run per request on its own instance and generator; only the UNet
forward is shared, with a per-row timestep.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps
from diffusers.utils.torch_utils import randn_tensor

from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.families.steppers.base import (
    Conditioning,
    Latents,
    Stepper,
    StepState,
    fresh_noise_scheduler,
    generators_for,
    guidance_scale,
    split_rows,
)
from vllm_omni.sampling_params import OmniDiffusionSamplingParams


class UNetStepper(Stepper):
    pipeline_classes = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
    extra_args = frozenset({"eta", "guidance_rescale"})
    tasks = frozenset({"text", "image", "inpaint"})

    def __init__(self, pipeline, device: torch.device):
        super().__init__(pipeline, device)
        self.unet = pipeline.unet
        self.xl = type(pipeline).__name__ == "StableDiffusionXLPipeline"
        vae = pipeline.vae
        if vae is not None and vae.dtype == torch.float16 and vae.config.get("force_upcast", False):
            vae.to(torch.float32)  # what the stock SDXL call does around each decode, once for good

    @classmethod
    def check_pipeline(cls, pipeline) -> None:
        if pipeline.unet is None:
            return
        if pipeline.unet.config.time_cond_proj_dim is not None:
            raise ValueError("UNets with a guidance embedding (time_cond_proj_dim, e.g. LCM)")
        if pipeline.unet.config.in_channels != pipeline.unet.config.out_channels:
            raise ValueError(
                f"inpainting UNets ({pipeline.unet.config.in_channels} input channels: the mask and the masked image "
                "are inputs of every forward)"
            )

    @classmethod
    def key(cls, card: ModelCard, params: OmniDiffusionSamplingParams) -> tuple:
        return (params.height, params.width)  # CLIP pads every prompt to 77 tokens

    def encode_prompts(self, prompts: list[str], params: list[OmniDiffusionSamplingParams]) -> list[Conditioning]:
        p, n, count = self.pipeline, params[0].num_outputs_per_prompt, len(prompts)
        cfg = self.negative_rows(params[0])
        negative = None if params[0].negative_prompt is None else [q.negative_prompt for q in params]
        if self.xl:
            embeds, negative_embeds, pooled, negative_pooled = p.encode_prompt(
                prompt=prompts,
                device=self.device,
                num_images_per_prompt=n,
                do_classifier_free_guidance=cfg,
                negative_prompt=negative,
            )
            cond = [
                {"encoder_hidden_states": e, "text_embeds": q}
                for e, q in zip(split_rows(embeds, n, count), split_rows(pooled, n, count), strict=True)
            ]
            negatives = zip(split_rows(negative_embeds, n, count), split_rows(negative_pooled, n, count), strict=True)
            uncond = [{"encoder_hidden_states": e, "text_embeds": q} for e, q in negatives]
        else:
            embeds, negative_embeds = p.encode_prompt(prompts, self.device, n, cfg, negative)
            cond = [{"encoder_hidden_states": e} for e in split_rows(embeds, n, count)]
            uncond = [{"encoder_hidden_states": e} for e in split_rows(negative_embeds, n, count)]
        return [Conditioning(c, u if cfg else None, {}) for c, u in zip(cond, uncond, strict=True)]

    def start(self, conditioning: Conditioning, params: OmniDiffusionSamplingParams, seed: int) -> StepState:
        p, n = self.pipeline, params.num_outputs_per_prompt
        cond, uncond = self.on_device(conditioning.cond), self.on_device(conditioning.uncond)
        dtype = cond["encoder_hidden_states"].dtype
        if self.xl:
            # The pooled text embedding's width is text_encoder_2's projection_dim, which this stage may not hold.
            size = (params.height, params.width)
            time_ids = (
                p._get_add_time_ids(
                    size, (0, 0), size, dtype=dtype, text_encoder_projection_dim=int(cond["text_embeds"].shape[-1])
                )
                .to(self.device)
                .repeat(n, 1)
            )
            cond = cond | {"time_ids": time_ids}
            uncond = None if uncond is None else uncond | {"time_ids": time_ids}
        scheduler = fresh_noise_scheduler(p)
        timesteps, _ = retrieve_timesteps(scheduler, params.num_inference_steps, self.device)
        if self.xl and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        generators = generators_for(seed, n)
        image_latents = self.draw_image_latents(conditioning, params, generators, dtype)
        shape = (
            n,
            self.unet.config.in_channels,
            params.height // p.vae_scale_factor,
            params.width // p.vae_scale_factor,
        )
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=dtype)
        state = StepState(
            params=params,
            # The request's own init_noise_sigma: the pipeline's prepare_latents reads the shared scheduler's.
            latents=noise * scheduler.init_noise_sigma,
            noise_scheduler=scheduler,
            timesteps=timesteps,
            cond=cond,
            uncond=uncond,
            shared={},
            guidance=guidance_scale(params),
            guidance_rescale=float(params.extra_args.get("guidance_rescale", 0.0)),
            step_kwargs=p.prepare_extra_step_kwargs(generators, float(params.extra_args.get("eta", 0.0))),
        )
        if image_latents is not None:
            self.start_image(state, conditioning, image_latents, noise, generators)
        return state

    def latent_space(self, sample: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        config = self.pipeline.vae.config
        mean, std = config.get("latents_mean"), config.get("latents_std")
        # SDXL's image-to-image pipeline normalises with the VAE's latent statistics; its inpaint pipeline does not.
        if self.xl and params.task == "image" and mean is not None and std is not None:
            channels = sample.shape[1]
            mean = torch.tensor(mean).view(1, channels, 1, 1).to(sample.device, sample.dtype)
            std = torch.tensor(std).view(1, channels, 1, 1).to(sample.device, sample.dtype)
            return (sample - mean) * config.scaling_factor / std
        return config.scaling_factor * sample

    def noised(self, state: StepState, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return state.noise_scheduler.add_noise(image_latents, noise, torch.tensor([state.timestep]))

    def model_input(self, state: StepState) -> torch.Tensor:
        return state.noise_scheduler.scale_model_input(state.latents, state.timestep)

    def forward(self, x: torch.Tensor, t: torch.Tensor, rows: dict[str, torch.Tensor], shared: dict) -> torch.Tensor:
        added = {"text_embeds": rows["text_embeds"], "time_ids": rows["time_ids"]} if self.xl else None
        return self.unet(
            x, t, encoder_hidden_states=rows["encoder_hidden_states"], added_cond_kwargs=added, return_dict=False
        )[0]

    def to_vae(self, latents: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        vae = self.pipeline.vae
        latents = latents.to(vae.dtype)
        mean, std = vae.config.get("latents_mean"), vae.config.get("latents_std")
        if mean is None or std is None:
            return latents / vae.config.scaling_factor
        channels = latents.shape[1]
        mean = torch.tensor(mean).view(1, channels, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(1, channels, 1, 1).to(latents.device, latents.dtype)
        return latents * std / vae.config.scaling_factor + mean

    def decode(self, states: list[Latents] | list[StepState]) -> list[list[Any]]:
        p = self.pipeline
        latents = torch.cat([self.to_vae(s.latents, s.params) for s in states])
        images = p.vae.decode(latents, return_dict=False)[0]
        if getattr(p, "watermark", None) is not None:
            images = p.watermark.apply_watermark(images)
        if getattr(p, "safety_checker", None) is None:
            return self.postprocess_images(images, states)
        images, nsfw = p.run_safety_checker(images, self.device, latents.dtype)
        return self.postprocess_images(images, states, do_denormalize=[not flagged for flagged in nsfw])
