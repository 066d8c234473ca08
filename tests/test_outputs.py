"""The typed metrics record: what `OmniRequestOutput.metrics` holds, readable as the mapping it always was."""

import pickle

import pytest

from vllm_omni.outputs import RequestMetrics, StageMetrics, across_stages


def _metrics(**extra) -> RequestMetrics:
    return RequestMetrics(**{"batch_size": 2, "queue_ms": 1.5, "exec_ms": 10.0, "seed": 7, "replica": 0, **extra})


def test_the_record_reads_as_a_mapping_of_its_set_fields():
    metrics = _metrics()
    assert metrics["batch_size"] == 2 and metrics.seed == 7
    assert dict(metrics) == {"batch_size": 2, "queue_ms": 1.5, "exec_ms": 10.0, "seed": 7, "replica": 0}
    assert "fps" not in metrics and metrics.get("fps") is None
    with pytest.raises(KeyError):
        metrics["fps"]
    with pytest.raises(KeyError):
        metrics["not_a_field"]
    assert dict(_metrics(fps=16))["fps"] == 16


def test_every_field_is_required_or_documented_as_optional():
    with pytest.raises(TypeError, match="seed"):
        RequestMetrics(batch_size=1, queue_ms=0.0, exec_ms=0.0, replica=0)


def test_a_split_request_reports_the_denoise_stage_and_sums_the_times():
    stages = [
        StageMetrics.of(0, "encode", _metrics(batch_size=4, queue_ms=1.0, exec_ms=2.0)),
        StageMetrics.of(1, "denoise", _metrics(batch_size=2, queue_ms=3.0, exec_ms=20.0, replica=1, steps=4)),
        StageMetrics.of(2, "decode", _metrics(batch_size=3, queue_ms=5.0, exec_ms=4.0, fps=8)),
    ]
    combined = across_stages(stages, denoiser_id=1)
    assert (combined.batch_size, combined.replica, combined.steps) == (2, 1, 4)
    assert (combined.queue_ms, combined.exec_ms, combined.fps, combined.seed) == (9.0, 26.0, 8, 7)
    assert [s["stage_type"] for s in combined["stages"]] == ["encode", "denoise", "decode"]
    assert pickle.loads(pickle.dumps(combined)) == combined  # crosses to and from Ray actors
