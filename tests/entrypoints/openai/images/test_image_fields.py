"""OpenAI's Images fields ``quality``, ``style``, ``background``, ``moderation`` and ``safety_identifier``, sent by
the real `openai` client to one real server, and the ``quality``, ``background`` and ``usage`` it answers with."""

import base64
import io
import json
import os
import re
from types import SimpleNamespace

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from vllm_omni.config.serving import ServingConfig
from vllm_omni.diffusion.families.model_card import ModelCard
from vllm_omni.entrypoints.cli.serve import build_serve_config, make_serve_parser, parse_serve_args
from vllm_omni.entrypoints.openai.images.image_usage import quality_steps
from vllm_omni.entrypoints.openai.protocol import ImageGenerationRequest
from vllm_omni.testing.checks.edits import noise_image
from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-fields"
MAX_STEPS = 20
"""Below the tiny Flux's default 28 steps: ``high`` (and ``auto``) is refused naming the steps it maps to."""


@pytest.fixture(scope="module")
def server(tiny_flux, tmp_path_factory):
    log = tmp_path_factory.mktemp("fields") / "server.log"
    args = [
        *("--api-key", API_KEY, "--max-inference-steps", str(MAX_STEPS), "--quality-steps", "low=3"),
        *("--max-image-pixels", str(64 * 64)),
    ]
    with RemoteOmniServer(tiny_flux, args, log_path=str(log)) as server:
        server.log = log
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)


def _generate(client, **kwargs) -> bytes:
    """One 32x32 image of a fixed prompt and seed, as its PNG bytes."""
    response = client.images.generate(prompt="a lighthouse", size="32x32", response_format="b64_json", **kwargs)
    return base64.b64decode(response.data[0].b64_json)


def _seeded(**fields) -> dict:
    return {"extra_body": {"seed": 3, **fields}}


def test_quality_levels_choose_the_steps(client):
    # --quality-steps low=3; medium and standard: half the model's default 28 steps.
    low, medium = _generate(client, quality="low", **_seeded()), _generate(client, quality="medium", **_seeded())
    assert low == _generate(client, **_seeded(num_inference_steps=3))
    assert medium == _generate(client, **_seeded(num_inference_steps=14))
    assert _generate(client, quality="standard", **_seeded()) == medium
    assert low != medium
    # The request's own num_inference_steps wins over its quality.
    assert _generate(client, quality="medium", **_seeded(num_inference_steps=3)) == low


@pytest.mark.parametrize("quality", ["high", "hd", "auto"])
def test_high_runs_the_model_default_steps_within_the_limits(client, quality):
    with pytest.raises(openai.BadRequestError) as info:
        _generate(client, quality=quality)
    error = info.value.body
    assert error["param"] == "num_inference_steps" and error["code"] == "invalid_value"
    assert f"num_inference_steps=28 is above the limit of {MAX_STEPS}" in error["message"]


