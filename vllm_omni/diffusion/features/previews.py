"""Partial images (OpenAI's ``partial_images``): what a request shows of itself while it denoises.

A request that asks for ``k`` previews gets them after ``k`` evenly spaced steps (`preview_steps`). Each is made
from the clean latents that step's prediction implies (`clean_latents`, the x₀ estimate of the request's own
noise scheduler), not from the noisy running latents, so an early preview already shows the composition. They
become RGB one of two ways (`PreviewMethod`):

- ``latent_rgb``: a linear map from the VAE's latent channels to RGB, fitted once per model to its own VAE
  (`LatentProjection`), at latent resolution and upscaled. It costs a matrix product, whatever the model.
- ``vae``: the VAE's decoder on the clean latents, the same decode as the final image (for video, every frame).

The engine's thread makes them (step mode between forwards, request mode from the pipeline's step callback) and
hands each to the request's ``on_preview``; a request without previews pays nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from PIL import Image

from vllm_omni.diffusion.families.pipeline_facts import schedule_index
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.diffusion.pipeline.timings import section
from vllm_omni.logger import init_logger
from vllm_omni.outputs import Preview

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.request import DiffusionRequest, PipelineCall
    from vllm_omni.diffusion.families.steppers import Stepper
    from vllm_omni.diffusion.families.steppers.base import PreviewMethod
    from vllm_omni.sampling_params import OmniDiffusionSamplingParams

logger = init_logger(__name__)


def preview_steps(total: int, count: int) -> tuple[int, ...]:
    """After how many of its ``total`` steps a request's ``count`` previews are made: evenly spaced, never after
    the last step (the final image follows it). Fewer than ``count`` when there are too few steps."""
    steps = {round(total * (i + 1) / (count + 1)) for i in range(count)}
    return tuple(sorted(s for s in steps if 0 < s < total))


def clean_latents(scheduler, index: int, timestep, prediction: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """The denoised latents (x₀) that ``prediction`` implies for ``sample`` at position ``index`` of the
    scheduler's schedule (``timestep``: the timestep there): flow matching ``x − σ·v``; for DDPM-style schedulers
    the ε-, v- or sample-prediction inversion, in k-diffusion scaling where the scheduler uses it (Euler, LMS)."""
    config = scheduler.config
    prediction = prediction.to(sample.dtype)
    if config.get("prediction_type") == "flow_prediction" or "FlowMatch" in type(scheduler).__name__:
        return sample - scheduler.sigmas[index].to(sample.device, sample.dtype) * prediction
    kind = config.get("prediction_type", "epsilon")
    if kind == "sample":
        return prediction
    if float(scheduler.init_noise_sigma) != 1.0:  # k-diffusion: x = x₀ + σ·ε
        sigma = scheduler.sigmas[index].to(sample.device, sample.dtype)
        if kind == "v_prediction":
            return prediction * (-sigma / (sigma**2 + 1) ** 0.5) + sample / (sigma**2 + 1)
        return sample - sigma * prediction
    alpha = scheduler.alphas_cumprod[int(timestep)].to(sample.device, sample.dtype)
    if kind == "v_prediction":
        return alpha.sqrt() * sample - (1 - alpha).sqrt() * prediction
    return (sample - (1 - alpha).sqrt() * prediction) / alpha.sqrt()


class LatentProjection:
    """A linear map from a VAE's latent channels (plus a bias) to RGB in [0, 1], fitted by least squares to what
    the VAE's encoder makes of smooth random colour fields: the same kind of map as hand-made per-family preview
    factors, but fitted to this model's own VAE, so it fits any family and any fine-tuned VAE."""

    SIZE = 128
    """Side of the fitting images, in pixels."""
    IMAGES = 12

    def __init__(self, vae, video: bool):
        parameter = next(vae.parameters())
        generator = torch.Generator("cpu").manual_seed(0)
        colours = torch.rand(self.IMAGES, 3, 4, 4, generator=generator)
        images = F.interpolate(colours, size=(self.SIZE, self.SIZE), mode="bilinear", align_corners=False)
        pixels = images * 2 - 1
        if video:  # one frame: the first latent frame encodes it alone
            pixels = pixels.unsqueeze(2)
        latents = vae.encode(pixels.to(parameter.device, parameter.dtype)).latent_dist.mode().float()
        if video:
            latents = latents[:, :, 0]
        target = F.adaptive_avg_pool2d(images, latents.shape[-2:]).to(latents.device)
        inputs = torch.cat([latents, torch.ones_like(latents[:, :1])], dim=1)
        flat = inputs.permute(0, 2, 3, 1).reshape(-1, inputs.shape[1])
        self.weights = torch.linalg.lstsq(flat, target.permute(0, 2, 3, 1).reshape(-1, 3)).solution
        """``[C + 1, 3]``: one row per latent channel, then the bias."""

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """``[n, C, h, w]`` VAE latents → ``[n, 3, h, w]`` RGB in [0, 1]."""
        weights = self.weights.to(latents.device)
        rgb = torch.einsum("nchw,ck->nkhw", latents.float(), weights[:-1]) + weights[-1].view(1, 3, 1, 1)
        return rgb.clamp(0, 1)


