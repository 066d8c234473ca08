"""`Omni` by Hugging Face repo id (from the cache, offline) and from single-file checkpoints: the same images as
the diffusers folder they came from."""

import os

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.config.model_source import ModelSourceError
from vllm_omni.testing.models.single_file import flux_converter_for_any_width, write_single_file

pytestmark = pytest.mark.slow

PROMPTS = ["a red cube", "a blue sphere"]


def _images(omni: Omni) -> list[np.ndarray]:
    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=7)
    return [np.asarray(out.images[0], dtype=np.int16) for out in omni.generate(PROMPTS, params)]


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for a, b in zip(got, want, strict=True):
        assert np.abs(a - b).max() <= 2


@pytest.fixture(scope="module")
def flux_images(tiny_flux):
    with Omni(tiny_flux) as omni:
        return _images(omni)


@pytest.fixture(scope="module")
def sd_images(tiny_sd):
    with Omni(tiny_sd) as omni:
        return _images(omni)


@pytest.fixture
def vllm_cache(tmp_path, monkeypatch):
    """Where converted single files go (``$VLLM_CACHE_ROOT/omni/single-file``)."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    return tmp_path / "vllm" / "omni" / "single-file"


def test_a_repo_id_loads_its_snapshot_from_the_cache(hf_cache, flux_images):
    cache, repo, commit = hf_cache
    with Omni(repo, download_dir=cache, revision=commit) as omni:
        assert omni.model == os.path.join(cache, "models--tiny-org--flux", "snapshots", commit)
        assert omni.model_source.model == repo
        _assert_same(_images(omni), flux_images)


def test_a_single_file_sd_checkpoint_gives_the_folders_images_and_is_converted_once(
    tiny_sd, sd_images, tmp_path, vllm_cache, caplog
):
    checkpoint = write_single_file(tiny_sd, "sd", str(tmp_path / "sd.safetensors"))
    with Omni(checkpoint, model_config=tiny_sd) as omni:
        folder = omni.model
        assert os.path.dirname(folder) == str(vllm_cache)
        _assert_same(_images(omni), sd_images)
    converted = os.path.getmtime(os.path.join(folder, "model_index.json"))
    with caplog.at_level("INFO", logger="vllm_omni.model_sources.files"), Omni(checkpoint, model_config=tiny_sd):
        pass
    assert os.path.getmtime(os.path.join(folder, "model_index.json")) == converted
    assert f"using its diffusers folder {folder}" in caplog.text
    assert sorted(os.listdir(vllm_cache)) == [os.path.basename(folder)]  # nothing half-written left beside it


def test_a_flux_transformer_file_takes_the_other_components_from_the_base_repo(
    tiny_flux, hf_cache, flux_images, tmp_path, vllm_cache
):
    cache, repo, commit = hf_cache
    checkpoint = write_single_file(tiny_flux, "flux", str(tmp_path / "flux1-tiny.safetensors"))
    # diffusers' Flux converter assumes FLUX.1's width (3072); the tiny one is narrower (see testing.single_file).
    with flux_converter_for_any_width(), Omni(checkpoint, model_config=repo, download_dir=cache) as omni:
        snapshot = os.path.join(cache, "models--tiny-org--flux", "snapshots", commit)
        assert os.path.realpath(os.path.join(omni.model, "vae")) == os.path.realpath(os.path.join(snapshot, "vae"))
        assert not os.path.islink(os.path.join(omni.model, "transformer"))
        _assert_same(_images(omni), flux_images)


def test_a_checkpoint_whose_inferred_base_is_not_cached_asks_for_model_config(tiny_sd, tmp_path, vllm_cache):
    checkpoint = write_single_file(tiny_sd, "sd", str(tmp_path / "sd.safetensors"))
    with pytest.raises(ModelSourceError) as info:
        Omni(checkpoint)
    message = str(info.value)
    assert message.startswith(f"model {checkpoint!r}: diffusers takes this v1 checkpoint's configs from model ")
    assert "'stable-diffusion-v1-5/stable-diffusion-v1-5'" in message and "HF_HUB_OFFLINE=1" in message
    assert message.endswith("or give --model-config with the diffusers folder or repo id of its base model")


def test_a_checkpoint_that_does_not_fit_its_model_config_fails_and_leaves_nothing_behind(
    tiny_sd, tiny_flux, tmp_path, vllm_cache
):
    checkpoint = write_single_file(tiny_sd, "sd", str(tmp_path / "sd.safetensors"))
    with pytest.raises(ModelSourceError) as info:
        Omni(checkpoint, model_config=tiny_flux)
    assert str(info.value).startswith(f"model {checkpoint!r}: diffusers could not load it as FluxPipeline")
    assert str(info.value).endswith("check that --model-config names its base model")
    assert not os.path.exists(vllm_cache) or os.listdir(vllm_cache) == []
