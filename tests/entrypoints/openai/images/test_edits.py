"""``POST /v1/images/edits`` on a real server, driven with the real `openai` client: image-to-image and inpainting of a
text-to-image model equal the stock diffusers variants, and hostile or wrong inputs get 400s naming the field."""

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from vllm_omni.testing.checks.edits import noise_image, square_mask, stock_edit
from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

API_KEY = "sk-test"  # the shared Flux server's (conftest.py)
FAST = {"num_inference_steps": 4, "guidance_scale": 3.0}
MAX_BYTES = 64 * 1024
MAX_PIXELS = 128 * 128


@pytest.fixture(scope="module")
def server(tiny_sd):
    args = [
        *("--max-num-seqs", "4", "--api-key", API_KEY, "--uvicorn-log-level", "warning"),
        *("--max-input-image-bytes", str(MAX_BYTES), "--max-input-image-pixels", str(MAX_PIXELS)),
    ]
    with RemoteOmniServer(tiny_sd, args) as server:
        server.model = tiny_sd
        yield server


@pytest.fixture(params=["sd", "flux"])
def family_server(request):
    """The SD server above, and the shared Flux one: the stock-equality tests run on both families."""
    return request.getfixturevalue("server" if request.param == "sd" else "flux_server")


@pytest.fixture
def client(server):
    return _client(server)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0)


def png(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def openai_mask(mask: Image.Image) -> bytes:
    """OpenAI's convention for ``mask``: fully transparent where the image is to be edited."""
    rgba = Image.new("RGBA", mask.size, (0, 0, 0, 255))
    rgba.putalpha(mask.point(lambda v: 0 if v else 255))
    return png(rgba)


def stock(model: str, prompt: str, image, seed: int, strength: float, mask=None) -> np.ndarray:
    return stock_edit(model, prompt, image, seed, strength, mask, **FAST)


def decoded(response) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))), dtype=np.float32) / 255


def test_image_to_image_equals_the_stock_variant(family_server):
    server, client = family_server, _client(family_server)
    image = noise_image(0)
    response = client.images.edit(
        image=("in.png", png(image), "image/png"),
        prompt="a red cat",
        response_format="b64_json",
        extra_body=FAST | {"seed": 5, "strength": 0.75},
    )
    assert response.size == "64x64" and response.output_format == "png"
    expected = stock(server.model, "a red cat", image, 5, 0.75)
    assert np.abs(decoded(response) - expected).max() <= 2 / 255 + 1e-6


def test_inpainting_with_an_openai_mask_equals_the_stock_variant(family_server):
    server, client = family_server, _client(family_server)
    image, mask = noise_image(1), square_mask()
    response = client.images.edit(
        image=("in.png", png(image), "image/png"),
        mask=("mask.png", openai_mask(mask), "image/png"),
        prompt="a blue dog",
        response_format="b64_json",
        extra_body=FAST | {"seed": 6},
    )
    expected = stock(server.model, "a blue dog", image, 6, 1.0, mask)  # 1.0: inpainting's default strength
    assert np.abs(decoded(response) - expected).max() <= 2 / 255 + 1e-6


def test_four_concurrent_edits_each_equal_the_stock_variant(family_server):
    server = family_server
    images = [noise_image(10 + i) for i in range(4)]

    async def four():
        async with openai.AsyncOpenAI(base_url=server.url_for("v1"), api_key=API_KEY, max_retries=0) as aclient:
            return await asyncio.gather(
                *(
                    aclient.images.edit(
                        image=("in.png", png(images[i]), "image/png"),
                        prompt=f"prompt {i}",
                        response_format="b64_json",
                        extra_body=FAST | {"seed": i, "strength": 0.5},
                    )
                    for i in range(4)
                )
            )

    for i, response in enumerate(asyncio.run(four())):
        expected = stock(server.model, f"prompt {i}", images[i], i, 0.5)
        assert np.abs(decoded(response) - expected).max() <= 2 / 255 + 1e-6


def test_url_responses_n_and_a_jpeg_input(server, client):
    response = client.images.edit(
        image=("in.jpg", png(noise_image(2), "JPEG"), "image/jpeg"),
        prompt="a tree",
        n=2,
        size="32x32",
        response_format="url",
        extra_body=FAST,
    )
    assert len(response.data) == 2 and response.size == "32x32"
    fetched = httpx.get(response.data[0].url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert Image.open(io.BytesIO(fetched.content)).size == (32, 32)


def _bomb() -> bytes:
    """A PNG whose header declares 20000 × 20000 pixels (400 M) in a few hundred bytes."""
    return png(Image.new("1", (20000, 20000)))


def _post_edit(server, files, data) -> httpx.Response:
    return httpx.post(
        server.url_for("v1", "images", "edits"),
        files=files,
        data=data,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )


IMAGE = ("image", ("in.png", png(noise_image(3)), "image/png"))
REFUSALS = {
    "bomb": ([("image", ("bomb.png", _bomb(), "image/png"))], {}, "image", "image_too_large"),
    "too many bytes": (
        [("image", ("big.png", png(noise_image(4, size=160)), "image/png"))],
        {},
        "image",
        "image_too_large",
    ),
    "too many pixels": (
        [("image", ("wide.png", png(Image.new("RGB", (256, 128))), "image/png"))],
        {},
        "image",
        "image_too_large",
    ),
    "gif": ([("image", ("in.gif", png(noise_image(5), "GIF"), "image/gif"))], {}, "image", "invalid_image"),
    "truncated": ([("image", ("cut.png", png(noise_image(5))[:200], "image/png"))], {}, "image", "invalid_image"),
    "mask size": (
        [IMAGE, ("mask", ("m.png", openai_mask(square_mask(32)), "image/png"))],
        {},
        "mask",
        "invalid_value",
    ),
    "mask without alpha": (
        [IMAGE, ("mask", ("m.png", png(square_mask()), "image/png"))],
        {},
        "mask",
        "invalid_image",
    ),
    "17 images": ([("image[]", IMAGE[1])] * 17, {}, "image", "invalid_value"),
    "18 files": ([("image[]", IMAGE[1])] * 18, {}, None, "invalid_form"),
    "2 images for a 1-image model": ([("image[]", IMAGE[1])] * 2, {}, "image", "invalid_value"),
    "missing image": ([], {}, "image", "invalid_value"),
    "missing prompt": ([IMAGE], {"prompt": None}, "prompt", None),
    "strength 0": ([IMAGE], {"strength": "0"}, "strength", None),
    "strength 1.5": ([IMAGE], {"strength": "1.5"}, "strength", None),
    "strength leaves no step": ([IMAGE], {"strength": "0.1"}, "strength", "invalid_value"),
    "unknown field": ([IMAGE], {"sharpness": "high"}, "sharpness", None),
    "text where a file goes": ([], {"image": "not a file"}, "image", "invalid_value"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_field_and_keep_the_server_healthy(server, case):
    files, fields, param, code = REFUSALS[case]
    data = {k: v for k, v in ({"prompt": "x", **FAST} | fields).items() if v is not None}
    response = _post_edit(server, files or None, data)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert httpx.get(server.url_for("health"), timeout=60).status_code == 200


def test_an_image_model_refuses_input_reference_on_the_videos_api(server):
    response = httpx.post(
        server.url_for("v1", "videos"),
        files=[("input_reference", IMAGE[1])],
        data={"prompt": "x"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_supported"
