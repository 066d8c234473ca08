"""Instruction-edit and image-to-video models behind a real server: Kontext and Qwen-Image-Edit edits with the real
`openai` client, what each model cannot serve refused as ``model_not_supported``, and an image-to-video job from
``input_reference`` to an MP4."""

import base64
import io
import time

import av
import httpx
import openai
import pytest
from PIL import Image

from vllm_omni.testing.checks.edits import noise_image
from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST = {"num_inference_steps": 2}
ARGS = ["--max-num-seqs", "2", "--uvicorn-log-level", "warning"]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _edit(client, **kwargs):
    return client.images.edit(
        image=("in.png", png(noise_image(1)), "image/png"),
        prompt="make it red",
        response_format="b64_json",
        extra_body=FAST | {"seed": 1},
        **kwargs,
    )


def _size(response) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))).size


def test_kontext_edits_generates_without_an_image_and_refuses_a_mask(tiny_kontext):
    with RemoteOmniServer(tiny_kontext, ARGS) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        edited = _edit(client)
        assert edited.size == "64x64" and _size(edited) == (64, 64)  # size auto: the image's
        generated = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body=FAST)
        assert _size(generated) == (64, 64)
        with pytest.raises(openai.BadRequestError) as refused:
            _edit(client, mask=("mask.png", png(Image.new("RGBA", (64, 64))), "image/png"))
        assert refused.value.body["param"] == "mask"


def test_qwen_image_edit_edits_and_refuses_generations(tiny_qwen_edit):
    with RemoteOmniServer(tiny_qwen_edit, ARGS) as server:
        client = openai.OpenAI(base_url=server.url_for("v1"), api_key="none", max_retries=0)
        assert _size(_edit(client, size="32x64")) == (32, 64)
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(prompt="a cat", size="64x64", extra_body=FAST)
        assert refused.value.body["code"] == "model_not_supported"
        assert "/v1/images/edits" in refused.value.body["message"]


def test_an_image_to_video_job_from_input_reference_makes_an_mp4(tiny_wan_i2v):
    with RemoteOmniServer(tiny_wan_i2v, ARGS) as server:
        form = {"prompt": "a cat running", "size": "32x32", "num_frames": "5", "seed": "3", **FAST}
        without = httpx.post(server.url_for("v1", "videos"), data=form, timeout=60)
        assert without.status_code == 400 and without.json()["error"]["code"] == "model_not_supported"
        created = httpx.post(
            server.url_for("v1", "videos"),
            data=form,
            files={"input_reference": ("first.png", png(noise_image(2, size=32)), "image/png")},
            timeout=60,
        )
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]
        deadline = time.monotonic() + 300  # a generous bound on a state change, not a race
        while (job := httpx.get(server.url_for("v1", "videos", video_id), timeout=60).json())["status"] not in (
            "completed",
            "failed",
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["status"] == "completed", job
        content = httpx.get(server.url_for("v1", "videos", video_id, "content"), timeout=60)
        with av.open(io.BytesIO(content.content)) as container:
            frames = list(container.decode(container.streams.video[0]))
        assert len(frames) == 5 and (frames[0].width, frames[0].height) == (32, 32)
