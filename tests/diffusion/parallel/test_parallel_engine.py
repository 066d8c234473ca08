"""A replica of several ranks through `Omni` (issue 43): ``cfg_parallel_size=2`` and ``ulysses_degree=2`` on the tiny
Flux, two gloo ranks, give the one-process images within 2/255, a request alone and a batch of four; a rank that
dies marks the replica down and fails its request with an error instead of hanging."""

import re

import numpy as np
import pytest

from vllm_omni import Omni
from vllm_omni.errors import StageUnavailableError
from vllm_omni.sampling_params import OmniDiffusionSamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["a red fox", "a blue car on a road", "snow", "a small green frog on a leaf"]
SEEDS = [7, 8, 9, 10]


def _params(seed: int) -> OmniDiffusionSamplingParams:
    """Guided (a negative prompt and Flux's true CFG), so that CFG-parallel has an unconditional branch to split."""
    return OmniDiffusionSamplingParams(
        height=64,
        width=64,
        num_inference_steps=2,
        seed=seed,
        negative_prompt="blurry",
        extra_args={"true_cfg_scale": 4.0},
    )


def _pixels(output) -> np.ndarray:
    assert output.error is None, output.error
    return np.asarray(output.images[0]).astype(np.int16)


@pytest.fixture(scope="module")
def one_process(tiny_flux) -> list[np.ndarray]:
    """Each prompt alone in one process."""
    with Omni(model=tiny_flux, max_num_seqs=1) as omni:
        return [_pixels(o) for o in omni.generate(PROMPTS, [_params(seed) for seed in SEEDS])]


@pytest.mark.parametrize("degree", ["cfg_parallel_size", "ulysses_degree"])
def test_two_ranks_give_the_one_process_images_alone_and_in_a_batch(tiny_flux, one_process, degree):
    with Omni(model=tiny_flux, max_num_seqs=1, **{degree: 2}) as omni:
        assert omni.engine.stages[0].replicas[0].engine.runner.group.world == 2
        alone = omni.generate(PROMPTS[1], _params(SEEDS[1]))[0]
    assert alone.metrics["batch_size"] == 1
    assert np.abs(_pixels(alone) - one_process[1]).max() <= 2
    # A batch starts once full: the four requests share one call whatever the machine's speed.
    with Omni(model=tiny_flux, max_num_seqs=4, request_batch_max_wait_ms=600_000, **{degree: 2}) as omni:
        batched = omni.generate(PROMPTS, [_params(seed) for seed in SEEDS])
    assert [o.metrics["batch_size"] for o in batched] == [4] * 4
    for output, reference in zip(batched, one_process, strict=True):
        assert np.abs(_pixels(output) - reference).max() <= 2


def test_a_rank_that_dies_marks_the_replica_down_and_fails_its_request(tiny_flux):
    with Omni(model=tiny_flux, ulysses_degree=2) as omni:
        replica = omni.engine.stages[0].replicas[0]
        ranks = replica.engine.runner.group._ranks
        ranks[1].kill()
        ranks[1].join()
        failed = omni.generate(PROMPTS[0], _params(SEEDS[0]))[0]
        assert failed.error is not None and re.search(r"rank\(s\) \[(0, )?1\] of the group ended", failed.error)
        replica.stopped.result()  # its engine loop ended: the replica is down, its ranks too
        assert not replica.is_alive and all(rank.exitcode is not None for rank in ranks)
        with pytest.raises(StageUnavailableError, match="no replica is alive"):
            omni.generate(PROMPTS[0], _params(SEEDS[0]))
