"""GGUF denoisers: a ``.gguf`` file (city96's Flux, SD3, Wan, Qwen-Image GGUFs) holds one denoiser's weights,
quantized, in its original checkpoint's key layout.

GGUF-quantized weights cannot be saved as a diffusers folder, so the folder
`vllm_omni.model_sources.files.single_file_folder` makes for one holds the base model's other components (linked) and,
in the denoiser's subfolder, its ``config.json`` and a link to the ``.gguf`` itself. Every stage and replica that loads
the denoiser loads it from that file, with diffusers' ``from_single_file`` and
``GGUFQuantizationConfig(compute_dtype=<the stage's dtype>)``: the weights stay quantized (``GGUFParameter``, bytes) and
each layer dequantizes its own on every forward.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch

GGUF_SUFFIX = ".gguf"


class GgufError(ValueError):
    """A GGUF file that cannot be served; the message names the file."""


def check_gguf_file(path: str) -> None:
    """Open ``path``'s header and tensor index (nothing is read into memory): a file that is not a GGUF, is cut
    short, or holds a quantization type diffusers cannot dequantize fails here, naming the file."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES
    from gguf import GGMLQuantizationType, GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct errors ... on bad bytes
        raise GgufError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    if not reader.tensors:
        raise GgufError(f"{path} holds no tensors")
    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for tensor in reader.tensors:
        if tensor.tensor_type not in plain and tensor.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
            raise GgufError(
                f"{path}: tensor {tensor.name!r} is {tensor.tensor_type.name}, which diffusers cannot dequantize "
                f"(it reads {', '.join(t.name for t in (*plain, *SUPPORTED_GGUF_QUANT_TYPES))})"
            )


def link_gguf_denoiser(path: str, base_component: str, into: str) -> None:
    """Make ``into`` the folder of a GGUF denoiser: the base's ``config.json`` and a link to the file ``path``."""
    os.makedirs(into)
    shutil.copyfile(os.path.join(base_component, "config.json"), os.path.join(into, "config.json"))
    os.symlink(os.path.realpath(path), os.path.join(into, os.path.basename(path)))


def gguf_file(folder: str, name: str) -> str | None:
    """The ``.gguf`` the component ``name`` of the diffusers ``folder`` loads from; ``None``: it has none."""
    files = sorted(glob.glob(os.path.join(folder, name, f"*{GGUF_SUFFIX}")))
    if len(files) > 1:
        raise GgufError(f"{os.path.join(folder, name)} holds {len(files)} GGUF files; a component loads from one")
    return files[0] if files else None


def gguf_components(folder: str, components: dict) -> dict[str, str]:
    """The components of ``folder`` (its ``model_index.json`` as ``components``) held as a GGUF file → the file."""
    found = {}
    for name, entry in components.items():
        if isinstance(entry, list) and (path := gguf_file(folder, name)):
            found[name] = path
    return found


def load_gguf_component(folder: str, name: str, class_name: str, dtype: torch.dtype):
    """The component ``name`` of ``folder`` from its ``.gguf``: quantized weights, computing in ``dtype``."""
    import diffusers

    path = gguf_file(folder, name)
    assert path is not None, f"{name} of {folder} is no GGUF component"  # callers load the gguf_components only
    config = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    try:
        return getattr(diffusers, class_name).from_single_file(
            path, config=folder, subfolder=name, torch_dtype=dtype, quantization_config=config, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001 - diffusers raises anything from KeyError to RuntimeError here
        raise GgufError(
            f"{os.path.realpath(path)}: diffusers could not load it as {class_name} with the config of "
            f"{os.path.realpath(os.path.join(folder, name))} ({type(exc).__name__}: {exc}); check that "
            "--model-config names its base model"
        ) from exc


def is_gguf_module(module) -> bool:
    """Whether ``module`` was loaded with diffusers' ``GGUFQuantizationConfig`` (its weights are GGUF bytes)."""
    config = getattr(getattr(module, "hf_quantizer", None), "quantization_config", None)
    return getattr(config, "quant_method", None) == "gguf"  # diffusers' QuantizationMethod.GGUF, a str enum


def gguf_modules(pipeline) -> list[str]:
    """The names of ``pipeline``'s components whose weights are GGUF-quantized."""
    return [name for name, module in pipeline.components.items() if is_gguf_module(module)]
