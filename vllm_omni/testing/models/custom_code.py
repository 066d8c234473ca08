"""A tiny model folder that loads with its own code, as a Hub repo with a custom pipeline ships one:
``model_index.json`` names its pipeline class as ``["pipeline", "CustomFluxPipeline"]`` (``pipeline.py`` beside it)
and its transformer's as ``["custom_transformer", "CustomFluxTransformer"]`` (a file of the ``transformer``
subfolder). diffusers imports both only with ``trust_remote_code``."""

from __future__ import annotations

import json
import os
import shutil

CUSTOM_PIPELINE = '''
from diffusers import FluxPipeline


class CustomFluxPipeline(FluxPipeline):
    """The model's own pipeline class: Flux with a default size of its own (the components spelled out: diffusers
    reads them from this signature)."""

    def __init__(
        self, scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, transformer, image_encoder=None,
        feature_extractor=None,
    ):
        super().__init__(
            scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, transformer, image_encoder,
            feature_extractor,
        )
        self.default_sample_size = 16  # 32x32 images with the tiny VAE (FluxPipeline's 128: 256x256)
'''

CUSTOM_TRANSFORMER = '''
from diffusers import FluxTransformer2DModel


class CustomFluxTransformer(FluxTransformer2DModel):
    """The model's own denoiser class, in its subfolder."""
'''

CUSTOM_DEFAULT_SIZE = (32, 32)
"""The images' size when a request gives none: the custom pipeline class's own default, which shows that it ran."""


def make_custom_code_flux(tiny_flux: str | os.PathLike[str], folder: str | os.PathLike[str]) -> str:
    """``folder``: a copy of the tiny Flux folder ``tiny_flux`` whose pipeline and transformer classes are its own
    code (`CUSTOM_PIPELINE`, `CUSTOM_TRANSFORMER`); returns its path."""
    folder = os.fspath(folder)
    shutil.copytree(tiny_flux, folder)
    with open(os.path.join(folder, "pipeline.py"), "w") as file:
        file.write(CUSTOM_PIPELINE)
    with open(os.path.join(folder, "transformer", "custom_transformer.py"), "w") as file:
        file.write(CUSTOM_TRANSFORMER)
    with open(os.path.join(folder, "model_index.json")) as file:
        index = json.load(file)
    index["_class_name"] = ["pipeline", "CustomFluxPipeline"]
    index["transformer"] = ["custom_transformer", "CustomFluxTransformer"]
    with open(os.path.join(folder, "model_index.json"), "w") as file:
        json.dump(index, file)
    return folder
