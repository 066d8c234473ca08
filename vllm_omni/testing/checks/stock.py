"""The stock diffusers pipelines that the tests and checks compare against, loaded once per folder.

A stock call leaves its pipeline as it found it (each call sets its scheduler's timesteps anew), so one loaded
pipeline serves every reference image of a run; a caller that changes a pipeline (adapters, hooks, VAE tiling)
loads its own.
"""

from __future__ import annotations

import functools


@functools.cache
def stock_pipeline(model: str):
    """``DiffusionPipeline.from_pretrained(model)`` from local files, progress bar off; the same object each time."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def stock_quantized_pipeline(model: str, mode: str, components: tuple[str, ...] = ("transformer",)):
    """A fresh stock pipeline with ``components`` quantized as diffusers' documentation writes it: ``int8`` a
    ``PipelineQuantizationConfig`` of torchao's ``Int8WeightOnlyConfig`` (diffusers' or transformers' ``TorchAoConfig``
    per component), ``fp8_storage`` ``enable_layerwise_casting`` to float8 with float32 compute (diffusers models
    only), ``none`` as it is; float32 on the CPU, progress bar off."""
    import diffusers
    import torch
    import transformers
    from diffusers import DiffusionPipeline

    config = None
    if mode == "int8":
        from torchao.quantization import Int8WeightOnlyConfig

        index = DiffusionPipeline.load_config(model)
        libraries = {name: diffusers if index[name][0] == "diffusers" else transformers for name in components}
        mapping = {name: lib.TorchAoConfig(Int8WeightOnlyConfig()) for name, lib in libraries.items()}
        config = diffusers.PipelineQuantizationConfig(quant_mapping=mapping)
    elif mode not in ("none", "fp8_storage"):
        raise ValueError(f"no stock reference for {mode!r} on the CPU")
    pipeline = DiffusionPipeline.from_pretrained(
        model, dtype=torch.float32, local_files_only=True, quantization_config=config
    )
    pipeline.set_progress_bar_config(disable=True)
    if mode == "fp8_storage":
        for name in components:
            getattr(pipeline, name).enable_layerwise_casting(
                storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32
            )
    return pipeline
