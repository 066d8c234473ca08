"""Ray replicas of several ranks on the run's Ray cluster (``ray_cluster``: two nodes, one CPU each): each replica's
actor forks its group of two gloo ranks (``ulysses_degree`` 2). The requests spread over both replicas give the
stock pipeline's images; a rank that dies takes its replica down, the requests it held re-run on the other replica,
and no rank of the old group is left behind."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch
from prometheus_client import REGISTRY

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.checks.stock import stock_pipeline

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = ["a red fox", "a blue car on a road", "snow", "a small green frog on a leaf"]


def _params(seed: int) -> OmniDiffusionSamplingParams:
    return OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=seed)


def _stock(model: str, prompt: str, seed: int) -> np.ndarray:
    image = stock_pipeline(model)(
        prompt, height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(seed)
    ).images[0]
    return np.asarray(image, dtype=np.int16)


def _pixels(output) -> np.ndarray:
    assert output.error is None, output.error
    return np.asarray(output.images[0], dtype=np.int16)


def _rank_pids(replica) -> list[int]:
    """The pids of the replica's ranks, read in its actor."""
    return ray.get(
        replica._actor.__ray_call__.remote(lambda actor: [p.pid for p in actor.replica.engine.runner.group._ranks])
    )


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(predicate, what: str, timeout_s: float = 600.0) -> None:
    """Poll ``predicate`` until it holds (a state change, never a fixed sleep); the deadline is only a backstop."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)


def _sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(f"vllm_omni:{name}", labels) or 0.0


def test_ray_replicas_of_two_ranks_serve_stock_images_and_a_dead_rank_reruns_its_requests(ray_cluster, tiny_flux):
    references = [_stock(tiny_flux, prompt, seed) for seed, prompt in enumerate(PROMPTS)]
    with Omni(
        tiny_flux,
        num_replicas=2,
        ulysses_degree=2,
        max_num_seqs=2,
        placement_strategy="STRICT_SPREAD",
        ray_address=ray_cluster.address,
    ) as omni:
        params = [_params(seed) for seed in range(len(PROMPTS))]
        outputs = omni.generate(PROMPTS, params)
        assert {o.metrics["replica"] for o in outputs} == {0, 1}
        for output, reference in zip(outputs, references, strict=True):
            assert np.abs(_pixels(output) - reference).max() <= 2

        victim = omni.engine.stages[0].replicas[0]
        ranks = _rank_pids(victim)
        assert len(ranks) == 2 and all(_running(pid) for pid in ranks)
        retries = _sample("request_retries_total", stage="0")
        restarts = _sample("replica_restarts_total", stage="0", replica="0")
        os.kill(ranks[1], signal.SIGKILL)
        again = omni.generate(PROMPTS, params)  # the victim's batch fails on its dead rank: re-run on replica 1
        for output, reference in zip(again, references, strict=True):
            assert np.abs(_pixels(output) - reference).max() <= 2
        assert _sample("request_retries_total", stage="0") > retries
        assert _sample("replica_restarts_total", stage="0", replica="0") > restarts  # marked down
        _wait_until(lambda: not any(_running(pid) for pid in ranks), "the old group's ranks gone")
        # Ray restarts it (a new actor forks a new group), as any replica whose loop died: test_ray_replicas.py
