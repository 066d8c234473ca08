"""The full-size families (`vllm_omni.testing.models.full_size`): each component, built on the ``meta`` device, has the
parameter count its model publishes, to every digit published; and a folder of configs alone, served with
``load_format: dummy``, holds the classes, shapes and dtypes that loading the same folder with its weights gives,
at the reduced size (a CPU builds the full one in minutes)."""

import functools
import json

import numpy as np
import pytest
import torch

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.diffusion.pipeline.dummy_weights import dummy_components, pipeline_loader
from vllm_omni.errors import SleepModeError
from vllm_omni.testing.models.full_size import FULL_SIZE, make_full_size_model, meta_components, parameter_count

UNITS = {"B": 1e9, "M": 1e6}


@functools.cache
def _full(family: str) -> dict[str, torch.nn.Module]:
    return meta_components(family)


@pytest.mark.parametrize(
    ("family", "name"), [(family, name) for family, spec in FULL_SIZE.items() for name in spec.components]
)
def test_each_component_has_the_parameter_count_its_model_publishes(family, name):
    published = FULL_SIZE[family].components[name].published
    figure, unit = published.split()
    decimals = len(figure.partition(".")[2])
    count = parameter_count(_full(family)[name])
    assert round(count / UNITS[unit], decimals) == float(figure), f"{family} {name}: {count:,} against {published}"
    assert all(p.is_meta for p in _full(family)[name].parameters())  # shapes only: no memory


def test_flux_is_flux1_devs_shape():
    transformer, t5 = _full("flux")["transformer"], _full("flux")["text_encoder_2"]
    assert (len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)) == (19, 38)
    assert transformer.inner_dim == 3072 and transformer.config.guidance_embeds
    assert transformer.context_embedder.in_features == 4096 == t5.config.d_model
    assert (
        transformer.time_text_embed.text_embedder.linear_1.in_features
        == 768
        == _full("flux")["text_encoder"].config.hidden_size
    )
    assert (t5.config.d_ff, t5.config.num_layers, t5.config.num_heads, t5.config.vocab_size) == (10240, 24, 64, 32128)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # one table, as the published count has it
    assert _full("flux")["vae"].config.latent_channels == 16


def _layout(module: torch.nn.Module) -> dict[str, tuple]:
    """Every parameter (a tied one once) and buffer: its shape and dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FULL_SIZE))
def test_configs_alone_build_what_loading_the_weights_gives(family, tmp_path):
    whole = make_full_size_model(tmp_path / "whole", family, size="reduced", device="cpu")
    configs = make_full_size_model(tmp_path / "configs", family, configs_only=True, size="reduced")
    assert not list((tmp_path / "configs").rglob("*.safetensors"))
    assert sorted(p.name for p in (tmp_path / "configs" / "transformer").iterdir()) == ["config.json"]
    dtype = torch.bfloat16  # Wan keeps some modules in float32 in a half dtype: so do the random ones
    index = json.loads((tmp_path / "whole" / "model_index.json").read_text())
    loaded = pipeline_loader(index, False).from_pretrained(whole, dtype=dtype, local_files_only=True)
    built = dummy_components(configs, dtype, torch.device("cpu"))
    assert sorted(built) == sorted(FULL_SIZE[family].components)
    for name, module in built.items():
        real = getattr(loaded, name)
        assert type(module) is type(real) and not module.training
        assert _layout(module) == _layout(real), name
    again = dummy_components(configs, dtype, torch.device("cpu"))  # seeded: every replica and rank draws the same
    for name, module in built.items():
        assert all(torch.equal(a, b) for a, b in zip(module.parameters(), again[name].parameters(), strict=True))


@pytest.mark.slow
def test_a_folder_of_configs_serves_random_weights_through_omni(tmp_path):
    configs = make_full_size_model(tmp_path / "flux", "flux", configs_only=True, size="reduced")
    omni = Omni(configs, load_format="dummy")
    try:
        params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, output_type="np", seed=1)
        (output,) = omni.generate(["a photo of a cat"], params)
        image = np.asarray(output.images[0])
        assert image.shape == (64, 64, 3) and np.isfinite(image).all() and image.std() > 0
        transformer = omni.engine.stages[0].replicas[0].engine.runner.pipeline.transformer
        assert transformer.inner_dim == 32 and len(transformer.single_transformer_blocks) == 1  # the reduced size
        with pytest.raises(
            SleepModeError, match="load_format 'dummy' made random ones that no file holds: use level 1"
        ):
            omni.sleep(2)
    finally:
        omni.shutdown()
