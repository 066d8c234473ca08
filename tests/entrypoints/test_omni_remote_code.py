"""A model folder that loads with its own code: ``model_index.json`` names its pipeline class as ``[module, class]``,
defined in ``module.py`` beside it, and a component's as ``[file, class]`` of a file in its subfolder, which diffusers
imports only with ``trust_remote_code``. Refused before anything loads, naming the code and the flag, without the
knob; loaded and served, in Python and over HTTP, with it."""

import base64
import io
import sys
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image

from vllm_omni import Omni, OmniDiffusionSamplingParams
from vllm_omni.testing.models.custom_code import CUSTOM_DEFAULT_SIZE, make_custom_code_flux
from vllm_omni.testing.processes.server import in_process_server

pytestmark = pytest.mark.slow


@pytest.fixture
def custom_flux(tiny_flux, tmp_path, monkeypatch) -> Iterator[str]:
    """The tiny Flux whose pipeline and transformer classes are its own (`make_custom_code_flux`)."""
    import diffusers.utils.dynamic_modules_utils as dynamic_modules

    folder = make_custom_code_flux(tiny_flux, tmp_path / "custom-flux")
    # diffusers copies the code into its modules cache (HF_MODULES_CACHE, read when diffusers is imported), puts that
    # on sys.path and imports it as diffusers_modules.local.pipeline: all of it this test's, none left behind.
    monkeypatch.setattr(dynamic_modules, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    imported = set(sys.modules)
    yield folder
    for name in set(sys.modules) - imported:
        if name.startswith("diffusers_modules"):
            del sys.modules[name]


def test_a_custom_pipeline_is_refused_without_trust_remote_code_naming_the_flag(custom_flux):
    with pytest.raises(ValueError) as refused:
        Omni(custom_flux)
    message = str(refused.value)
    assert message.startswith(f"stage 0: the model {custom_flux} loads with its own code")
    code = "the pipeline class CustomFluxPipeline in pipeline.py; the transformer class CustomFluxTransformer in "
    assert code + "transformer/custom_transformer.py." in message
    assert "--trust-remote-code (vllm serve), trust_remote_code=True (Omni)" in message
    assert message.endswith("trust_remote_code is False (default)")
    assert not any(name.startswith("diffusers_modules") for name in sys.modules)  # refused before any code ran


def test_a_custom_pipeline_loads_and_serves_with_trust_remote_code(custom_flux):
    with Omni(custom_flux, trust_remote_code=True) as omni:
        assert omni.model_card.pipeline_name == "CustomFluxPipeline"
        pipeline = omni.engine.stages[0].replicas[0].engine.runner.pipeline
        assert type(pipeline.transformer).__name__ == "CustomFluxTransformer"
        params = OmniDiffusionSamplingParams(num_inference_steps=1, seed=0)  # the size: the custom class's
        (output,) = omni.generate(["a red fox"], params)
    assert output.error is None and [image.size for image in output.images] == [CUSTOM_DEFAULT_SIZE]


def test_a_custom_pipeline_serves_over_http_with_trust_remote_code(custom_flux):
    body = {"prompt": "a red fox", "num_inference_steps": 1, "response_format": "b64_json"}  # the class's size
    with in_process_server(custom_flux, trust_remote_code=True) as (app, base):
        answer = httpx.post(f"{base}/v1/images/generations", json=body, timeout=600)
        served = app.state.server.omni.model_card.pipeline_name
    assert answer.status_code == 200, answer.text
    assert served == "CustomFluxPipeline"
    assert Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))).size == CUSTOM_DEFAULT_SIZE
