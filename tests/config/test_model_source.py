"""`ModelSource` on its own (nothing is read or downloaded): what MODEL is, files in a repo (``org/name:FILE``,
``org/name:QUANT_TYPE``), GGUF files, and the errors that name the model and the flag."""

import pytest

from vllm_omni.config.model_source import ModelSource, is_gguf_model, kind_of, split_hub_file


@pytest.fixture
def files(tmp_path):
    for name in ("flux.gguf", "flux.safetensors", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("org/flux", "repo"),
        ("org/flux-gguf:flux1-dev-Q4_0.gguf", "hub_file"),
        ("org/flux-gguf:sub/dir/flux1-dev-Q4_0.gguf", "hub_file"),
        ("org/flux:flux1-dev.safetensors", "hub_file"),
        ("org/flux-gguf:Q4_0", "hub_file"),
        ("org/flux-gguf:q4_k_m", "hub_file"),
        ("org/flux-gguf:IQ2_XS", "hub_file"),
        ("org/flux-gguf:BF16", "hub_file"),
    ],
)
def test_what_a_name_that_is_no_local_path_is(name, kind):
    assert kind_of(name, "model") == kind


def test_local_files_and_folders(files, tiny_flux):
    assert kind_of(tiny_flux, "model") == "folder"
    assert kind_of(str(files / "flux.gguf"), "model") == "single_file"
    assert kind_of(str(files / "flux.safetensors"), "model") == "single_file"
    with pytest.raises(
        ValueError, match=r"is a file but not a single-file checkpoint: give a .safetensors or .ckpt or .gguf"
    ):
        kind_of(str(files / "notes.txt"), "model")


def test_a_file_in_a_repo_is_split_from_its_repo():
    assert split_hub_file("org/flux-gguf:flux1-dev-Q4_0.gguf") == ("org/flux-gguf", "flux1-dev-Q4_0.gguf")
    assert split_hub_file("org/flux-gguf:Q8_0") == ("org/flux-gguf", "Q8_0")
    for not_one in ("org/flux", "org/flux:", ":Q8_0", "org/flux:notes.txt", "/abs/path:Q8_0", "org/flux:latest"):
        assert split_hub_file(not_one) is None


def test_a_repo_file_that_is_no_checkpoint_is_refused_naming_both():
    with pytest.raises(ValueError) as info:
        kind_of("org/flux:README.md", "model")
    assert str(info.value).startswith(
        "model 'org/flux:README.md' names 'README.md' in the Hugging Face repo 'org/flux'"
    )
    assert "a GGUF quantization type (org/name:Q8_0)" in str(info.value)


def test_which_models_are_gguf_files(files):
    assert is_gguf_model(str(files / "flux.gguf"))
    assert is_gguf_model("org/flux-gguf:flux1-dev-Q4_0.gguf") and is_gguf_model("org/flux-gguf:Q4_0")
    assert not is_gguf_model(str(files / "flux.safetensors"))
    assert not is_gguf_model("org/flux:flux1-dev.safetensors") and not is_gguf_model("org/flux")


def test_a_gguf_needs_model_config_naming_the_flag(files, tiny_flux):
    for model in (str(files / "flux.gguf"), "org/flux-gguf:Q4_0"):
        with pytest.raises(ValueError) as info:
            ModelSource(model)
        assert str(info.value) == (
            f"model {model!r} is a GGUF file, which holds the denoiser alone: give --model-config (model_config) "
            "with the diffusers folder or repo id of its base model, which supplies the configs and the other "
            "components"
        )
    source = ModelSource(str(files / "flux.gguf"), model_config=tiny_flux)
    assert source.is_gguf and source.kind == "single_file"


def test_a_file_in_a_repo_takes_the_hub_flags(tiny_flux):
    source = ModelSource("org/flux-gguf:Q4_0", model_config=tiny_flux, revision="v1", download_dir="/tmp/hub")
    assert (source.kind, source.is_gguf, source.model_config_kind) == ("hub_file", True, "folder")
    assert ModelSource("org/flux:flux1-dev.safetensors").kind == "hub_file"  # configs inferred, as for a local file


def test_model_config_is_a_base_not_another_file(files, tiny_flux):
    with pytest.raises(ValueError, match=r"model_config \(--model-config\) 'org/x:Q8_0' is a checkpoint file"):
        ModelSource(str(files / "flux.gguf"), model_config="org/x:Q8_0")
    with pytest.raises(ValueError, match=r"model_config \(--model-config\) is for a single-file checkpoint"):
        ModelSource("org/flux", model_config=tiny_flux)
