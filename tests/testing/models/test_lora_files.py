"""``vllm-omni make-tiny-model --lora N``: the model folder, then N distinct random adapters next to it."""

import os

import pytest
import torch
from safetensors.torch import load_file

from vllm_omni.entrypoints.cli.main import main


def _weights(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "pytorch_lora_weights.safetensors"))


def test_make_tiny_model_writes_the_adapters_and_prints_their_paths(tmp_path, capsys):
    target = str(tmp_path / "tiny-sd")
    main(["make-tiny-model", target, "--family", "sd", "--lora", "2", "--lora-text-encoder"])

    printed = capsys.readouterr().out.split()
    loras = [os.path.join(target, "loras", f"lora-{i}") for i in range(2)]
    assert printed == [target, *loras]
    first, second = _weights(loras[0]), _weights(loras[1])
    assert first.keys() == second.keys()
    assert any(key.startswith("text_encoder.") for key in first) and any(key.startswith("unet.") for key in first)
    assert not any(torch.equal(first[key], second[key]) for key in first), "the adapters are not distinct"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--family", "wan", "--lora", "1", "--lora-text-encoder"], "--lora-text-encoder"),
        (["--family", "sd", "--lora-text-encoder"], "--lora-text-encoder"),
        (["--family", "sd", "--lora", "-1"], "--lora"),
    ],
)
def test_a_bad_lora_combination_is_refused_naming_the_flag(tmp_path, capsys, args, flag):
    with pytest.raises(SystemExit) as exited:
        main(["make-tiny-model", str(tmp_path / "x"), *args])
    assert exited.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists(), "the model was written before the arguments were checked"
