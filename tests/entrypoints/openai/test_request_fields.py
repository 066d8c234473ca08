"""A request field is one declaration in its request model (protocol.py): a `Sampling` in its metadata says that the
route copies it into the sampling parameters (under which name, or into ``extra_args``); admission, the error's
``param`` and the chat adapter's upstream names follow from it, and the OpenAPI schema carries its docstring."""

import json

import pytest

from vllm_omni.entrypoints.openai.protocol import (
    AudioGenerationRequest,
    ImageEditJSONBody,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoGenerationRequest,
)
from vllm_omni.entrypoints.openai.request_fields import api_names, sampled, sampling_fields
from vllm_omni.sampling_params import MAX_INPUT_IMAGES, OmniDiffusionSamplingParams

REQUESTS = (ImageGenerationRequest, ImageEditRequest, VideoGenerationRequest, AudioGenerationRequest)


@pytest.mark.parametrize("model", REQUESTS)
def test_a_sampling_field_fills_a_sampling_parameter_and_an_extension_a_pipeline_keyword(model):
    for name, marker in sampled(model).items():
        target = marker.name or name
        assert (target in OmniDiffusionSamplingParams.model_fields) != marker.extra_args, (model.__name__, name)


def test_an_images_body_gives_its_sampling_fields_under_their_sampling_names():
    body = ImageGenerationRequest(prompt="a cat", n=2, seed=7, true_cfg_scale=4.0, negative_prompt="blurry")
    assert sampling_fields(body) == {
        "num_outputs_per_prompt": 2,
        "partial_images": 0,
        "negative_prompt": "blurry",
        "guidance_scale": None,
        "seed": 7,
        "cache": True,
        "enhance_prompt": None,
        "priority": 0,
        "extra_args": {"true_cfg_scale": 4.0},  # flow_shift is unset: left to the pipeline
    }
    assert api_names(ImageGenerationRequest) == {"num_outputs_per_prompt": "n"}
    # The route computes these from other fields (size, quality, lora).
    assert not {"width", "height", "num_inference_steps", "lora"} & set(sampling_fields(body))


def test_an_edit_copies_its_strength_and_parses_a_forms_integers():
    body = ImageEditRequest.model_validate({"prompt": "a door", "n": "2", "seed": "3", "strength": "0.5"})
    fields = sampling_fields(body)
    assert (fields["num_outputs_per_prompt"], fields["seed"], fields["strength"]) == (2, 3, 0.5)
    with pytest.raises(ValueError, match="valid integer"):  # a JSON body gives JSON integers
        ImageGenerationRequest.model_validate({"prompt": "a door", "n": "2"})


def test_an_audio_body_gives_upstreams_clip_fields_as_the_sampling_parameters_of_the_same_names():
    body = AudioGenerationRequest(input="rain", audio_length=2.5, n=2, seed=4, speed=2.0, response_format="flac")
    assert sampling_fields(body) == {
        "audio_length": 2.5,
        "audio_start": 0.0,  # upstream's default
        "negative_prompt": None,
        "guidance_scale": None,
        "num_inference_steps": None,
        "seed": 4,
        "num_outputs_per_prompt": 2,
        "cache": True,
        "priority": 0,
        "extra_args": {},
    }
    assert body.prompt == "rain"  # what the shared checks and the engine read
    # Encoding choices: the route applies them to the waveforms, the pipeline never sees them.
    assert not {"response_format", "speed", "stream_format", "lora"} & set(sampling_fields(body))


def test_a_videos_body_copies_its_steps_and_its_wan_extensions():
    body = VideoGenerationRequest(prompt="a wave", num_inference_steps=3, fps=8, guidance_scale_2=2.0, seconds=1)
    fields = sampling_fields(body)
    assert (fields["num_inference_steps"], fields["fps"]) == (3, 8)
    assert fields["extra_args"] == {"guidance_scale_2": 2.0}
    assert not {"width", "height", "num_frames", "seconds", "lora"} & set(fields)
    assert api_names(VideoGenerationRequest) == {}


@pytest.mark.slow  # the app's routes import the stack
def test_the_openapi_schema_carries_the_docstrings_and_no_marker(tiny_flux):
    from fastapi.testclient import TestClient

    from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args
    from vllm_omni.entrypoints.openai.app import build_app

    parser = make_serve_parser("vllm serve")
    args, explicit = parse_serve_args(parser, [tiny_flux])
    client = TestClient(build_app(*build_serve_config(parser, args, explicit), on_fatal=print))  # no model load
    response = client.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    properties = schema["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert {name: p.get("description") for name, p in properties.items()} == {
        name: info.description for name, info in ImageGenerationRequest.model_fields.items()
    }
    bodies = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]
    assert set(bodies) == {"multipart/form-data", "application/json"}  # the form, and OpenAI's JSON by image_url
    form = bodies["multipart/form-data"]["schema"]
    assert form["properties"]["strength"]["description"] == ImageEditRequest.model_fields["strength"].description
    by_url = bodies["application/json"]["schema"]
    assert set(by_url["properties"]) == set(ImageEditJSONBody.model_fields) and by_url["required"] == [
        "prompt",
        "images",
    ]
    images, mask = by_url["properties"]["images"], by_url["properties"]["mask"]
    assert images["items"]["required"] == ["image_url"] and images["items"]["additionalProperties"] is False
    assert (images["minItems"], images["maxItems"]) == (1, MAX_INPUT_IMAGES)
    assert (
        mask["anyOf"][0] == images["items"]
        and mask["description"] == ImageEditJSONBody.model_fields["mask"].description
    )
    assert "$defs" not in json.dumps(schema)  # each reference resolves in the document
    assert "Sampling" not in json.dumps(schema)
