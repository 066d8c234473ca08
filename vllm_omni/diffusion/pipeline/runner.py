"""Device work: load a diffusers pipeline and run one pipeline call per batch."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch

from vllm_omni.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.request import DiffusionRequest, PipelineCall
from vllm_omni.diffusion.families.model_card import ENGINE_ARGS, ModelCard
from vllm_omni.diffusion.families.steppers.base import fresh_noise_scheduler
from vllm_omni.diffusion.features.gguf import gguf_components, load_gguf_component
from vllm_omni.diffusion.features.previews import Previews
from vllm_omni.diffusion.features.quantization import QuantizationExtension, QuantizationPlan
from vllm_omni.diffusion.features.step_cache import CallCache, StepCache, StepCacheExtension
from vllm_omni.diffusion.lora.adapters import LoraAdapters, LoraExtension
from vllm_omni.diffusion.parallel.ranks import RanksExtension
from vllm_omni.diffusion.pipeline.dummy_weights import dummy_components, pipeline_loader
from vllm_omni.diffusion.pipeline.extensions import CompileExtension, Extensions, StepHook
from vllm_omni.diffusion.pipeline.image_inputs import fitted_inputs
from vllm_omni.diffusion.pipeline.noise import noise_per_request
from vllm_omni.diffusion.pipeline.timings import TimingsExtension
from vllm_omni.logger import init_logger
from vllm_omni.outputs import OutputKind

logger = init_logger(__name__)


def _waveform(audio: Any) -> np.ndarray:
    """One waveform of an audio pipeline's output as `OmniRequestOutput.audios` holds it: float32, ``(channels,
    samples)`` (a mono pipeline's ``(samples,)`` as one channel)."""
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().float().cpu().numpy()
    audio = np.asarray(audio, dtype=np.float32)
    return audio[None] if audio.ndim == 1 else audio


OUTPUTS: dict[OutputKind, Callable[[Any], list[Any]]] = {
    "image": lambda result: list(result.images),
    "video": lambda result: [list(video) for video in result.frames],  # one frame sequence per video
    "audio": lambda result: [_waveform(audio) for audio in result.audios],
}
"""A pipeline call's outputs, one per row, by what the pipeline makes (`ModelCard.output`)."""


def select_device(devices: str | None) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(devices.split(",")[0]) if devices else 0)
    if devices is not None:
        raise ValueError(f"devices={devices!r} names CUDA devices, but CUDA is not available here; leave devices unset")
    return torch.device("cpu")


def select_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def read_model_index(model: str) -> dict[str, Any]:
    """The folder's ``model_index.json`` (its pipeline class and components)."""
    path = os.path.join(model, "model_index.json")
    if not os.path.isfile(path):
        raise ValueError(f"model {model!r} is not a diffusers folder: it has no model_index.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_pipeline(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    skips: tuple[str, ...] = (),
    cpu_offload: str = "none",
    quantization: QuantizationPlan | None = None,
    trust_remote_code: bool = False,
    load_format: str = "auto",
):
    """The pipeline on ``device`` (or offloaded to the CPU, moving to ``device`` to run), without the components
    named in ``skips``, its components quantized as ``quantization`` plans (`QuantizationPlan`);
    ``trust_remote_code``: diffusers may run the folder's own pipeline or component code (the stage's knob);
    ``load_format`` ``dummy``: its model components built from their configs with random weights
    (`dummy_components`), on the CPU under offload."""
    # transformers loads a model's weights on a pool of worker threads unless this is set: torch ops on other
    # threads than the engine's (see EngineReplica), whose OpenMP teams slow every later forward.
    os.environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
    components = read_model_index(model)
    skipped = {name: None for name in skips if name in components}
    # A GGUF denoiser loads from its file, quantized (vllm_omni.diffusion.features.gguf); the pipeline takes it as it
    # is.
    held_as_gguf = gguf_components(model, components)
    ggufs = {
        name: load_gguf_component(model, name, components[name][1], dtype)
        for name in held_as_gguf
        if name not in skipped
    }
    quantized = {} if quantization is None else {"quantization_config": quantization.pipeline_config()}
    built_on = device if cpu_offload == "none" else torch.device("cpu")
    dummies = dummy_components(model, dtype, built_on, skips) if load_format == "dummy" else {}
    pipeline = pipeline_loader(components, bool(held_as_gguf or dummies)).from_pretrained(
        model,
        dtype=dtype,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
        **skipped,
        **ggufs,
        **quantized,
        **dummies,
    )
    pipeline.set_progress_bar_config(disable=True)
    if quantization is not None:
        quantization.apply(pipeline)
    if cpu_offload == "none":
        return pipeline.to(device)
    if device.type != "cuda":
        raise ValueError(
            f"cpu_offload={cpu_offload!r} moves weights from CPU memory to a GPU while they run, and this stage runs "
            "on the CPU (no CUDA device): set cpu_offload to 'none'"
        )
    offload = pipeline.enable_model_cpu_offload if cpu_offload == "model" else pipeline.enable_sequential_cpu_offload
    offload(device=device)
    return pipeline