class Previews:
    """A stage's maker of partial images, on the model's stepper (which knows its latents' layout and decode)."""

    def __init__(self, stepper: Stepper, method: PreviewMethod = "latent_rgb"):
        self.stepper = stepper
        self.method = method
        self.video = stepper.card.output == "video"
        self._projection: LatentProjection | None = None
        """Fitted on the first preview, so that a server whose requests never ask for one does not pay for it."""

    @staticmethod
    def due(request: DiffusionRequest, steps_done: int) -> bool:
        """Whether the request's next preview is due once it has done ``steps_done`` steps."""
        count = request.params.partial_images
        if request.on_preview is None or request.previews_sent >= count:
            return False
        total = request.total_steps or request.params.num_inference_steps
        assert total is not None, "incomplete params"
        steps = preview_steps(total, count)
        return request.previews_sent < len(steps) and steps[request.previews_sent] == steps_done

    def emit(self, request: DiffusionRequest, clean: torch.Tensor) -> None:
        """Make the request's next preview from its ``[n, ...]`` clean latents and hand it over. A preview that
        fails is logged and the request goes on without previews: the image it asked for still comes."""
        index = request.previews_sent
        request.previews_sent += 1
        try:
            # Handing it over may fail too (an event loop closed since): in step mode that would end the engine loop.
            with section("preview", [request]):
                images = self.images(clean, request.params, request.state)
            assert request.on_preview is not None, "emitted only when due, and due only with on_preview"
            request.on_preview(Preview(index, images))
        except Exception as exc:  # noqa: BLE001 - a preview must not fail its request
            logger.warning("preview of request %s failed: %s: %s", request.request_id, type(exc).__name__, exc)
            request.previews_sent = request.params.partial_images

    def images(self, clean: torch.Tensor, params: OmniDiffusionSamplingParams, state=None) -> list[Image.Image]:
        """One preview image per output row of ``clean`` (for video, the middle frame); ``state``: the request's
        step-mode state, whose decode inputs the ``vae`` method reads (``None`` in request mode)."""
        if self.method == "vae":
            from vllm_omni.diffusion.families.steppers import Latents

            pil = params.model_copy(update={"output_type": "pil"})
            blocks = None if state is None else self.stepper.decode_inputs(state)
            outputs = self.stepper.decode([Latents(clean, pil, blocks=blocks)])[0]
            return [video[len(video) // 2] for video in outputs] if self.video else list(outputs)
        latents = self.stepper.to_vae(clean, params)
        if self.video:
            latents = latents[:, :, latents.shape[2] // 2]
        if self._projection is None:
            self._projection = LatentProjection(self.stepper.pipeline.vae, self.video)
        pixels = (self._projection(latents) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        assert params.width is not None and params.height is not None, "incomplete params"
        size = (params.width, params.height)
        return [Image.fromarray(rgb).resize(size, Image.Resampling.BILINEAR) for rgb in pixels]

    @contextlib.contextmanager
    def watching(self, scheduler, batch: list[DiffusionRequest]) -> Iterator[Callable[[], None] | None]:
        """Request mode: around one pipeline call of ``batch``, the scheduler's ``step`` keeps its last prediction
        (the pipeline hands it nothing else), and the function this yields, called by the pipeline's step
        callback once the batch's ``steps_done`` are set, makes the previews due then. Yields ``None`` (and wraps
        nothing) when no request of the batch asks for previews."""
        if not any(r.params.partial_images and r.on_preview for r in batch):
            yield None
            return
        step = scheduler.step
        last: dict[str, Any] = {}

        def keeping_prediction(prediction, timestep, sample, *args, **kwargs):
            last.update(
                index=schedule_index(scheduler, timestep), timestep=timestep, prediction=prediction, sample=sample
            )
            return step(prediction, timestep, sample, *args, **kwargs)

        def after_step() -> None:
            due = [i for i, r in enumerate(batch) if self.due(r, r.steps_done)]
            if not due or not last or len(last["sample"]) % len(batch):
                return
            clean = clean_latents(scheduler, last["index"], last["timestep"], last["prediction"], last["sample"])
            n = len(clean) // len(batch)
            for i in due:
                self.emit(batch[i], clean[i * n : (i + 1) * n])

        scheduler.step = keeping_prediction
        try:
            yield after_step
        finally:
            del scheduler.step  # the class's own again


class PreviewsExtension(Extension):
    """Partial images as an extension (`vllm_omni.diffusion.pipeline.extensions`): around a request-mode call whose
    stage makes previews (``call.previews``), `Previews.watching`, whose step hook makes those due (step mode's
    `denoise_step` makes them after each step)."""

    name = "previews"

    def around_call(self, call: PipelineCall) -> contextlib.AbstractContextManager[Callable[[], None] | None]:
        if call.previews is None:
            return contextlib.nullcontext()
        return call.previews.watching(call.pipeline.scheduler, call.batch)


async def previews_until(result: asyncio.Future, previews: asyncio.Queue) -> AsyncIterator[Preview]:
    """Each preview of ``previews`` as it arrives, until ``result`` is done, then those queued before it: the
    engine queues a request's previews (through this loop) before its result, so none is lost or reordered."""
    while not result.done():
        waiting = asyncio.ensure_future(previews.get())
        try:
            await asyncio.wait({result, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiting.done():
                waiting.cancel()  # an item it had not taken stays queued
        if waiting.done() and not waiting.cancelled():
            yield waiting.result()
    while not previews.empty():
        yield previews.get_nowait()
