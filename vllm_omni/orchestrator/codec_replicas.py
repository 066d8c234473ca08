"""The replicas of a ``codec`` stage: each one a codec model in this process and the thread that decodes its
waiting windows in batches (`vllm_omni.codec.engine.window_queue.WindowQueue`), one decode call at a time. A
`CodecReplica` is a `vllm_omni.orchestrator.replica.Replica`: the stage routes windows to it as it routes requests."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prometheus_client.metrics_core import Metric

from vllm_omni.codec.card import SpeechCard
from vllm_omni.codec.engine.window_queue import WindowJob, WindowQueue
from vllm_omni.codec.families import SpeechFamily, TalkerFormat, detect_family
from vllm_omni.codec.pipeline.codecs import Codec, CodeWindow, load_codec
from vllm_omni.config import StageDeployConfig
from vllm_omni.diffusion.engine.control import failed
from vllm_omni.errors import RequestFailedError
from vllm_omni.logger import init_logger
from vllm_omni.metrics.prometheus import EngineMetrics
from vllm_omni.orchestrator.replica import ReplicaInfo, ReplicaLostError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

logger = init_logger(__name__)


@dataclass(frozen=True)
class DecodedWindow:
    """A window's samples (float32, ``frames × samples_per_frame``), and the call that decoded it."""

    samples: np.ndarray
    batch_size: int
    queue_s: float
    exec_s: float


@dataclass(frozen=True)
class Speech:
    """What the stages of a speech deploy share, read once: the family, the talker's prompt format, the card."""

    family: SpeechFamily
    talker: TalkerFormat
    card: SpeechCard


class CodecReplica:
    """One codec model and the thread that runs every decode call (the only thread of it that runs torch ops)."""

    def __init__(self, stage: StageDeployConfig, index: int, codec: Codec, speech: Speech, torch_threads: int | None):
        self.stage = stage
        self.codec = codec
        self.speech = speech
        self.info = ReplicaInfo(index=index, card=None, device=str(stage.devices or "cpu"), pid=os.getpid())
        self.metrics = EngineMetrics(stage.stage_id, index, "speech")
        self.queue = WindowQueue(stage.max_num_seqs, stage.window_order, stage.scheduling_policy == "priority")
        self.error: BaseException | None = None
        self._name = f"stage {stage.stage_id} replica {index}"
        self._thread = threading.Thread(target=self._run, args=(torch_threads,), name=f"vllm-omni-codec-{index}")
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _run(self, torch_threads: int | None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)  # this thread's OpenMP team, before its first op
        try:
            while (batch := self.queue.take()) is not None:
                self._decode(batch)
        except BaseException as exc:  # noqa: BLE001 - every window waiting fails below
            self.error = exc
            logger.exception("%s: codec loop died", self._name)
            self.queue.close()
            while (batch := self.queue.take()) is not None:
                for job in batch:
                    job.future.set_exception(ReplicaLostError(f"{self._name}: its codec loop died: {exc!r}"))

    def _decode(self, batch: list[WindowJob]) -> None:
        started = time.monotonic()
        self.metrics.num_requests_running.set(len(batch))
        self.metrics.num_requests_waiting.set(len(self.queue))
        try:
            with torch.inference_mode():
                audios = self.codec.decode([job.window for job in batch])
        except Exception as exc:  # noqa: BLE001 - the windows of this call fail, the replica goes on
            for job in batch:
                job.future.set_exception(RequestFailedError(job.request_id, f"{self._name}: decode failed: {exc}"))
            return
        finally:
            self.metrics.num_requests_running.set(0)
        exec_s = time.monotonic() - started
        self.metrics.batch_num_requests.observe(len(batch))
        self.metrics.batch_execution_time.observe(exec_s)
        for job, samples in zip(batch, audios, strict=True):
            self.metrics.queue_time.observe(started - job.arrived)
            job.future.set_result(DecodedWindow(samples, len(batch), started - job.arrived, exec_s))

    def submit(
        self,
        request_id: str,
        prompt: str,
        params: OmniDiffusionSamplingParams,
        payload: Any = None,
        on_preview: Callable[..., None] | None = None,
    ) -> Future:
        """``payload``: a `WindowJob` of the hand-off; the future resolves to its `DecodedWindow`."""
        if not self.is_alive:
            raise RequestFailedError(request_id, f"{self._name} is not running (error: {self.error!r})")
        assert isinstance(payload, WindowJob), "a codec stage takes the hand-off's windows"
        self.queue.add(payload)
        return payload.future

    def abort(self, request_id: str) -> bool:
        return self.queue.abort(request_id)

    def progress(self, request_id: str) -> tuple[str, float] | None:
        return None  # a speech request's progress is its stream's chunks

    @property
    def num_waiting(self) -> int:
        return len(self.queue)

    def warm_up(self) -> None:
        """One first-chunk window, so that the first request does not pay for the codec's first call."""
        frames = self.speech.family.first_chunk_frames + self.speech.family.lookahead_frames
        codes = np.zeros((frames, self.codec.codes_per_frame), dtype=np.int64)
        job = WindowJob(f"warmup-{uuid.uuid4().hex}", CodeWindow(codes, 0, 0), due=time.monotonic())
        self.submit(job.request_id, "", OmniDiffusionSamplingParams(), job).result()

    def collect_metrics(self) -> list[Metric]:
        self.metrics.num_requests_waiting.set(len(self.queue))
        return self.metrics.collect()

    def call(self, method: str, *args) -> Future:
        return failed(ValueError(f"codec stage {self.stage.stage_id} has no control verb {method!r}"))

    def shutdown(self) -> None:
        self.queue.close()
        self._thread.join()


def start_codec_replicas(
    stage: StageDeployConfig, talker: StageDeployConfig, torch_threads: int | None
) -> tuple[list[CodecReplica], Speech]:
    """Load the codec of ``stage`` once per replica, as the family of the talker stage's model decodes it (found
    by the code tokens of the talker's tokenizer)."""
    from transformers import AutoTokenizer

    assert stage.model is not None and talker.model is not None, "the resolver requires both models"
    tokenizer = AutoTokenizer.from_pretrained(talker.model, trust_remote_code=talker.trust_remote_code)
    family = detect_family(tokenizer)
    # The stage's first device if it names some, else the accelerator where there is one (as a diffusers stage).
    if stage.devices is not None:
        device = f"cuda:{stage.devices.split(',')[0]}"
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    codecs = [load_codec(family, stage.model, device) for _ in range(stage.num_replicas)]
    card = SpeechCard.of(family, codecs[0].sample_rate, codecs[0].samples_per_frame)
    speech = Speech(family, TalkerFormat(family, tokenizer, codecs[0].codebook_size), card)
    replicas = [CodecReplica(stage, i, codec, speech, torch_threads) for i, codec in enumerate(codecs)]
    logger.info(
        "stage %d: %s speech (%d Hz, %d voices), codec %s on %s",
        stage.stage_id,
        family.name,
        card.sample_rate,
        len(card.voices),
        stage.model,
        device,
    )
    return replicas, speech
