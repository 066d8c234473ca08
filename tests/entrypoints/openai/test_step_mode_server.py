"""``vllm serve MODEL --omni --execution-mode step``: images and video jobs over HTTP, requests joining at steps."""

import asyncio
import base64
import io
import time

import httpx
import openai
import pytest
from PIL import Image

from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _histogram(server: RemoteOmniServer, name: str, task: str) -> tuple[float, float]:
    """(count, sum) of a histogram of the server's /metrics."""
    values = {}
    for line in httpx.get(server.url_for("metrics"), timeout=60).text.splitlines():
        for part in ("count", "sum"):
            if line.startswith(f"{name}_{part}{{") and f'task="{task}"' in line:
                values[part] = float(line.rsplit(" ", 1)[1])
    return values.get("count", 0.0), values.get("sum", 0.0)


def test_images_with_different_steps_share_forwards(tiny_flux, tmp_path):
    log = tmp_path / "server.log"
    with RemoteOmniServer(tiny_flux, ["--execution-mode", "step", "--max-num-seqs", "4"], log_path=str(log)) as server:
        assert "execution_mode='step' (cli)" in log.read_text()
        forwards, rows = _histogram(server, "vllm_omni:batch_num_requests", "image")

        async def four():
            async with openai.AsyncOpenAI(base_url=server.url_for("v1"), api_key="unused", max_retries=0) as client:
                return await asyncio.gather(
                    *(
                        client.images.generate(
                            prompt=f"prompt {i}",
                            size="32x32",
                            response_format="b64_json",
                            extra_body={"num_inference_steps": steps, "seed": i},
                        )
                        for i, steps in enumerate((60, 20, 40, 30))  # long enough to overlap on a busy machine
                    )
                )

        for response in asyncio.run(four()):
            image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
            assert image.size == (32, 32)
        forwards_after, rows_after = _histogram(server, "vllm_omni:batch_num_requests", "image")
        assert rows_after - rows == 60 + 20 + 40 + 30  # one observation per forward, one row per request and step
        assert forwards_after - forwards < 150  # some forwards held several requests
    assert server.returncode == 0


def test_a_video_job_reports_step_progress(tiny_wan):
    auth = {"Authorization": "Bearer k"}
    with RemoteOmniServer(tiny_wan, ["--execution-mode", "step", "--max-num-seqs", "2", "--api-key", "k"]) as server:
        body = {"prompt": "a cat running", "size": "32x32", "num_frames": 5, "num_inference_steps": 200, "seed": 1}
        created = httpx.post(server.url_for("v1", "videos"), json=body, headers=auth)
        assert created.status_code == 200, created.text
        job = created.json()
        seen, deadline = set(), time.monotonic() + 120
        while True:
            current = httpx.get(server.url_for("v1", "videos", job["id"]), headers=auth).json()
            if current["status"] in ("completed", "failed") or time.monotonic() > deadline:
                break
            if current["status"] == "in_progress":
                seen.add(current["progress"])
            time.sleep(0.02)
        assert current["status"] == "completed" and current["progress"] == 100
        assert any(0 < p < 100 for p in seen), f"no intermediate progress seen: {sorted(seen)}"
        content = httpx.get(server.url_for("v1", "videos", job["id"], "content"), headers=auth)
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
