"""Smoke runs of the benchmark scripts that start servers of their own per case (a batching sweep, Ray replicas),
apart from tests/benchmarks/test_scripts.py, whose bench_serving tests share one server.

Speed targets are the benchmarks' business (docs/performance.md), not asserted here.
"""

import json
import os
import pathlib

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_batching_sweep_writes_json_table_and_plot_and_runs_every_case_with_the_baseline(bench, tiny_flux, tmp_path):
    """One sweep (N = 1: each N is one more server per checkout; batching itself is the servers' tests' business)
    with ``--baseline DIR``: the same case with a server and workers importing vllm_omni from DIR (this checkout
    here, so the test needs no second one), side by side with the ratio; the targets of both are reported, and the
    JSON, the table and the plot are written."""
    repo = os.path.realpath(BENCHMARKS.parent)
    bench(
        "batching_sweep",
        *("--model", tiny_flux, "--name", "smoke", "--out-dir", str(tmp_path)),
        *("--max-num-seqs", "1", "--shapes", "32x32:1", "--blocks", "1", "--rounds", "1", "--warmup", "1"),
        *("--baseline", repo),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["variant"], r["n"], r["shape"]) for r in result["rows"]] == [("current", 1, "32x32:1")]
    assert [(r["variant"], r["n"]) for r in result["baseline_rows"]] == [("baseline", 1)]
    for row in result["rows"] + result["baseline_rows"]:
        assert row["efficiency"] > 0 and row["server_mean_batch_size"] == row["n"]
        assert set(row["ceiling_images_per_s_by_thread"]) == {"main", "dedicated"}
        assert row["ceiling_images_per_s"] == max(row["ceiling_images_per_s_by_thread"].values())
    assert set(result["concurrency1_latency_over_direct_call"]) == {"32x32:1"}
    assert {os.path.realpath(tree) for tree in result["trees"].values()} == {repo}
    assert len(result["comparison"]) == 1 and all(e["served_images_per_s"]["ratio"] > 0 for e in result["comparison"])
    for imports in result["imports"]["N=1"].values():
        assert imports["server_ok"] in (True, None)  # None: py-spy is not installed
        assert {os.path.realpath(w["vllm_omni"]) for w in imports["workers"].values()} == {
            os.path.join(repo, "vllm_omni", "__init__.py")
        }
    assert set(result["targets"]) == {"current", "baseline"}
    assert [t["target"] for t in result["targets"]["current"]] == [
        "concurrency-1 latency / fastest direct call 32x32:1"
    ]
    table = (tmp_path / "smoke.md").read_text()
    assert table.startswith("| shape | N |") and "Current vs baseline" in table
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replicas_benchmark_compares_one_and_two_ray_replicas(bench, tiny_flux, tmp_path):
    bench(
        "replicas",
        "--model",
        tiny_flux,
        "--shapes",
        "32x32:2",
        "--num-requests",
        "8",
        "--concurrency",
        "4",
        "--reps",
        "1",
        "--idle-s",
        "0.5",
        "--overhead-requests",
        "2",
        "--out-dir",
        str(tmp_path),
        "--name",
        "smoke",
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["backend"], r["replicas"]) for r in result["rows"]] == [("ray", 1), ("ray", 2)]
    for row in result["rows"]:  # which replica serves what depends on timing (an idle replica 0 wins the ties)
        assert set(row["served_by"]) <= {str(i) for i in range(row["replicas"])}
        assert sum(row["served_by"].values()) == 8
    for row in result["rows"]:
        assert set(row["cpu_ms_per_request"]) == {
            "load_generator",
            "server",
            "ray_gcs",
            "raylet",
            "ray_other",
            "actors",
            "server_other",
        }
        assert row["cpu_ms_per_request"]["actors"] > 0 and row["ray_idle_pct_of_core"] >= 0
        assert len(row["imports"]["actors"]) == row["replicas"] and row["imports"]["ok"] in (True, None)
    [speedup] = result["speedups"]
    assert speedup["speedup"] > 0 and speedup["target"] is None  # no target for 2 steps
    assert "2 Ray replicas / 1" in (tmp_path / "smoke.md").read_text()


def test_replicas_benchmark_baseline_and_inline(bench, tiny_flux, tmp_path):
    """``--baseline DIR`` (this checkout here) runs each configuration twice, side by side with the ratio."""
    repo = os.path.realpath(BENCHMARKS.parent)
    bench(
        "replicas",
        "--model",
        tiny_flux,
        "--configs",
        "inline",
        "--shapes",
        "32x32:2",
        "--num-requests",
        "4",
        "--concurrency",
        "2",
        "--reps",
        "1",
        "--idle-s",
        "0.5",
        "--overhead-requests",
        "2",
        "--baseline",
        repo,
        "--out-dir",
        str(tmp_path),
        "--name",
        "smoke",
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["variant"], r["backend"]) for r in result["rows"]] == [("current", "inline"), ("baseline", "inline")]
    assert all(os.path.realpath(r["imports"]["tree"]) == repo and r["imports"]["actors"] == [] for r in result["rows"])
    [entry] = result["comparison"]
    assert entry["config"] == "inline" and entry["req_per_s"] > 0
    assert result["speedups"] == []
