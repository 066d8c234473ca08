"""`StageRuntime`: one stage's replicas and the policy that picks a replica for each request.

The request itself (which stage and replica hold it, its re-run after a lost replica, abort) is tracked by its one
owner in this process, `OmniEngine`; a stage only counts what each of its replicas holds, to route by it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm_omni.config import STAGE_TYPES, OmniDiffusionConfig, StageDeployConfig
from vllm_omni.config.parallel import sequence_ranks
from vllm_omni.diffusion.engine.roles import ROLES, Admission, StageAdmission
from vllm_omni.errors import StageUnavailableError
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics
from vllm_omni.orchestrator.replica import EngineReplica, Replica, ReplicaInfo, ReplicaLostError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

if TYPE_CHECKING:
    from vllm_omni.codec.card import SpeechAdmission
    from vllm_omni.orchestrator.codec_replicas import Speech
    from vllm_omni.orchestrator.llm_replicas import LlmAdmission

logger = init_logger(__name__)


@dataclass(frozen=True)
class StageHealth:
    """What ``/health`` reports of a stage."""

    stage_id: int
    num_replicas: int
    alive: list[int]
    """Indices of the replicas that take requests now."""
    sleeping: tuple[int, ...] = ()
    """Indices of the live replicas that sleep (they take requests, and run them once awake)."""

    @property
    def status(self) -> str:
        """``ok`` (every replica alive), ``degraded`` (some), ``down`` (none), or ``sleeping`` (every live replica
        sleeps)."""
        if self.alive and set(self.alive) <= set(self.sleeping):
            return "sleeping"
        if len(self.alive) == self.num_replicas:
            return "ok"
        return "degraded" if self.alive else "down"


class Answer(NamedTuple):
    """A replica's answer to a control verb (`StageRuntime.call`)."""

    stage_id: int
    replica: int
    future: Future


def wait(answers: Iterable[Answer]) -> list:
    """Each answer's result once all have come; a replica lost meanwhile is only logged (a Ray replica comes back
    awake, and catches up on what it keeps); the first other error is raised."""
    results, failed = [], None
    for stage_id, index, future in answers:
        error = future.exception()
        if isinstance(error, ReplicaLostError):
            logger.warning("stage %d replica %d: %s", stage_id, index, error)
        elif error is not None:
            failed = failed or error
        else:
            results.append(future.result())
    if failed is not None:
        raise failed
    return results


