"""Weight updates and LoRA adapters given as tensors on Ray replicas (the run's 2-node cluster, ``ray_cluster``): one
copy in the object store for every replica, and a replica that Ray restarts catches up before it serves again."""

import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.features.weights import named_tensors
from vllm_omni.testing.checks.stock import stock_pipeline
from vllm_omni.testing.models.lora import write_lora_with_config
from vllm_omni.testing.processes.server import preloaded_context
from vllm_omni.testing.processes.trainer import broadcast_from_file, trainer_specs

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PARAMS = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=3, output_type="np")


@pytest.fixture(scope="module")
def omni(ray_cluster, tiny_flux):
    """Two replicas of max_num_seqs 1, one per node; LoRA on."""
    with Omni(
        tiny_flux,
        num_replicas=2,
        max_num_seqs=1,
        placement_strategy="STRICT_SPREAD",
        ray_address=ray_cluster.address,
        enable_lora=True,
    ) as omni:
        yield omni


@pytest.fixture(scope="module")
def new_weights(tiny_flux) -> dict[str, torch.Tensor]:
    """The tiny Flux transformer's weights with noise added (a fifth of each tensor's spread)."""
    generator = torch.Generator().manual_seed(0)
    state = named_tensors(stock_pipeline(tiny_flux).transformer)
    with torch.no_grad():
        return {
            k: v + 0.2 * (v.float().std() if v.numel() > 1 else 1.0) * torch.randn(v.shape, generator=generator)
            for k, v in state.items()
        }


def _pixels(output) -> np.ndarray:
    return np.asarray(output.images[0], dtype=np.float32)


