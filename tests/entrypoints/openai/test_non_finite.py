"""An output that is not finite is never answered as an image: a 422 naming the likely cause (here the request's own
``flow_shift``, so small that Flux's schedule is 0 / 0 in float32: what the schema fuzzing found)."""

import httpx
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AUTH = {"Authorization": "Bearer sk-test"}  # the shared servers' key (conftest.py)


def test_a_request_whose_output_is_nan_gets_a_422_and_no_image(flux_server):
    body = {"prompt": "0", "size": "32x32", "num_inference_steps": 1, "flow_shift": 5e-324}
    answer = httpx.post(flux_server.url_for("v1", "images", "generations"), json=body, headers=AUTH, timeout=300)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "non_finite_output")
    assert "FluxPipeline's output is not finite" in error["message"] and "flow_shift=5e-324" in error["message"]
