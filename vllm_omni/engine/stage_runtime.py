"""`StageRuntime`: runs one stage's diffusion engine on its own thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future

from vllm_omni.config import OmniDiffusionConfig, StageDeployConfig
from vllm_omni.diffusion.engine import make_engine
from vllm_omni.diffusion.request import OmniDiffusionSamplingParams
from vllm_omni.logger import init_logger
from vllm_omni.metrics import prometheus as metrics

logger = init_logger(__name__)


class StageRuntime:
    """One stage: the diffusion engine of its ``execution_mode``, built from the resolved stage config and
    stepped by a background thread."""

    def __init__(self, model: str, stage_config: StageDeployConfig):
        self.stage_config = stage_config
        self.od_config = OmniDiffusionConfig.from_stage(model, stage_config)
        logger.info("Starting %s", stage_config.describe())
        self.engine = make_engine(self.od_config)
        scheduler, stage = self.engine.scheduler, str(stage_config.stage_id)
        metrics.num_requests_running.labels(stage).set_function(lambda: scheduler.num_running)
        metrics.num_requests_waiting.labels(stage).set_function(lambda: scheduler.num_waiting)
        self._stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"vllm-omni-stage-{stage_config.stage_id}", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set() or self.engine.has_unfinished:
                self.engine.step()
        except BaseException as exc:  # noqa: BLE001 - reported to every request in flight below
            self.error = exc
            logger.exception("stage %d: engine loop died", self.stage_config.stage_id)
            self.engine.close(
                f"the engine loop of stage {self.stage_config.stage_id} died: {exc!r}", include_running=True
            )

    def add_request(self, request_id: str, prompt: str, params: OmniDiffusionSamplingParams) -> Future:
        if not self.is_alive:
            raise RuntimeError(f"stage {self.stage_config.stage_id} is not running (error: {self.error!r})")
        return self.engine.add_request(request_id, prompt, params)

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def shutdown(self) -> None:
        """Stop taking requests, fail the waiting ones, let the running ones finish."""
        self._stopping.set()
        self.engine.close()
        self._thread.join()
        self.engine.shutdown()
