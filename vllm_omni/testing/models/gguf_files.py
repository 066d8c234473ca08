"""A tiny pipeline's denoiser as a GGUF file, as city96's Flux, SD3 and Wan GGUFs are: the original checkpoint's
keys (no ``model.diffusion_model.`` prefix), quantized by the ``gguf`` package's own quantizers.

:func:`write_gguf` takes the denoiser in its original layout from :mod:`vllm_omni.testing.models.single_file` (the
inverse
of diffusers' converters) and writes each tensor as city96's ``convert.py`` followed by ``llama-quantize`` would:

- a weight of 2 to 4 dimensions (``*.weight``): the requested type (``Q8_0``, ``Q4_0``), or ``F16`` where its rows
  are not a whole number of the type's 32-value blocks (the converter's "falling back to F16");
- everything else (biases, norms, Wan's ``modulation`` and SD3's ``pos_embed`` parameters, and Wan's 5-dimensional
  patch embedding): ``F32``.

Unlike city96's files, small matrices (1024 values or fewer) are quantized too, so that the tiny models run the
quantized path; their widths (16 to 64) leave many rows that fit no block, which stay ``F16``. Load a file with::

    FluxTransformer2DModel.from_single_file(path, config=folder, subfolder="transformer", torch_dtype=dtype,
                                            quantization_config=GGUFQuantizationConfig(compute_dtype=dtype))

(``flux_converter_for_any_width`` around it for the tiny Flux, as for its ``.safetensors``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_omni.testing.models.single_file import SINGLE_FILE_FAMILIES, flux_converter_for_any_width

GGUF_TYPES = ("Q8_0", "Q4_0")
"""The quantization types ``make-tiny-model --gguf`` writes."""

GGUF_ARCHITECTURES = {"flux": "flux", "flux-schnell": "flux", "sd3": "sd3", "wan": "wan"}
"""Family -> ``general.architecture`` of its GGUF (city96's names)."""


def tensor_type(name: str, tensor: torch.Tensor, qtype: str):
    """The ``GGMLQuantizationType`` this module writes ``name`` in (before any fallback to F16)."""
    from gguf import GGMLQuantizationType

    if name.endswith(".weight") and 2 <= tensor.ndim <= 4:
        return GGMLQuantizationType[qtype]
    return GGMLQuantizationType.F32


def write_gguf(folder: str, family: str, out: str, qtype: str = "Q8_0") -> str:
    """Write the denoiser of ``folder`` (a tiny ``family`` pipeline) to ``out`` as a ``qtype`` GGUF; return ``out``."""
    import gguf

    if family not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"no GGUF layout for family {family!r}: a GGUF holds a denoiser alone; choose one of: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {qtype!r}: choose one of {', '.join(GGUF_TYPES)}")
    writer = gguf.GGUFWriter(path=None, arch=GGUF_ARCHITECTURES[family])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}"))
    for name, tensor in SINGLE_FILE_FAMILIES[family](os.fspath(folder)).items():
        data = tensor.detach().to(torch.float32).contiguous().numpy()
        kind = tensor_type(name, tensor, qtype)
        try:
            packed = gguf.quants.quantize(data, kind)
        except gguf.QuantError:  # rows that are not a whole number of blocks
            kind = gguf.GGMLQuantizationType.F16
            packed = gguf.quants.quantize(data, kind)
        writer.add_tensor(name, packed, raw_dtype=kind)
    writer.write_header_to_file(path=Path(out))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.fspath(out)


def dequantized(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF file ``path`` as float32, dequantized by the ``gguf`` package itself, by name."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {}
    for tensor in GGUFReader(os.fspath(path)).tensors:
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        tensors[tensor.name] = torch.from_numpy(values.reshape(tuple(reversed(tensor.shape.tolist()))))
    return tensors


def gguf_types(path: str) -> dict[str, str]:
    """Each tensor's type in the GGUF file ``path`` (``Q8_0``, ``F16``, ``F32`` ...), by name."""
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(os.fspath(path)).tensors}


def stock_gguf_pipeline(folder: str, path: str, dtype: torch.dtype = torch.float32):
    """diffusers' own way to run a GGUF denoiser: the pipeline of ``folder`` with its transformer from the GGUF
    ``path`` (``from_single_file`` with ``GGUFQuantizationConfig(compute_dtype=dtype)``), on the CPU, progress bar
    off. The reference that a served GGUF's images must equal."""
    import diffusers

    from vllm_omni.diffusion.pipeline.runner import read_model_index

    index = read_model_index(folder)
    config = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    with flux_converter_for_any_width():
        transformer = getattr(diffusers, index["transformer"][1]).from_single_file(
            path,
            config=folder,
            subfolder="transformer",
            torch_dtype=dtype,
            quantization_config=config,
            local_files_only=True,
        )
    pipeline = getattr(diffusers, index["_class_name"]).from_pretrained(
        folder, transformer=transformer, dtype=dtype, local_files_only=True
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline
