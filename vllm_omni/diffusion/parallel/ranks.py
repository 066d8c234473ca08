"""One pipeline call on several ranks: a `RankGroup` is one replica's ``torch.distributed`` process group (gloo on
the CPU, NCCL on CUDA), one process per rank, each holding the whole pipeline with its denoisers split over the
group: by diffusers' context parallelism (``ulysses_degree``, ``ring_degree``), by CFG-parallel
(``cfg_parallel_size``, `vllm_omni.diffusion.parallel.cfg`), or its VAE decode by patches
(``vae_patch_parallel_size``, `vllm_omni.diffusion.parallel.vae_patch`); CFG-parallel with a context-parallel
degree on a ``cfg x ring x ulysses`` device mesh, the VAE split alone for now. The caller puts each call in every
rank's inbox, every rank runs it, and rank 0 returns the output.

A replica whose stage asks for more than one rank holds one (`DiffusionRunner.group`, `RankGroup.of_stage`): its
runner builds each batch's call as for one process and hands it to the group (request mode; inline replicas, or a
Ray replica's actor, whose ranks are its own processes; `OmniDiffusionConfig.from_stage` refuses what the group
does not run)."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import queue
import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from vllm_omni.config.parallel import PARALLEL_KNOBS
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.diffusion.features.sde import SdeSettings
from vllm_omni.diffusion.parallel.cfg import enable_cfg_parallel
from vllm_omni.diffusion.parallel.vae_patch import enable_vae_patch_parallel
from vllm_omni.diffusion.pipeline.components import loaded_denoisers
from vllm_omni.diffusion.pipeline.dummy_weights import dummy_components, pipeline_loader
from vllm_omni.diffusion.pipeline.extension import Extension
from vllm_omni.diffusion.pipeline.noise import draws_brownian_noise
from vllm_omni.errors import SamplingParamsError, SleepModeError, WeightUpdateError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.config import OmniDiffusionConfig
    from vllm_omni.diffusion.engine.request import PipelineCall


@contextlib.contextmanager
def _one_device_per_cpu_rank() -> Iterator[None]:
    """diffusers 0.42 places a rank on ``rank % torch.accelerator.device_count()``, which is 0 on a host without an
    accelerator (ZeroDivisionError); on the CPU every rank's device is the CPU, so count one while it places them."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


RING_BACKEND = "_native_cudnn"
"""diffusers' attention backend for ring attention: torch's cuDNN attention, which returns the log-sum-exp of each
block (CUDA, bfloat16 or float16)."""


def enable_context_parallel(pipeline, ulysses_degree: int, ring_degree: int, mesh=None) -> list[str]:
    """Split each denoiser of ``pipeline`` over the ranks of the initialized process group with diffusers' context
    parallelism (``ContextParallelConfig``, the denoiser's ``_cp_plan``); returns the denoisers' names. ``mesh``: a
    device mesh with ``ring`` and ``ulysses`` dimensions when the group has others too (CFG-parallel's ``cfg``)."""
    from diffusers import ContextParallelConfig

    names = loaded_denoisers(pipeline)
    for name in names:
        config = ContextParallelConfig(
            ulysses_degree=ulysses_degree if ulysses_degree > 1 else None,
            ring_degree=ring_degree if ring_degree > 1 else None,
            mesh=mesh,
        )
        if ring_degree > 1:  # the native backend returns no log-sum-exp, which ring attention merges blocks with
            getattr(pipeline, name).set_attention_backend(RING_BACKEND)
        with _one_device_per_cpu_rank():
            getattr(pipeline, name).enable_parallelism(config=config)
    return names


def check_on_ranks(
    batch: list, variant: bool, config: dict, overrides: dict, samplers: list, brownian: bool = False
) -> None:
    """Refuse a batch that asks what the ranks do not run yet: they run the loaded pipeline's own call, with its
    config and noise scheduler as loaded, and no callback (hence no previews and no SDE sampling); ``brownian``:
    the batch's requests would need their own Brownian trees (`noise.noise_per_request`), which the ranks' call
    does not make."""
    asked = {
        "several outputs per prompt with Brownian SDE noise (Stable Audio's scheduler)": brownian,
        "partial_images (previews)": any(r.params.partial_images for r in batch),
        "an image variant of the pipeline": variant,
        f"pipeline config {sorted(config)}": bool(config),
        f"scheduler settings {sorted(overrides)}": bool(overrides),
        "SDE sampling": any(sampler is not None for sampler in samplers),
    }
    refused = [what for what, wanted in asked.items() if wanted]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: not run on a replica of several ranks yet (the stage's parallel degrees); "
            "serve such requests from a stage whose degrees are 1"
        )


