"""Smoke runs of benchmarks/overhead.py: the breakdown adds up and every phase was observed once per request.

Speed targets are the benchmarks' business (docs/performance.md), not asserted here.
"""

import json

import pytest

pytestmark = pytest.mark.slow

PHASES = {"parse", "validation", "completion", "handoff", "queue", "execution", "encoding", "response"}


def _run(bench, tmp_path, *args: str) -> dict:
    options = ("--count", "4", "--block", "2", "--warmup", "1", "--out-dir", str(tmp_path), "--name", "smoke")
    bench("overhead", *options, *args)
    assert (tmp_path / "smoke.md").read_text().startswith("| phase (mean ms")
    return json.loads((tmp_path / "smoke.json").read_text())


def _check(result: dict, formats: list[str]) -> None:
    assert set(result["results"]) == {*formats, "GET /health"}
    for name in formats:
        row = result["results"][name]
        assert row["requests"] == 4 and set(row["phases_ms"]) == PHASES | {"outside the route"}
        assert sum(row["phases_ms"].values()) == pytest.approx(row["e2e_mean_ms"], abs=0.01)
        # Each figure is rounded to the µs in the JSON.
        difference = row["e2e_mean_ms"] - row["phases_ms"]["execution"]
        assert row["e2e_minus_execution_ms"] == pytest.approx(difference, abs=0.0015)
        assert len(row["e2e_minus_execution_per_block_ms"]) == 2


def test_overhead_on_a_real_server(bench, tiny_flux, tmp_path):
    result = _run(bench, tmp_path, "--model", tiny_flux, "--size", "32x32", "--steps", "2", "--n", "2")
    _check(result, ["b64_json", "url"])
    assert all(row["phases_ms"]["execution"] > 0 for row in map(result["results"].get, ("b64_json", "url")))


def test_overhead_with_the_stub_engine(bench, tmp_path):
    result = _run(bench, tmp_path, "--stub-engine", "--formats", "b64_json", "--output-format", "webp")
    _check(result, ["b64_json"])
    assert result["results"]["b64_json"]["phases_ms"]["execution"] == 0
