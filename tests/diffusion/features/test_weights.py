"""A weight update of one module (diffusion/features/weights.py): checked whole before anything is copied, cast, dropped
(meta) tensors materialised in place, PEFT-wrapped layers by their diffusers names; and `WeightUpdateGroup`, whose
members need no default process group."""

import socket
import threading

import pytest
import torch

from vllm_omni.diffusion.features.weights import (
    WeightUpdateGroup,
    apply_weights,
    as_weights,
    named_tensors,
    parse_dtype,
)
from vllm_omni.diffusion.lora.tensors import LoraTensors
from vllm_omni.errors import WeightUpdateError


class _Tiny(torch.nn.Module):
    """Two linear layers with tied weights, and a norm with persistent buffers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(4, 4, bias=False)
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.BatchNorm1d(4)


@pytest.fixture
def module():
    torch.manual_seed(0)
    return _Tiny()


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_weights_are_cast_to_each_parameters_dtype_and_say_whether_they_replaced_everything(module):
    update = {"embed.weight": torch.ones(4, 4, dtype=torch.float64), "norm.running_mean": torch.full((4,), 2.0)}
    assert apply_weights(module, update, "transformer", "cpu") is False
    assert module.embed.weight.dtype == torch.float32 and module.head.weight is module.embed.weight
    assert torch.equal(module.head.weight, torch.ones(4, 4)) and torch.equal(
        module.norm.running_mean, torch.full((4,), 2.0)
    )
    assert apply_weights(module, {k: v + 1 for k, v in module.state_dict().items()}, "transformer", "cpu") is True


@pytest.mark.parametrize(
    "update, param, message",
    [
        (
            {"embed.wieght": torch.ones(4, 4)},
            "embed.wieght",
            "transformer has no parameter 'embed.wieght'; did you mean 'embed.weight'?",
        ),
        ({"nothing.like.it": torch.ones(1)}, "nothing.like.it", "transformer has no parameter 'nothing.like.it'$"),
        ({"norm.bias": torch.ones(5)}, "norm.bias", r"transformer.norm.bias has shape \[4\]; the update gives \[5\]"),
    ],
)
def test_a_bad_tensor_is_refused_naming_it_and_none_of_the_update_is_applied(module, update, param, message):
    before = _snapshot(module)
    with pytest.raises(WeightUpdateError, match=message) as info:
        apply_weights(module, {"embed.weight": torch.zeros(4, 4)} | update, "transformer", "cpu")
    assert info.value.param == param
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())


def test_dropped_meta_tensors_are_materialised_in_place_and_checked_against_their_shape(module):
    weight, mean = module.embed.weight, module.norm.running_mean
    torch.utils.swap_tensors(weight, torch.nn.Parameter(torch.empty(4, 4, device="meta")))  # as sleep(level=2) does
    torch.utils.swap_tensors(mean, torch.empty(4, device="meta"))
    with pytest.raises(WeightUpdateError, match=r"has shape \[4, 4\]; the update gives \[4\]"):
        apply_weights(module, {"embed.weight": torch.ones(4)}, "transformer", "cpu")
    apply_weights(module, {"embed.weight": torch.full((4, 4), 3.0), "norm.running_mean": torch.ones(4)}, "t", "cpu")
    assert module.embed.weight is weight and module.head.weight is weight  # the same object, still tied
    assert not weight.is_meta and isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    assert torch.equal(weight, torch.full((4, 4), 3.0)) and torch.equal(module.norm.running_mean, torch.ones(4))


@pytest.mark.slow  # imports peft: seconds
def test_a_layer_wrapped_for_a_lora_adapter_keeps_its_name_and_the_adapter_is_no_weight():
    from peft import LoraConfig, inject_adapter_in_model

    model = torch.nn.Sequential()
    model.add_module("to_q", torch.nn.Linear(4, 4))
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), model, adapter_name="a")
    assert "to_q.base_layer.weight" in model.state_dict()
    assert set(named_tensors(model)) == {"to_q.weight", "to_q.bias"}
    assert apply_weights(model, {"to_q.weight": torch.ones(4, 4), "to_q.bias": torch.ones(4)}, "t", "cpu") is True
    assert torch.equal(model.to_q.base_layer.weight, torch.ones(4, 4))


def test_weights_are_a_mapping_or_pairs_once_each():
    tensor = torch.ones(1)
    assert as_weights(iter([("a", tensor)])) == {"a": tensor}
    for weights, message in [
        ([("a", tensor), ("a", tensor)], "weight 'a' is given twice"),
        ({"a": [1.0]}, "weight 'a' is a list, not a torch.Tensor"),
        ({}, "the update holds no weights"),
        ("a", "weights are a mapping or"),
        ([("a",)], r"weights are \(name, tensor\) pairs"),
    ]:
        with pytest.raises(WeightUpdateError, match=message):
            as_weights(weights)
    assert parse_dtype("torch.bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(WeightUpdateError, match="'nope' is not a torch dtype"):
        parse_dtype("nope")


def test_members_of_several_groups_share_one_process_without_a_default_group():
    """A trainer (rank 0) and two replicas in one process, as several inline replicas and a trainer may be."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    received: dict[int, dict] = {}
    specs = [("a", "float32", [2, 3]), ("b", torch.int64, (4,))]

    def replica(rank: int) -> None:
        received[rank] = WeightUpdateGroup("127.0.0.1", port, rank, 3, timeout_s=60).receive(specs, src=0)

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    trainer = WeightUpdateGroup("127.0.0.1", port, 0, 3, timeout_s=60)
    sent = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(4)}
    for tensor in sent.values():
        trainer.broadcast(tensor)
    for thread in threads:
        thread.join(60)
    assert all(torch.equal(received[rank][name], sent[name]) for rank in (1, 2) for name in sent)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="rank 3 is outside the group of world_size 3"):
        WeightUpdateGroup("127.0.0.1", port, 3, 3)


@pytest.mark.slow  # imports peft: seconds
def test_lora_tensors_are_checked_and_keyed_by_component_with_their_config_as_metadata():
    from types import SimpleNamespace

    from peft import LoraConfig

    tensors = {"blocks.0.to_q.lora_A.weight": torch.ones(2, 4), "blocks.0.to_q.lora_B.weight": torch.ones(4, 2)}
    given = LoraTensors.of(tensors, {"r": 2, "lora_alpha": 8, "target_modules": ["to_q"]})
    pipeline = SimpleNamespace(components={"transformer": None, "vae": None}, transformer=object())
    state, metadata = given.state_dict(pipeline)
    assert set(state) == {f"transformer.{k}" for k in tensors}
    assert metadata["transformer.lora_alpha"] == 8 and metadata["transformer.r"] == 2
    assert given.copy().tensors["blocks.0.to_q.lora_A.weight"] is not tensors["blocks.0.to_q.lora_A.weight"]
    assert LoraTensors.source("x").startswith("tensors://x/") and LoraTensors.source("x") != LoraTensors.source("x")
    for args, message in [
        (({}, LoraConfig()), "needs a non-empty mapping"),
        (({"a": 1}, LoraConfig()), "LoRA tensor 'a' is a int"),
        ((tensors, None), "needs its peft_config"),
        ((tensors, 3), "peft_config is a int"),
    ]:
        with pytest.raises(ValueError, match=message):
            LoraTensors.of(*args)
