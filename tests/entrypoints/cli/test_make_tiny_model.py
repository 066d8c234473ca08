"""The real ``vllm-omni`` console script."""

import json
import subprocess

import pytest

pytestmark = pytest.mark.slow


def test_make_tiny_model_writes_a_loadable_diffusers_folder(tmp_path):
    target = tmp_path / "tiny-sd"
    done = subprocess.run(
        ["vllm-omni", "make-tiny-model", str(target), "--family", "sd"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(target)
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