def check_sequence_split(card: ModelCard, params: OmniDiffusionSamplingParams, ranks: int) -> None:
    """Refuse, naming the size, a request whose latent tokens ``ranks`` sequence-parallel ranks cannot split
    evenly: diffusers' context parallelism shards the denoiser's sequence in equal parts, and fails the whole batch's
    call on a remainder. ``params`` are complete (their size is known)."""
    side, height, width, num_frames = card.latent_pixels, params.height, params.width, params.num_frames
    assert height is not None and width is not None, "incomplete params"
    rows, columns = height // side, width // side
    if card.output == "video":
        assert num_frames is not None, "incomplete params"
        frames = (num_frames - 1) // card.frame_multiple + 1
    else:
        frames = 1
    tokens = rows * columns * frames
    if tokens % ranks:
        shape = f"{rows}x{columns}" + (f" x {frames} latent frames" if card.output == "video" else "")
        raise SamplingParamsError(
            "height",
            f"height={params.height} and width={params.width} make {tokens} tokens ({shape}, one per {side}x{side} "
            f"pixels) for {card.pipeline_name}'s denoiser, which the stage's ulysses_degree x ring_degree = {ranks} "
            f"ranks split in equal parts: choose a height or width that is a multiple of {side * ranks}",
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _next_call(inbox, owner: int) -> dict[str, Any] | None:
    """The next call put in this rank's inbox; ``None`` to end (asked, or the process that owns the group is gone:
    a replica's process killed leaves no rank behind). An idle rank waits here, never in a collective, whose
    timeout would end an idle group."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                return None


def _rank_main(rank: int, world: int, port: int, setup: dict[str, Any], inbox, outbox) -> None:
    """One rank: join the group, load the pipeline, then run every call put in its inbox until ``None``."""
    if setup["torch_threads"] is not None:
        torch.set_num_threads(setup["torch_threads"])
    cuda = torch.cuda.is_available()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=setup["timeout_s"]),
    )
    devices = setup["devices"].split(",") if setup["devices"] else range(world)
    device = torch.device("cuda", int(devices[rank])) if cuda else torch.device("cpu")
    try:
        model, dtype = setup["model"], setup["dtype"]
        dummies = dummy_components(model, dtype, device) if setup["load_format"] == "dummy" else {}
        with open(os.path.join(model, "model_index.json"), encoding="utf-8") as index:
            loader = pipeline_loader(json.load(index), bool(dummies))
        pipeline = loader.from_pretrained(
            model, dtype=dtype, local_files_only=True, trust_remote_code=setup["trust_remote_code"], **dummies
        ).to(device)
        pipeline.set_progress_bar_config(disable=True)
        ulysses, ring, cfg = setup["ulysses_degree"], setup["ring_degree"], setup["cfg_parallel_size"]
        if setup["vae_patch_parallel_size"] > 1:
            split = ["vae"]
            enable_vae_patch_parallel(pipeline.vae, rank, world)
        elif cfg > 1 and ulysses * ring > 1:  # each CFG branch on a context-parallel group of its own
            mesh = init_device_mesh(device.type, (cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
            split = enable_context_parallel(pipeline, ulysses, ring, mesh)
            branch = mesh["cfg"]
            enable_cfg_parallel([getattr(pipeline, n) for n in split], branch.get_local_rank(), branch.get_group())
        elif cfg > 1:
            split = loaded_denoisers(pipeline)
            enable_cfg_parallel([getattr(pipeline, name) for name in split], rank)
        else:
            split = enable_context_parallel(pipeline, ulysses, ring)
        outbox.put((rank, "ready", split))
        while (job := _next_call(inbox, setup["owner"])) is not None:
            try:
                output = pipeline(**job)
            except Exception as exc:  # noqa: BLE001 - every rank answers; a bad call fails on all of them alike
                outbox.put((rank, "error", repr(exc)))
            else:
                outbox.put((rank, "ok", output if rank == 0 else None))  # rank 0's images are the group's
    except Exception as exc:
        outbox.put((rank, "error", repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


MAIN_REIMPORTED = 87
"""A rank's exit code when it was started while it imported the main script again (`check_not_bootstrapping`)."""


def _unguarded(script: str) -> str:
    return (
        f"the ranks of a parallel stage start from a forkserver, which imports the main script {script} again in "
        "each rank, and the script made an Omni (or a RankGroup) as it was imported: put the code that runs it under "
        '`if __name__ == "__main__":` (as vLLM\'s workers need too; docs/scaling.md)'
    )


def check_not_bootstrapping() -> None:
    """In a process that multiprocessing is still starting, which is importing the main script again (a script
    without an ``if __name__ == "__main__":`` guard), end it at once with `MAIN_REIMPORTED`, naming the cause and
    the fix, rather than start processes that Python refuses there; the group's owner names them too."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        # The script being imported again runs as __mp_main__; __main__ is still the forkserver's own until it ends.
        main = getattr(sys.modules.get("__mp_main__"), "__file__", "<the main module>")
        print(f"RuntimeError: {_unguarded(main)}", file=sys.stderr, flush=True)
        os._exit(MAIN_REIMPORTED)


def _check_degrees(cfg: int, ulysses: int, ring: int, vae_patch: int, dtype: torch.dtype) -> None:
    """What a group of these degrees cannot run here, refused before any rank starts."""
    if ring > 1 and not torch.cuda.is_available():
        raise ValueError(
            "ring_degree needs an attention backend that returns the log-sum-exp of its blocks, and none of "
            "diffusers' runs on the CPU (its native one refuses return_lse): use ulysses_degree on the CPU"
        )
    if ring > 1 and dtype == torch.float32:
        raise ValueError(
            f"ring_degree runs on diffusers' {RING_BACKEND} attention, which takes bfloat16 or float16: set "
            "dtype to one of them, or use ulysses_degree"
        )
    if vae_patch > 1 and cfg * ulysses * ring > 1:
        raise ValueError("vae_patch_parallel_size with another parallel degree is not run yet")


class RankGroup:
    """One replica's ranks: the product of the degrees, one process each, each with the pipeline of ``model`` loaded
    at ``dtype`` and its denoisers (or its VAE decode) split over the group. `call` runs one pipeline call on all of
    them and returns rank 0's output; `close` ends them. A collective that waits past ``timeout_s`` ends the
    group."""

    def __init__(
        self,
        model: str,
        *,
        cfg_parallel_size: int = 1,
        ulysses_degree: int = 1,
        ring_degree: int = 1,
        vae_patch_parallel_size: int = 1,
        dtype: torch.dtype = torch.float32,
        torch_threads: int | None = 1,
        timeout_s: float = 300.0,
        devices: str | None = None,
        trust_remote_code: bool = False,
        load_format: str = "auto",
    ):
        check_not_bootstrapping()
        _check_degrees(cfg_parallel_size, ulysses_degree, ring_degree, vae_patch_parallel_size, dtype)
        self.world = math.prod((cfg_parallel_size, ulysses_degree, ring_degree, vae_patch_parallel_size))
        self.timeout_s = timeout_s
        self.lost: str | None = None
        """Why the group ended when a rank died (every later call fails); ``None`` while it serves."""
        setup = dict(
            owner=os.getpid(),
            model=model,
            dtype=dtype,
            cfg_parallel_size=cfg_parallel_size,
            vae_patch_parallel_size=vae_patch_parallel_size,
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            torch_threads=torch_threads,
            timeout_s=timeout_s,
            devices=devices,
            trust_remote_code=trust_remote_code,
            load_format=load_format,  # dummy: every rank draws the same weights (`dummy_weights.SEED`)
        )
        # Forked from this process's forkserver, a process that has run no torch op (no OpenMP team and no CUDA
        # context is forked). Its preload, where the process set one (the tests' forkserver
        # imports the serving stack), spares each rank the imports; otherwise each rank imports what it needs.
        context = multiprocessing.get_context("forkserver")
        self._inboxes = [context.Queue() for _ in range(self.world)]  # every rank gets each call itself
        self._outbox = context.Queue()
        port = _free_port()
        self._ranks = [
            context.Process(target=_rank_main, args=(rank, self.world, port, setup, inbox, self._outbox), daemon=True)
            for rank, inbox in enumerate(self._inboxes)
        ]
        for process in self._ranks:
            process.start()
        try:
            self.split: list[str] = self._receive("ready")
            """The denoisers split over the group."""
        except BaseException:
            self.close(wait=False)
            raise

    @classmethod
    def of_stage(cls, od_config, dtype: torch.dtype) -> RankGroup | None:
        """The ranks of one replica of ``od_config``'s stage (its degrees, devices and torch threads); ``None`` when
        its degrees make one rank. The engine's torch threads are shared out over the ranks (at least one each), so
        that the group holds no more OpenMP threads than the one process would."""
        stage = od_config.stage
        world = math.prod(getattr(stage, knob) for knob in PARALLEL_KNOBS)
        if world == 1:
            return None
        threads = od_config.torch_threads
        return cls(
            od_config.model,
            cfg_parallel_size=stage.cfg_parallel_size,
            ulysses_degree=stage.ulysses_degree,
            ring_degree=stage.ring_degree,
            vae_patch_parallel_size=stage.vae_patch_parallel_size,
            dtype=dtype,
            torch_threads=None if threads is None else max(1, threads // world),
            devices=stage.devices,
            trust_remote_code=stage.trust_remote_code,
            load_format=stage.load_format,
        )

    def _receive(self, what: str) -> Any:
        """Every rank's answer, then rank 0's value; RuntimeError when the call failed, or when a rank ended
        without answering (the group then ends: the others may wait for it in a collective). Every rank answers
        each call, so a dead rank is told from a failed call whichever is noticed first."""
        answers: dict[int, tuple[str, Any]] = {}
        while len(answers) < self.world:
            try:
                rank, status, value = self._outbox.get(timeout=1.0)
                answers[rank] = (status, value)
            except queue.Empty:
                pass
            dead = [rank for rank, p in enumerate(self._ranks) if p.exitcode is not None and rank not in answers]
            if dead:
                reimported = any(self._ranks[rank].exitcode == MAIN_REIMPORTED for rank in dead)
                self.close(wait=False)
                errors = [value for status, value in answers.values() if status == "error"]
                self.lost = f"rank(s) {dead} of the group ended before it answered ({what})" + (
                    f": {errors[0]}" if errors else ""
                )
                if reimported:
                    main = getattr(sys.modules.get("__main__"), "__file__", "<the main module>")
                    self.lost += f": {_unguarded(main)}"
                raise RuntimeError(self.lost)
        if errors := [value for status, value in answers.values() if status == "error"]:
            raise RuntimeError(f"the group failed ({what}): {answers[0][1] if answers[0][0] == 'error' else errors[0]}")
        return answers[0][1]

    def call(self, **kwargs: Any) -> Any:
        """Run ``pipeline(**kwargs)`` on every rank (its generators are pickled, each rank draws the same noise);
        rank 0's output. RuntimeError when a rank died, or once the group has ended."""
        for inbox in self._inboxes:
            inbox.put(kwargs)
        return self._receive("call")

    def close(self, wait: bool = True) -> None:
        """Tell the ranks to stop, and wait for them (``wait=False``, or a rank still running after ``timeout_s``:
        killed)."""
        if wait and all(p.exitcode is None for p in self._ranks):
            for inbox in self._inboxes:
                inbox.put(None)
        for process in self._ranks:
            process.join(self.timeout_s if wait else 0)
            if process.exitcode is None:
                process.kill()
                process.join()


class RanksExtension(Extension):
    """A replica of several ranks as an extension (`vllm_omni.diffusion.pipeline.extensions`): its `RankGroup`
    starts before the pipeline loads (which then stays in CPU memory, answering for the model), and runs each
    request-mode call with no step callback, after refusing what the ranks do not run (`check_on_ranks`); it refuses
    sleep and weight updates. ``group`` is ``None`` when the stage's degrees make one rank."""

    name = "ranks"

    def __init__(self, od_config: OmniDiffusionConfig, device: torch.device, dtype: torch.dtype, skips: tuple):
        self.group = RankGroup.of_stage(od_config, dtype)
        """The replica's ranks when the stage's parallel degrees ask for several; ``None``: the call runs here."""

    @contextlib.contextmanager
    def around_call(self, call: PipelineCall) -> Iterator[None]:
        if self.group is not None:
            sde = [SdeSettings.of(request.params) for request in call.batch]
            brownian = call.n > 1 and draws_brownian_noise(call.pipeline.scheduler)  # n = 1: diffusers' own trees do
            check_on_ranks(call.batch, call.variant, call.config, call.scheduler_overrides, sde, brownian)
            call.invoke, call.callback = self.group.call, False  # the ranks call no callback
        yield None

    def refuse(self, verb: str, argument: Any) -> None:
        if self.group is None:
            return
        if verb == "sleep":
            raise SleepModeError(
                "level", "sleep: a replica of several ranks (the stage's parallel degrees) cannot sleep yet"
            )
        if verb == "update_weights":
            raise WeightUpdateError(
                None, "a replica of several ranks (the stage's parallel degrees) cannot update weights yet"
            )
