"""Image-to-image and inpainting in step mode and split stages, as the stock ``from_pipe`` image pipelines of the
stepped text-to-image classes run them (diffusers' ``*Img2ImgPipeline`` and ``*InpaintPipeline``).

The ``encode`` stage encodes a request's input image with the VAE and hands on the distribution of its latents
(`encode_image`), not a sample of it: the stock pipelines draw that sample and then the initial noise from the
request's one generator, so `Stepper.start`, which holds the request's generator, draws both, in that order,
and a split pipeline gives what one stage gives without carrying a generator state across. Such a request then
differs from a text request only in its own state (its latents, its schedule's tail, an inpainting blend), so it
shares forwards with text requests of the same batch key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from vllm_omni.diffusion.families.steppers.state import Conditioning, Inpainting, StepState
from vllm_omni.diffusion.pipeline.image_inputs import fitted_inputs
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.diffusion.families.model_card import ModelCard


def encode_image(
    pipeline, params: OmniDiffusionSamplingParams, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """`Conditioning.image` of an image task: its input image's VAE distribution and its mask at latent size,
    from the pixels request mode gives the pipeline (`fitted_inputs`). ``dtype``: its prompt embeddings'."""
    inputs, mask = fitted_inputs(params)
    processor = pipeline.image_processor
    pixels = processor.preprocess(inputs[0], height=params.height, width=params.width).to(torch.float32)
    vae = pipeline.vae
    # As the stock pipelines do: the image in the prompt's dtype, then in the VAE's (SDXL upcasts its VAE).
    pixels = pixels.to(device, dtype).to(vae.dtype)
    encoded = {"moments": vae.encode(pixels).latent_dist.parameters}
    if mask is not None:
        mask_processor = VaeImageProcessor(
            vae_scale_factor=processor.config.vae_scale_factor,
            do_normalize=False,
            do_binarize=True,
            do_convert_grayscale=True,
        )
        condition = mask_processor.preprocess(mask, height=params.height, width=params.width)
        scale = pipeline.vae_scale_factor
        encoded["mask"] = torch.nn.functional.interpolate(
            condition, size=(params.height // scale, params.width // scale)
        )
    return encoded


def latent_distribution(image: dict[str, torch.Tensor], device: torch.device) -> DiagonalGaussianDistribution:
    """The VAE distribution of an encoded input image (`encode_image`) on ``device``, in the VAE's dtype."""
    return DiagonalGaussianDistribution(image["moments"].to(device))


class ImageTasks:
    """What a `Stepper` does for image tasks; the hooks below are per family."""

    device: torch.device
    card: ModelCard

    full_strength_inpaints_noise: ClassVar[bool] = True
    """Whether its inpaint pipeline starts a request of strength 1 from pure noise (as a text request starts)
    rather than from its image noised to the first timestep."""

    def draw_image_latents(
        self,
        conditioning: Conditioning,
        params: OmniDiffusionSamplingParams,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """An image task's image latents, ``[n, ...]`` in its latents' layout: one sample of its VAE distribution
        per output, drawn from the request's generators before its noise, as the stock pipelines draw them;
        ``None`` for a text request."""
        if conditioning.image is None:
            return None
        posterior = latent_distribution(conditioning.image, self.device)
        sample = torch.cat([posterior.sample(generator) for generator in generators])
        return self.pack(self.latent_space(sample.to(dtype), params))

    def start_image(
        self,
        state: StepState,
        conditioning: Conditioning,
        image_latents: torch.Tensor,
        noise: torch.Tensor,
        generators: list[torch.Generator],
    ) -> None:
        """Make the fresh state of an image task from its text-request form: the tail of its schedule that its
        strength leaves (its image pipeline's ``get_timesteps``), its image noised to the first timestep of it,
        and for inpainting what each step blends in. ``noise`` is its initial noise, drawn after its image."""
        params, scheduler = state.params, state.noise_scheduler
        steps, strength = params.num_inference_steps, params.strength
        assert steps is not None and strength is not None, "complete params of an image task"
        assert conditioning.image is not None, "an image task's conditioning holds its image"
        state.offset = self.card.strength_offset(steps, strength) * scheduler.order
        state.timesteps = scheduler.timesteps[state.offset :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(state.offset)
        mask = conditioning.image.get("mask")
        # An inpaint pipeline that special-cases strength 1 starts from pure noise: the text request's latents.
        if mask is None or strength < 1.0 or not self.full_strength_inpaints_noise:
            state.latents = self.noised(state, image_latents, noise)
        if mask is None:
            return
        # The stock inpaint pipelines then draw a sample of the masked image's latents per output (an input of
        # inpainting denoisers only): drawn and dropped here, so that the generator's later draws (an ancestral
        # scheduler's noise) are theirs.
        posterior = latent_distribution(conditioning.image, self.device)
        for generator in generators:
            posterior.sample(generator)
        n, channels = len(noise), posterior.mean.shape[1]
        mask = self.pack(mask.to(self.device, image_latents.dtype).repeat(n, channels, 1, 1))
        state.inpaint = Inpainting(image_latents, noise, mask)

    def latent_space(self, sample: torch.Tensor, params: OmniDiffusionSamplingParams) -> torch.Tensor:
        """A VAE sample of an image task's input image scaled into the denoiser's latent space, as its image
        pipeline scales it."""
        raise NotImplementedError

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        """``[n, C, h, w]`` latents in the layout the denoiser takes (unchanged but for Flux's packing)."""
        return latents

    def noised(self, state: StepState, image_latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """An image task's image latents noised to its current timestep, as its scheduler noises them."""
        raise NotImplementedError

    def blend(self, state: StepState) -> None:
        """An inpainting request after a step: outside its mask, its image latents noised to its next timestep
        (after its last step, the image latents themselves)."""
        inpaint = state.inpaint
        assert inpaint is not None, "blends an inpainting request only"
        kept = inpaint.image_latents if state.done else self.noised(state, inpaint.image_latents, inpaint.noise)
        state.latents = (1 - inpaint.mask) * kept + inpaint.mask * state.latents
