"""A pipeline split into encode, denoise and decode stages, two of them Ray actors on the run's 2-node Ray cluster
(``ray_cluster``: one CPU per node). A module of its own: test_ray_replicas.py's two-replica deploy holds both CPUs
while that module runs, in whatever order its tests do."""

import os

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.config import DeployConfig, StageDeployConfig
from vllm_omni.diffusion.families.steppers import Conditioning
from vllm_omni.testing.checks.edits import noise_image, square_mask

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _loaded_model(replica) -> str:
    """The folder the replica's engine loaded."""
    return ray.get(replica._actor.__ray_call__.remote(lambda actor: actor.replica.engine.od_config.model))


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.int16)


def test_split_stages_on_ray_pass_payloads_through_the_object_store(ray_cluster, tiny_flux, hf_cache):
    """Encode inline, denoise and decode one Ray actor each (one per node), all on the one snapshot of the repo id."""
    cache, repo, commit = hf_cache
    on_ray = {"ray_address": ray_cluster.address, "distributed_executor_backend": "ray"}
    deploy = DeployConfig(
        stages=[
            StageDeployConfig(stage_id=0, stage_type="encode", max_num_seqs=4),
            StageDeployConfig(stage_id=1, stage_type="denoise", inputs=[0], max_num_seqs=2, **on_ray),
            StageDeployConfig(stage_id=2, stage_type="decode", inputs=[1], max_num_seqs=4, **on_ray),
        ]
    )
    params = [OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=4, seed=i) for i in range(4)]
    # Edits too: their images travel to the actors, their encoded images through the object store.
    params[2] = params[2].model_copy(update={"image": [noise_image(2, size=32)], "strength": 0.75})
    params[3] = params[3].model_copy(update={"image": [noise_image(3, size=32)], "mask_image": square_mask(32)})
    prompts = [f"prompt {i}" for i in range(4)]
    with Omni(tiny_flux, max_num_seqs=1) as single:
        want = single.generate(prompts, params)
    with Omni(repo, download_dir=cache, deploy_config=deploy) as omni:
        snapshot = os.path.join(cache, "models--tiny-org--flux", "snapshots", commit)
        assert omni.model == snapshot
        assert [_loaded_model(stage.replicas[0]) for stage in omni.engine.stages[1:]] == [snapshot, snapshot]
        got = omni.generate(prompts, params)
        # The inline encode stage hands its output on by value; the Ray denoise stage leaves its output in the
        # object store for the Ray decode stage, so the latents never come to this process.
        complete = omni.engine.admit(params[0]).params
        encode, denoise, decode = (stage.replicas[0] for stage in omni.engine.stages)
        encoded = encode.submit("probe-0", "probe", complete).result(60)
        denoised = denoise.submit("probe-1", "probe", complete, encoded.payload).result(60)
        assert isinstance(encoded.payload, Conditioning)
        assert isinstance(denoised.payload, ray.ObjectRef)
        (decoded,) = decode.submit("probe-2", "probe", complete, denoised.payload).result(60).images
        assert decoded.size == (32, 32)
        nodes = {omni.engine.stages[i].replicas[0].info.node_id for i in (1, 2)}
        assert len(nodes) == 2  # one CPU per node: the two actors are on different nodes
    for one, three in zip(want, got, strict=True):
        assert np.abs(_pixels(one) - _pixels(three)).max() <= 2
        assert [s["stage_type"] for s in three.metrics["stages"]] == ["encode", "denoise", "decode"]