def set_vae_memory(pipeline, tiling: bool, slicing: bool) -> None:
    """diffusers' VAE tiling and slicing, as the stage's ``vae_tiling`` / ``vae_slicing`` ask; refused where the
    VAE lacks them."""
    vae = getattr(pipeline, "vae", None)
    for knob, wanted, method in (("vae_tiling", tiling, "enable_tiling"), ("vae_slicing", slicing, "enable_slicing")):
        if not wanted:
            continue
        if vae is None or not hasattr(vae, method):
            raise ValueError(
                f"{knob}=True: the VAE of {type(pipeline).__name__} ({type(vae).__name__}) has no {method}; "
                f"set {knob} to false"
            )
        getattr(vae, method)()


class DiffusionRunner:
    """A loaded pipeline, its parameter defaults and checks, and one pipeline call per batch inside the stage's
    extensions (`vllm_omni.diffusion.pipeline.extensions`)."""

    def __init__(self, od_config: OmniDiffusionConfig, skips: tuple[str, ...] = ()):
        """``skips``: the components the stage does not load (its role's)."""
        stage = od_config.stage
        self.device = select_device(stage.devices)
        self.dtype = select_dtype(stage.dtype, self.device)
        started = time.perf_counter()
        self.extensions = Extensions(od_config, self.device, self.dtype, skips)
        """The features around each call, in `EXTENSIONS` order; built before the pipeline loads."""
        self.group = self.extensions.get(RanksExtension).group
        """The replica's ranks when the stage's parallel degrees ask for several: each batch's call runs on them,
        and the pipeline here (in CPU memory) only answers for the model; ``None``: the call runs here."""
        self.quantization = self.extensions.get(QuantizationExtension).plan
        """What the stage holds quantized (``quantization``, or a folder saved quantized)."""
        device = self.device if self.group is None else torch.device("cpu")
        self.pipeline = load_pipeline(
            *(od_config.model, self.dtype, device, skips, stage.cpu_offload, self.quantization),
            *(stage.trust_remote_code, stage.load_format),
        )
        set_vae_memory(self.pipeline, stage.vae_tiling, stage.vae_slicing)
        self.extensions.on_load(self.pipeline)
        self.card = ModelCard.of(self.pipeline)
        """What admission needs of the pipeline."""
        self._pipelines = {self.card.pipeline_name: self.pipeline}
        """The pipelines run so far by class name: the loaded one, and its image variants (`ModelCard.variants`)
        built on its components when a request first needs one."""
        logger.info(
            "Loaded %s from %s on %s (%s) in %.2f s for stage %d (%s); quantized: %s",
            *(self.card.pipeline_name, od_config.model, self.device, self.dtype, time.perf_counter() - started),
            *(stage.stage_id, stage.stage_type, self.quantization.describe()),
        )

    @property
    def lora(self) -> LoraAdapters | None:
        """The LoRA adapters resident in the pipeline; ``None`` when the stage serves none."""
        return self.extensions.get(LoraExtension).adapters

    @property
    def step_cache(self) -> StepCache | CallCache | None:
        """The step cache on the denoisers (``cache_backend``); ``None``: no step cache."""
        return self.extensions.get(StepCacheExtension).cache

    @property
    def compiled(self) -> set[tuple[int, int, int | None]] | None:
        """The sizes the compiled denoiser has been asked for (warm-up ones first); ``None``: not compiled."""
        return self.extensions.get(CompileExtension).compiled

    @property
    def timed(self) -> bool:
        """Whether its components are hooked for `timings.ComponentTimer` (``component_timings``)."""
        return self.extensions.get(TimingsExtension).enabled

    def note_size(self, params) -> None:
        """Log the first request of a size the compiled denoiser was not warmed up for: it compiles on first use."""
        self.extensions.get(CompileExtension).note_size(params)

    def load_adapters(self, requests: Iterable[DiffusionRequest], keep: Iterable[str] = ()) -> None:
        """Make the adapters of ``requests`` resident, evicting only adapters outside ``keep`` (those of the
        requests in flight) and theirs."""
        self.extensions.get(LoraExtension).load_adapters(requests, keep)

    def refuse(self, verb: str, argument: Any) -> None:
        """Raise if an extension refuses control verb ``verb`` now (`Extension.refuse`)."""
        self.extensions.refuse(verb, argument)

    def run(self, batch: list[DiffusionRequest], previews: Previews | None = None) -> list[list[Any]]:
        """One pipeline call for the whole batch: each request's ``num_outputs_per_prompt`` images (or videos, each
        a list of frames, or waveforms); raises if the call raises. ``previews`` makes the partial images its
        requests ask for."""
        call = self._call(batch, previews)
        configured = _configured(call.pipeline, call.config, call.scheduler_overrides)
        # the call's own config and noise, then its extensions
        with configured, noise_per_request(call), self.extensions.around_call(call) as step_hooks:
            if call.callback:
                call.kwargs.update(self._step_callback(batch, step_hooks))
            result = (call.invoke or call.pipeline)(**call.kwargs)
        items = OUTPUTS[self.card.output](result)
        n = call.n
        if len(items) != len(batch) * n:
            raise RuntimeError(
                f"{self.card.pipeline_name} returned {len(items)} outputs for {len(batch)} x {n} requested"
            )
        return [items[i * n : (i + 1) * n] for i in range(len(batch))]

    def _call(self, batch: list[DiffusionRequest], previews: Previews | None) -> PipelineCall:
        """The batch's pipeline call: its pipeline, its arguments, its config and scheduler settings."""
        params = batch[0].params  # the batch key makes these equal across the batch
        card = self.card.for_task(params.task)
        n = params.num_outputs_per_prompt
        # An instruction-edit or image-to-video model gets one row per output (prompt, image, generator): it pairs
        # images with rows by tiling, and cannot repeat its image embeddings per prompt.
        conditioned = params.image is not None and not card.noises_its_image and card.max_images == 1
        rows = n if conditioned else 1
        kwargs = self._arguments(card, batch, rows)
        config = {arg: kwargs.pop(arg) for arg in card.config_args if arg in kwargs}
        for arg in ENGINE_ARGS:  # the batch's scheduler has its flow_shift; the SDE keys are `sde_sampling`'s
            kwargs.pop(arg, None)
        pipeline = self._pipeline(card)
        return PipelineCall(
            batch=batch,
            pipeline=pipeline,
            variant=pipeline is not self.pipeline,
            kwargs=kwargs,
            config=config,
            scheduler_overrides=card.scheduler_overrides(params),
            rows=rows,
            n=n,
            previews=previews,
            callback="callback_on_step_end" in card.call_args or "callback" in card.call_args,
        )

    def _arguments(self, card: ModelCard, batch: list[DiffusionRequest], rows: int) -> dict[str, Any]:
        """The pipeline's arguments for ``batch``, ``rows`` prompt rows per request."""
        params = batch[0].params
        n = params.num_outputs_per_prompt
        # One CPU generator per request, the same object for each of its n images: diffusers
        # draws each row's noise from its own generator, so a request's noise does not
        # depend on the batch it lands in (nor on the device).
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in batch]
        kwargs: dict[str, Any] = dict(
            prompt=[r.prompt for r in batch for _ in range(rows)],
            num_inference_steps=params.num_inference_steps,
            output_type="np" if card.audio is not None else params.output_type,  # waveforms are arrays
            generator=[g for g in generators for _ in range(n)],
            **params.extra_args,
        )
        if card.audio is not None:
            kwargs.update(card.audio.call_args(params.audio_length, params.audio_start))
            for arg in card.audio.per_row:  # the batch key makes the request's value the batch's
                kwargs[arg] = [kwargs.get(arg, card.call_defaults.get(arg))] * len(kwargs["prompt"])
        if "height" in card.call_args:  # SD's image-to-image keeps its input's size, which is the request's
            kwargs.update(height=params.height, width=params.width)
        if "max_area" in card.call_args:  # Kontext sizes its output by area (at the requested aspect ratio)
            assert params.height is not None and params.width is not None, "complete params"
            kwargs["max_area"] = params.height * params.width
        if params.image is not None:
            kwargs.update(self._image_args(card, batch))
        if params.video is not None:
            kwargs.update(self._video_args(card, batch))
        if params.num_frames is not None and "num_frames" in card.call_args:  # video-to-video keeps its video's
            kwargs["num_frames"] = params.num_frames
        if params.guidance_scale is not None:
            kwargs["guidance_scale"] = params.guidance_scale
        if card.outputs_arg is not None:
            kwargs[card.outputs_arg] = n // rows
        if params.negative_prompt is not None:
            kwargs["negative_prompt"] = [r.params.negative_prompt for r in batch for _ in range(rows)]
        return kwargs

    def _pipeline(self, card: ModelCard):
        """The pipeline of ``card``: the loaded one, or an image variant sharing its components (no weight copied)."""
        if card.pipeline_name not in self._pipelines:
            import diffusers

            variant = getattr(diffusers, card.pipeline_name).from_pipe(self.pipeline)
            variant.set_progress_bar_config(disable=True)
            self.extensions.on_load(variant, variant=True)
            self._pipelines[card.pipeline_name] = variant
        return self._pipelines[card.pipeline_name]

    @staticmethod
    def _image_args(card: ModelCard, batch: list[DiffusionRequest]) -> dict[str, Any]:
        """The input images of a batch: one per output row, or those of the request alone in its call."""
        params, n = batch[0].params, batch[0].params.num_outputs_per_prompt
        assert params.image is not None, "called for a batch with input images"
        if card.noises_its_image:  # at the output size, as step mode takes it
            inputs = [fitted_inputs(r.params) for r in batch]
            args: dict[str, Any] = {"image": [images[0] for images, _ in inputs for _ in range(n)]}
            if params.mask_image is not None:
                args["mask_image"] = [mask for _, mask in inputs for _ in range(n)]
            steps, strength = params.num_inference_steps, params.strength
            assert steps is not None and strength is not None, "complete params"
            for request in batch:
                request.total_steps = steps - card.strength_offset(steps, strength)
            return args | {"strength": params.strength}
        if not card.batches_images:  # the batch key keeps such a request alone
            images = [image.convert("RGB") for image in params.image]
            return {"image": images if card.max_images > 1 else images[0]}
        # An instruction-edit model sizes its input itself.
        rows = []
        for r in batch:
            assert r.params.image is not None, "a batch shares its task"
            rows += [r.params.image[0].convert("RGB") for _ in range(n)]
        return {"image": rows}

    @staticmethod
    def _video_args(card: ModelCard, batch: list[DiffusionRequest]) -> dict[str, Any]:
        """The input video of a video-to-video request, alone in its call (the batch key keeps it so), and its
        ``strength``."""
        (request,) = batch
        params = request.params
        steps, strength = params.num_inference_steps, params.strength
        assert params.video is not None and steps is not None and strength is not None, "complete video params"
        request.total_steps = steps - card.strength_offset(steps, strength)
        return {"video": [frame.convert("RGB") for frame in params.video], "strength": strength}

    def release_cached_memory(self) -> None:
        """Give the allocator's cached blocks back after an out-of-memory error, before a retry."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _step_callback(self, batch: list[DiffusionRequest], step_hooks: list[StepHook]) -> dict[str, Any]:
        """The call's step callback (`_on_step_end`): as ``callback_on_step_end``, or, for a pipeline that takes only
        diffusers' older ``callback(step, timestep, latents)`` (Stable Audio, AudioLDM 2), as that, every step."""
        on_step_end = self._on_step_end(batch, step_hooks)
        if "callback_on_step_end" in self.card.call_args:
            return {"callback_on_step_end": on_step_end}
        pipeline = self.pipeline

        def callback(step: int, timestep, latents) -> None:
            on_step_end(pipeline, step, timestep, {})

        return {"callback": callback, "callback_steps": 1}

    @staticmethod
    def _on_step_end(batch: list[DiffusionRequest], step_hooks: list[StepHook]):
        """Track each request's progress and run the extensions' step hooks (the timings' end of the step, the
        previews due); stop early once every request of the batch was aborted (where the pipeline's loop reads
        diffusers' ``_interrupt``)."""

        def on_step_end(pipeline, step: int, timestep, callback_kwargs: dict) -> dict:
            for request in batch:
                request.steps_done = step + 1
            for hook in step_hooks:
                hook()
            if all(request.aborted for request in batch):
                pipeline._interrupt = True  # diffusers' loops skip the remaining steps
            return callback_kwargs

        return on_step_end


@contextlib.contextmanager
def _configured(pipeline, config: dict[str, Any], scheduler_overrides: dict[str, Any]) -> Iterator[None]:
    """The pipeline with ``config`` (a batch's `ModelCard.config_args`) set in its config, and a noise scheduler of
    its own with ``scheduler_overrides`` (`ModelCard.scheduler_overrides`), for one call; then as it was: the next
    batch may ask for other values."""
    before = {name: pipeline.config[name] for name in config}
    scheduler = pipeline.scheduler
    if config:
        pipeline.register_to_config(**config)
    if scheduler_overrides:
        pipeline.scheduler = fresh_noise_scheduler(pipeline, scheduler_overrides)
    try:
        yield
    finally:
        pipeline.scheduler = scheduler
        if before:
            pipeline.register_to_config(**before)
