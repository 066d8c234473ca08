"""``vllm serve ORG/NAME --omni``: a repo id served from the Hugging Face cache offline, downloaded from a (local)
hub before ``/health`` turns 200, and a start-up that fails naming the repo, the revision and the reason."""

import base64
import io
import os
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.processes.hub import LocalHub
from vllm_omni.testing.processes.server import RemoteOmniServer, vllm_executable

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

_VLLM_OMNI = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main"]


def _one_image(server: RemoteOmniServer, model: str) -> Image.Image:
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none")
    answer = client.images.generate(model=model, prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2})
    return Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))


def test_a_repo_id_is_served_offline_from_the_download_dir_under_its_id(hf_cache):
    cache, repo, commit = hf_cache
    with RemoteOmniServer(repo, ["--revision", commit, "--download-dir", cache], env={"HF_HUB_OFFLINE": "1"}) as server:
        models = httpx.get(server.url_for("v1", "models")).json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [(repo, repo)]
        assert _one_image(server, repo).size == (64, 64)


def test_a_repo_id_that_is_not_cached_is_downloaded_before_health_turns_200(tiny_flux, tmp_path):
    with LocalHub() as hub:
        hub.publish("tiny-org/flux", tiny_flux)
        env = {
            "HF_HUB_OFFLINE": "0",
            "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        }
        with RemoteOmniServer("tiny-org/flux", ["--revision", "main"], env=env) as server:
            fetched = {path for _, _, path in hub.downloads}
            assert {"model_index.json", "transformer/diffusion_pytorch_model.safetensors"} <= fetched
            assert _one_image(server, "tiny-org/flux").size == (64, 64)
        assert (tmp_path / "hub" / "models--tiny-org--flux" / "refs" / "main").read_text() == hub.downloads[0][1]


def test_a_repo_id_that_cannot_be_fetched_ends_start_up_naming_it(tmp_path):
    done = subprocess.run(
        [vllm_executable(), "serve", "tiny-org/missing", "--omni", "--port", "0", "--download-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 1
    assert (
        "model 'tiny-org/missing' at revision 'main': it is not in the Hugging Face cache "
        f"{tmp_path} and HF_HUB_OFFLINE=1 forbids downloading"
    ) in done.stdout + done.stderr


def test_make_tiny_model_writes_a_single_file_that_serves_the_folders_images(tmp_path, monkeypatch, capsys):
    """``make-tiny-model --single-file`` (its ``main``, in this process, as the GGUF test's; the refusal test below
    runs the script), then ``vllm serve DIR.safetensors --model-config DIR --omni``."""
    from vllm_omni.entrypoints.cli.main import main

    folder = tmp_path / "tiny-sd"
    main(["make-tiny-model", str(folder), "--family", "sd", "--single-file"])
    checkpoint = f"{folder}.safetensors"
    assert capsys.readouterr().out.split() == [str(folder), checkpoint]

    params = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=2, seed=5)
    with Omni(str(folder)) as omni:
        want = np.asarray(omni.generate("a cat", params)[0].images[0], dtype=np.int16)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))  # a preloaded server takes the environment
    with RemoteOmniServer(checkpoint, ["--model-config", str(folder)]) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none")
        answer = client.images.generate(prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2, "seed": 5})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), dtype=np.int16)
        assert httpx.get(server.url_for("v1", "models")).json()["data"][0]["id"] == checkpoint
    assert np.abs(got - want).max() <= 2
    assert len(os.listdir(tmp_path / "vllm" / "omni" / "single-file")) == 1


def test_make_tiny_model_refuses_single_file_for_a_family_without_a_layout(tmp_path):
    made = subprocess.run(
        [*_VLLM_OMNI, "make-tiny-model", str(tmp_path / "w"), "--family", "sdxl", "--single-file"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 2
    assert (
        "argument --single-file: family 'sdxl' has no single-file layout here "
        "(families with one: sd, flux, flux-schnell, sd3, wan)"
    ) in made.stderr


def test_make_tiny_model_writes_ggufs_that_vllm_serve_serves_with_model_config(tmp_path, monkeypatch, capsys):
    """``make-tiny-model --gguf Q8_0 --gguf Q4_0`` (its ``main``, in this process), then ``vllm serve DIR-Q4_0.gguf
    --model-config DIR --omni``: the image of stock diffusers with the transformer from ``from_single_file(GGUF,
    GGUFQuantizationConfig)``."""
    from vllm_omni.entrypoints.cli.main import main
    from vllm_omni.testing.models.gguf_files import stock_gguf_pipeline

    folder = tmp_path / "tiny-sd3"
    main(["make-tiny-model", str(folder), "--family", "sd3", "--gguf", "Q8_0", "--gguf", "Q4_0"])
    assert capsys.readouterr().out.split() == [str(folder), f"{folder}-Q8_0.gguf", f"{folder}-Q4_0.gguf"]
    gguf = f"{folder}-Q4_0.gguf"

    stock = stock_gguf_pipeline(str(folder), gguf)
    image = stock("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(5))
    want = np.asarray(image.images[0], dtype=np.int16)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))  # a preloaded server takes the environment
    with RemoteOmniServer(gguf, ["--model-config", str(folder)]) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none")
        answer = client.images.generate(prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2, "seed": 5})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), dtype=np.int16)
    assert np.abs(got - want).max() <= 2
    assert len(os.listdir(tmp_path / "vllm" / "omni" / "single-file")) == 1
