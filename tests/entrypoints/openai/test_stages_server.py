"""``vllm serve --omni --deploy-config three-stage.yaml --stage-overrides '{"1": {"max_num_seqs": 2}}'``: a real
server running a split pipeline; the override changes stage 1 only, in its gauge and in the batches it forms."""

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from vllm_omni.testing.processes.server import RemoteOmniServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEPLOY = """\
stages:
  - {stage_id: 0, stage_type: encode, max_num_seqs: 4, request_batch_max_wait_ms: 300}
  - {stage_id: 1, stage_type: denoise, inputs: [0], max_num_seqs: 4}
  - {stage_id: 2, stage_type: decode, inputs: [1], max_num_seqs: 8, request_batch_max_wait_ms: 50}
"""


@pytest.fixture(scope="module")
def server(tiny_flux, tmp_path_factory):
    path = tmp_path_factory.mktemp("deploy") / "three-stage.yaml"
    path.write_text(DEPLOY)
    args = ["--deploy-config", str(path), "--stage-overrides", json.dumps({"1": {"max_num_seqs": 2}})]
    with RemoteOmniServer(tiny_flux, args) as server:
        yield server
    assert server.returncode == 0


def _metrics(server) -> dict[str, list]:
    text = httpx.get(server.url_for("metrics"), timeout=60).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _batches(samples, stage: str) -> dict[str, float]:
    """``le`` → cumulative count of ``vllm_omni:batch_num_requests`` observations of ``stage``."""
    return {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket") and s.labels["stage"] == stage}


def test_the_override_changes_only_stage_1(server):
    health = httpx.get(server.url_for("health"), timeout=60).json()
    assert [(s["stage_id"], s["status"]) for s in health["stages"]] == [(0, "ok"), (1, "ok"), (2, "ok")]
    gauges = {
        (s.labels["stage"], s.labels["source"]): s.value for s in _metrics(server)["vllm_omni:stage_max_num_seqs"]
    }
    assert gauges == {("0", "deploy_yaml"): 4, ("1", "stage_override"): 2, ("2", "deploy_yaml"): 8}

    before = _metrics(server)["vllm_omni:batch_num_requests"]
    client = openai.OpenAI(base_url=server.url_for("v1"), api_key="unused")

    def generate(seed: int):
        return client.images.generate(
            model=client.models.list().data[0].id,
            prompt=f"prompt {seed}",
            size="32x32",
            response_format="b64_json",
            extra_body={"seed": seed, "num_inference_steps": 6},
        )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(generate, range(8)))
    for response in responses:
        image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
        assert image.size == (32, 32) and np.asarray(image).std() > 0

    after = _metrics(server)["vllm_omni:batch_num_requests"]
    new = {
        stage: {le: count - _batches(before, stage).get(le, 0) for le, count in _batches(after, stage).items()}
        for stage in "012"
    }
    assert all(new[stage]["+Inf"] > 0 for stage in "012"), new
    # Stage 1 never ran more than 2 at once, and did run 2; stage 0 (max 4) ran more than 2 at once.
    assert new["1"]["2.0"] == new["1"]["+Inf"] and new["1"]["1.0"] < new["1"]["+Inf"], new["1"]
    assert new["0"]["2.0"] < new["0"]["+Inf"], new["0"]
    # Per-stage queue wait and execution time are in /metrics too.
    metrics = _metrics(server)
    for name in ("vllm_omni:request_queue_time_seconds", "vllm_omni:batch_execution_time_seconds"):
        stages = {s.labels["stage"] for s in metrics[name] if s.name.endswith("_count") and s.value > 0}
        assert stages == {"0", "1", "2"}, name