def _text_tokens(tiny_flux: str, *texts: str) -> int:
    """The text tokens of ``texts`` by Flux's prompt tokenizer, T5 (``tokenizer_2``: the longer model_max_length)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_flux, subfolder="tokenizer_2")
    assert tokenizer.model_max_length > AutoTokenizer.from_pretrained(tiny_flux, subfolder="tokenizer").model_max_length
    return sum(len(tokenizer(text).input_ids) for text in texts)


def _latent_pixels(model: str) -> int:
    """Pixels per side of one Flux transformer position: the VAE's factor, times 2 for Flux's 2×2 packing."""
    with open(os.path.join(model, "vae", "config.json")) as f:
        return 2 ** (len(json.load(f)["block_out_channels"]) - 1) * 2


def test_openai_fields_are_accepted_and_echoed_with_usage(server, client, tiny_flux):
    prompt, negative = "a red lighthouse at dusk, oil painting", "blurry"
    response = client.images.generate(
        prompt=prompt,
        n=2,
        size="64x32",
        quality="low",
        style="natural",
        background="opaque",
        moderation="low",
        safety_identifier="user-7f3a",
        output_format="webp",
        response_format="b64_json",
        extra_body={"negative_prompt": negative, "true_cfg_scale": 2.0, "seed": 1},  # Flux: true CFG
    )
    assert (response.quality, response.background, response.output_format, response.size) == (
        "low",
        "opaque",
        "webp",
        "64x32",
    )
    text_tokens = _text_tokens(tiny_flux, prompt, negative)
    pixels = _latent_pixels(tiny_flux)
    output_tokens = 2 * (64 // pixels) * (32 // pixels)
    usage = response.usage
    assert (usage.input_tokens_details.text_tokens, usage.input_tokens_details.image_tokens) == (text_tokens, 0)
    assert (usage.input_tokens, usage.output_tokens) == (text_tokens, output_tokens)
    assert usage.total_tokens == text_tokens + output_tokens
    assert re.search(r"Image request img-[0-9a-f]+ completed for safety_identifier 'user-7f3a'", server.log.read_text())


def test_explicit_steps_leave_quality_out(client):
    response = client.images.generate(
        prompt="x", size="32x32", quality="low", response_format="b64_json", extra_body={"num_inference_steps": 2}
    )
    assert response.quality is None and response.background == "opaque" and response.usage.output_tokens > 0


def test_transparent_background_is_refused_naming_background(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", size="32x32", background="transparent", quality="low")
    error = info.value.body
    assert (error["param"], error["code"]) == ("background", "invalid_value")
    assert "FluxPipeline makes opaque RGB images" in error["message"]


@pytest.mark.parametrize(
    "fields,param,code",
    [
        ({"sharpness": "high"}, "sharpness", "unknown_parameter"),
        ({"quality": "xhigh"}, "quality", "invalid_value"),
        ({"style": "bold"}, "style", "invalid_value"),
        ({"moderation": "high"}, "moderation", "invalid_value"),
        ({"background": "clear"}, "background", "invalid_value"),
        ({"safety_identifier": "u" * 65}, "safety_identifier", "invalid_value"),
    ],
)
def test_unknown_fields_and_bad_values_are_refused(server, fields, param, code):
    response = httpx.post(
        server.url_for("v1", "images", "generations"),
        json={"prompt": "x", "size": "32x32", **fields},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_an_edit_form_takes_quality_and_counts_its_image(server, client, tiny_flux):
    buffer = io.BytesIO()
    noise_image(0, size=32).save(buffer, format="PNG")

    def edit(**kwargs):
        return client.images.edit(
            image=("in.png", buffer.getvalue(), "image/png"),
            prompt="a blue door",
            response_format="b64_json",
            user="user-edit",
            **kwargs,
        )

    response = edit(quality="low", background="auto", extra_body={"seed": 4})
    assert response.quality == "low" and response.size == "32x32"
    assert response.data[0].b64_json == edit(extra_body={"seed": 4, "num_inference_steps": 3}).data[0].b64_json
    positions = (32 // _latent_pixels(tiny_flux)) ** 2
    usage = response.usage
    assert (usage.input_tokens_details.image_tokens, usage.output_tokens) == (positions, positions)
    assert usage.input_tokens == _text_tokens(tiny_flux, "a blue door") + positions
    assert "completed for safety_identifier 'user-edit'" in server.log.read_text()  # user, in its absence


def test_the_default_mapping_rounds_down_to_at_least_one_step():
    def steps(default: int, quality: str, **quality_steps_flag) -> int:
        card = ModelCard(
            pipeline_name="P",
            call_args=frozenset({"num_inference_steps"}),
            call_defaults={"num_inference_steps": default},
            default_size=(64, 64),
            size_multiple=8,
            frame_multiple=1,
            outputs_arg=None,
        )
        serving = ServingConfig(served_model_names=["m"], quality_steps=quality_steps_flag)
        state = SimpleNamespace(serving=serving, loaded_omni=SimpleNamespace(model_card=card))
        return quality_steps(state, ImageGenerationRequest(prompt="x", quality=quality), "text")

    assert [steps(50, q) for q in ("low", "medium", "standard", "high", "hd", "auto")] == [12, 25, 25, 50, 50, 50]
    assert [steps(1, q) for q in ("low", "medium", "high")] == [1, 1, 1]
    assert [steps(50, q, high=30) for q in ("low", "high", "auto")] == [12, 30, 30]


@pytest.fixture(scope="module")
def parser():
    return make_serve_parser("vllm serve")


@pytest.mark.parametrize(
    "flag,expected",
    [
        ("low=4,medium=14,high=28", {"low": 4, "medium": 14, "high": 28}),
        (" high = 40 ", {"high": 40}),
        ('{"low": 2, "medium": 8}', {"low": 2, "medium": 8}),
    ],
)
def test_quality_steps_flag(parser, tiny_flux, flag, expected):
    args, explicit = parse_serve_args(parser, [tiny_flux, "--quality-steps", flag])
    assert build_serve_config(parser, args, explicit)[2].quality_steps == expected


@pytest.mark.parametrize(
    "flag,message",
    [
        ("ultra=3", r"--quality-steps 'ultra': Input should be 'low', 'medium' or 'high'"),
        ("low=0", r"--quality-steps low='0': Input should be greater than or equal to 1"),
        ("low=x", r"--quality-steps low='x': Input should be a valid integer"),
        ("high=500", r"--quality-steps .*steps above --max-inference-steps 200: high=500"),
        ("low", r"argument --quality-steps: give LEVEL=STEPS pairs such as low=4,medium=14,high=28"),
        ("{", r"argument --quality-steps: not valid JSON"),
    ],
)
def test_a_bad_quality_steps_flag_fails_naming_it(parser, tiny_flux, capsys, flag, message):
    with pytest.raises(SystemExit) as info:
        args, explicit = parse_serve_args(parser, [tiny_flux, "--quality-steps", flag])
        build_serve_config(parser, args, explicit)
    assert info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