class StageRuntime:
    """One stage: ``num_replicas`` engines (inline: one on a thread here; ray: one actor each).

    `route` sends a request to the live replica with the fewest outstanding requests; on a tie, to one that
    already holds requests with the same batch key, so they can share a batch.
    """

    def __init__(
        self,
        model: str,
        stage_config: StageDeployConfig,
        next_stage: StageDeployConfig | None = None,
        torch_threads: int | None = None,
        input_stage: StageDeployConfig | None = None,
    ):
        """``next_stage``: the stage that takes this one's outputs (split pipelines); between two Ray stages
        outputs stay in Ray's object store. ``torch_threads``: of each replica's engine thread
        (`engine_torch_threads`). ``input_stage``: the stage whose outputs this one takes (a codec stage reads its
        talker's tokenizer)."""
        self.stage_config = stage_config
        self.stage_id = stage_config.stage_id
        logger.info("Starting %s", stage_config.describe())
        self._release_backend = None
        self.replicas: Sequence[Replica]
        admission: LlmAdmission | StageAdmission | SpeechAdmission | None = None
        self.speech: Speech | None = None
        """A codec stage's speech facts (its family, its talker's prompt format, the card)."""
        runs = STAGE_TYPES[stage_config.stage_type].runs
        if runs == "vllm":
            from vllm_omni.orchestrator.llm_replicas import LlmAdmission, start_llm_replicas

            self.replicas, self._release_backend = start_llm_replicas(stage_config)
            admission = LlmAdmission()
        elif runs == "codec":
            from vllm_omni.codec.card import SpeechAdmission
            from vllm_omni.orchestrator.codec_replicas import start_codec_replicas

            assert input_stage is not None, "a codec stage takes a talker"
            self.replicas, self.speech = start_codec_replicas(stage_config, input_stage, torch_threads)
            admission = SpeechAdmission(self.speech.card)
        elif stage_config.distributed_executor_backend == "ray":
            from vllm_omni.orchestrator.ray_replicas import start_replicas

            by_reference = next_stage is not None and next_stage.distributed_executor_backend == "ray"
            self.replicas, self._release_backend = start_replicas(model, stage_config, by_reference, torch_threads)
        else:
            self.replicas = [EngineReplica(OmniDiffusionConfig.from_stage(model, stage_config, 0, torch_threads))]
        self.info: ReplicaInfo = self.replicas[0].info
        if admission is None:
            assert self.info.card is not None, "a diffusers stage's replicas have a card"
            admission = ROLES[stage_config.stage_type].admission(
                stage_config.execution_mode, self.info.card, sequence_ranks(stage_config)
            )
        self.admission = admission
        """How the stage admits requests: here, from its replicas' model card, without asking a replica."""
        self._lock = threading.Lock()
        self._load = [0] * len(self.replicas)
        self._keys: list[Counter[Hashable]] = [Counter() for _ in self.replicas]
        # Calls that go to every replica at once (metrics at each scrape, shutdown).
        self._fan_out = ThreadPoolExecutor(len(self.replicas), thread_name_prefix=f"vllm-omni-stage-{self.stage_id}")
        stage = str(self.stage_id)
        metrics.stage_replicas.labels(stage, "alive").set_function(lambda: len(self.health().alive))
        metrics.stage_replicas.labels(stage, "down").set_function(lambda: len(self.replicas) - len(self.health().alive))

    def health(self) -> StageHealth:
        alive = [i for i, replica in enumerate(self.replicas) if replica.is_alive]
        sleeping = tuple(i for i in alive if self.sleeps and self._sleeping(self.replicas[i]))
        return StageHealth(self.stage_id, len(self.replicas), alive, sleeping)

    @staticmethod
    def _sleeping(replica: Replica) -> bool:
        """Whether ``replica`` sleeps, answered at once (inline: by its engine; Ray: as it last answered); one that
        died meanwhile does not."""
        answer = replica.call("is_sleeping")
        return answer.exception() is None and answer.result()

    @property
    def sleeps(self) -> bool:
        """Whether its replicas sleep and wake: a diffusers stage's do; an llm or codec stage serves on."""
        return STAGE_TYPES[self.stage_config.stage_type].runs == "diffusers"

    def call(self, method: str, *args, down_too: bool = False) -> list[Answer]:
        """Control verb ``method`` (`Replica.call`) on every live replica at once, and with ``down_too`` on those
        that are down as well (a Ray replica keeps weights and tensors for when it is back, `CatchUp`); `wait`
        waits for the answers."""
        return [
            Answer(self.stage_id, i, replica.call(method, *args))
            for i, replica in enumerate(self.replicas)
            if down_too or replica.is_alive
        ]

    @property
    def is_alive(self) -> bool:
        """Whether at least one replica takes requests."""
        return any(replica.is_alive for replica in self.replicas)

    def admit(self, params: OmniDiffusionSamplingParams) -> Admission:
        """``params`` completed and checked, with their batch key (raises `SamplingParamsError`, and
        `StageUnavailableError` when no replica is alive to run them)."""
        if not self.is_alive:
            raise StageUnavailableError(self.stage_id, "no replica is alive")
        return self.admission.admit(params)

    def route(self, key: Hashable, lost: int | None = None) -> int | None:
        """The replica that takes a request with batch ``key`` next (counted as its until `release`); ``None`` when
        no live replica other than ``lost`` is left."""
        with self._lock:
            live = [i for i, replica in enumerate(self.replicas) if replica.is_alive and i != lost]
            if not live:
                return None
            index = min(live, key=lambda i: (self._load[i], self._keys[i][key] == 0, i))
            self._load[index] += 1
            self._keys[index][key] += 1
            return index

    def release(self, index: int, key: Hashable) -> None:
        """Replica ``index`` no longer holds a request with batch ``key``."""
        with self._lock:
            self._load[index] -= 1
            keys = self._keys[index]
            keys[key] -= 1
            if not keys[key]:
                del keys[key]

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch on the live replicas (`Replica.num_waiting`)."""
        return sum(replica.num_waiting for replica in self.replicas if replica.is_alive)

    def shared(self, value: Any) -> Any:
        """``value`` as its replicas take it (weights, a LoRA adapter's tensors): a Ray stage's put into the object
        store once, so that each actor reads that one copy rather than one pickle per call."""
        if self.stage_config.distributed_executor_backend != "ray":
            return value
        from vllm_omni.orchestrator.ray_updates import shared

        return shared(value)

    def collect_metrics(self) -> list[list]:
        """Every live replica's metric families (asked of all replicas at once)."""
        live = [replica for replica in self.replicas if replica.is_alive]
        return list(self._fan_out.map(lambda replica: replica.collect_metrics(), live))

    def shutdown(self) -> None:
        """Stop taking requests, fail the waiting ones, let the running ones finish (all replicas at once)."""
        list(self._fan_out.map(lambda replica: replica.shutdown(), self.replicas))
        self._fan_out.shutdown()
        if self._release_backend is not None:
            self._release_backend()
        for state in ("alive", "down"):  # the gauges' callbacks hold this runtime
            metrics.stage_replicas.remove(str(self.stage_id), state)
