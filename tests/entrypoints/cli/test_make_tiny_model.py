"""``vllm-omni make-tiny-model``: the real console script once (its refusal of an unknown family), its ``main``
in the test's interpreter for the rest."""

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def test_make_tiny_model_writes_a_loadable_diffusers_folder(tmp_path, capsys):
    from vllm_omni.entrypoints.cli.main import main

    target = tmp_path / "tiny-sd"
    main(["make-tiny-model", str(target), "--family", "sd"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(target)
    assert json.loads((target / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"


def test_unknown_family_is_refused_with_the_choices(tmp_path):
    done = subprocess.run(
        ["vllm-omni", "make-tiny-model", str(tmp_path / "x"), "--family", "dalle"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "--family" in done.stderr and all(f"'{f}'" in done.stderr for f in ("flux", "flux-bench", "sd", "wan"))


def test_full_size_configs_only_writes_the_published_configs_without_weights(tmp_path, capsys):
    from vllm_omni.entrypoints.cli.main import main

    target = tmp_path / "qwen-image"
    main(["make-tiny-model", str(target), "--family", "qwen-image", "--full-size", "--configs-only"])
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(target)
    assert json.loads((target / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    assert json.loads((target / "transformer" / "config.json").read_text())["num_layers"] == 60
    assert json.loads((target / "text_encoder" / "config.json").read_text())["text_config"]["hidden_size"] == 3584
    assert not list(target.rglob("*.safetensors")) and (target / "tokenizer" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--family", "sd", "--full-size"], "argument --full-size: family 'sd' has none here (families with one: flux"),
        (["--configs-only"], "argument --configs-only: needs --full-size"),
        (["--full-size", "--lora", "2"], "argument --full-size: --lora write the tiny model's extra files"),
    ],
)
def test_full_size_is_refused_where_it_cannot_be_written(tmp_path, capsys, argv, message):
    from vllm_omni.entrypoints.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["make-tiny-model", str(tmp_path / "x"), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