def _until(predicate, what: str, timeout_s: float = 600.0):
    """Poll ``predicate`` until it holds (a state change, never a fixed sleep); the deadline is only a backstop."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"not reached in {timeout_s} s: {what}"
        time.sleep(0.05)
    return value


def _version(omni) -> int:
    """The weights version both replicas have reached (the updates of the tests before, in whatever order they ran);
    each test counts its own from there."""
    versions = {replica._catch_up._version for replica in omni.engine.stages[0].replicas}
    assert len(versions) == 1, f"the replicas disagree: {versions}"
    return versions.pop()


def _on_both_replicas(omni, params: list[OmniDiffusionSamplingParams], tag: str) -> list:
    """Run ``params`` as placed while no replica finishes a batch (`hold_batches` in each actor), so that routing
    alternates them between the two replicas; their outputs in order."""

    def hold(actor):  # in the replica's process
        from vllm_omni.testing.checks.faults import hold_batches

        actor.release_batches = hold_batches(actor.replica.engine.scheduler)

    replicas = omni.engine.stages[0].replicas
    ray.get([replica._actor.__ray_call__.remote(hold) for replica in replicas])
    try:
        futures = [omni.engine.add_request(f"{tag}-{i}", "a cat", p) for i, p in enumerate(params)]
    finally:
        ray.get([replica._actor.__ray_call__.remote(lambda actor: actor.release_batches()) for replica in replicas])
    return [future.result(timeout=600) for future in futures]


def test_an_update_reaches_every_replica_from_one_object_in_the_store(omni, tiny_flux, new_weights, monkeypatch):
    puts = []
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(value) or put(value, **kw))
    before = _version(omni)
    omni.update_weights(new_weights)
    monkeypatch.undo()
    assert len(puts) == 1 and set(puts[0]) == set(new_weights)  # one copy for both replicas
    outputs = _on_both_replicas(omni, [PARAMS, PARAMS], "update")
    assert sorted(o.metrics.replica for o in outputs) == [0, 1]
    assert [o.metrics.weights_version for o in outputs] == [before + 1] * 2
    pipeline = stock_pipeline(tiny_flux)
    kept = {k: v.clone() for k, v in pipeline.transformer.state_dict().items()}
    pipeline.transformer.load_state_dict(new_weights)
    try:
        call = dict(height=32, width=32, num_inference_steps=2, output_type="np")
        stock = pipeline("a cat", generator=torch.Generator("cpu").manual_seed(3), **call).images[0]
    finally:
        pipeline.transformer.load_state_dict(kept)  # the cached stock pipeline, as other tests expect it
    for output in outputs:
        assert np.abs(_pixels(output) - stock).max() <= 1e-4


def test_a_restarted_replica_catches_up_on_the_updates_and_adapters_before_it_serves(
    omni, tiny_flux, new_weights, tmp_path
):
    """Replica 1 is killed; an update sent while it is down reaches it when it is back, after the earlier ones
    (the last complete update, then the partial ones) and the adapter given as tensors."""
    stage = omni.engine.stages[0]
    survivor, victim = stage.replicas
    _, tensors, config = write_lora_with_config(tiny_flux, str(tmp_path / "adapter"), seed=5)
    omni.add_lora("mem", tensors, config)
    before = _version(omni)
    omni.update_weights(new_weights)  # complete: what the replica kept of earlier updates is no longer needed
    partial = {"x_embedder.weight": new_weights["x_embedder.weight"] * 1.5}
    omni.update_weights(partial)
    kept = victim._catch_up  # this complete update, then the partial one; nothing over torch.distributed since
    _until(lambda: len(kept._updates) == 2 and not kept._received, "the earlier updates dropped once applied")
    old_pid = victim.info.pid
    os.kill(old_pid, signal.SIGKILL)
    _until(lambda: not victim.is_alive, "replica 1 marked down")
    omni.update_weights({"proj_out.bias": new_weights["proj_out.bias"] * 2})  # it is down (or already back)
    _until(lambda: victim.is_alive and victim.info.pid != old_pid, "replica 1 back in a new process")

    with_adapter = OmniDiffusionSamplingParams(**PARAMS.model_dump(exclude={"lora"}), lora={"name": "mem"})
    outputs = _on_both_replicas(omni, [PARAMS, PARAMS, with_adapter, with_adapter], "catch-up")
    assert sorted(o.metrics.replica for o in outputs) == [0, 0, 1, 1]
    assert [o.metrics.weights_version for o in outputs] == [before + 3] * 4
    plain, lora = [o for o in outputs[:2]], [o for o in outputs[2:]]
    assert np.abs(_pixels(plain[0]) - _pixels(plain[1])).max() <= 1e-4
    assert np.abs(_pixels(lora[0]) - _pixels(lora[1])).max() <= 1e-4
    assert np.abs(_pixels(lora[0]) - _pixels(plain[0])).max() > 10 / 255
    omni.remove_lora("mem")
    assert victim._catch_up._loras == {} and survivor._catch_up._loras == {}


def test_replica_actors_join_a_trainers_group_and_receive_its_broadcasts(omni, new_weights, tmp_path):
    """A component updated over torch.distributed is not kept for a restart."""
    before = _version(omni)
    path = str(tmp_path / "update.safetensors")
    save_file({"proj_out.bias": new_weights["proj_out.bias"] * -1}, path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A process of its own, forked from the tests' preloaded forkserver (no interpreter of its own importing torch).
    trainer = preloaded_context().Process(target=broadcast_from_file, args=("127.0.0.1", port, 3, path), daemon=True)
    trainer.start()
    assert omni.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=3) == 2
    omni.update_weights_from_distributed(trainer_specs(path))
    trainer.join(600)
    assert trainer.exitcode == 0
    outputs = _on_both_replicas(omni, [PARAMS, PARAMS], "distributed")
    assert sorted(o.metrics.replica for o in outputs) == [0, 1]
    assert [o.metrics.weights_version for o in outputs] == [before + 1] * 2
    assert np.abs(_pixels(outputs[0]) - _pixels(outputs[1])).max() <= 1e-4
    assert all(replica._catch_up._received == {"transformer"} for replica in omni.engine.stages[0].replicas)
