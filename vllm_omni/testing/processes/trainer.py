"""A stand-in for a trainer in another process, for the tests of ``init_weight_update_group`` and
``update_weights_from_distributed``: it joins the group as one rank and broadcasts tensors from a file."""

from __future__ import annotations


def broadcast_from_file(master_address: str, master_port: int, world_size: int, path: str, rank: int = 0) -> None:
    """Join the weight group as ``rank`` (hosting its store at rank 0), then broadcast every tensor of the
    safetensors file ``path`` in the file's key order, as ``names_dtypes_shapes`` of `trainer_specs` lists them.
    Run it in its own process (``multiprocessing`` spawn): the engine's call waits for it."""
    from safetensors.torch import load_file

    from vllm_omni.diffusion.features.weights import WeightUpdateGroup

    group = WeightUpdateGroup(master_address, master_port, rank, world_size)
    for tensor in load_file(path).values():
        group.broadcast(tensor.contiguous(), src=rank)


def trainer_specs(path: str) -> list[tuple[str, str, list[int]]]:
    """``(name, dtype, shape)`` of each tensor of the safetensors file ``path``, in the order it is broadcast."""
    from safetensors.torch import load_file

    return [(name, str(tensor.dtype), list(tensor.shape)) for name, tensor in load_file(path).items()]
