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


def test_audio_benchmark_writes_served_and_ceiling_audio_seconds_per_second(bench, tiny_stable_audio, tmp_path):
    """The audio benchmark's cheapest case (N = 1, one block, 2 steps, a quarter second, one ceiling worker): one
    server, whose answers and the ceiling's clips the script checks for length itself; the JSON's structure and
    signs, and its table."""
    bench(
        "audio",
        *("--model", tiny_stable_audio, "--name", "smoke", "--out-dir", str(tmp_path), "--max-num-seqs", "1"),
        *("--blocks", "1", "--rounds", "1", "--steps", "2", "--audio-length", "0.25", "--threads", "main"),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["pipeline"] == "StableAudioPipeline" and (result["steps"], result["audio_length"]) == (2, 0.25)
    [worker] = result["ceiling_workers"].values()
    assert os.path.realpath(worker["vllm_omni"]) == str(BENCHMARKS.parent / "vllm_omni" / "__init__.py")
    [row] = result["rows"]
    assert row["n"] == 1 and row["server_mean_batch_size"] == 1
    assert row["served_audio_s_per_s"] > 0 and row["ceiling_audio_s_per_s"] > 0 and row["ratio"] > 0
    [block] = row["blocks"]
    assert set(block["ceiling_audio_s_per_s_by_thread"]) == {"main"} and row["ratio_per_block"] == [block["ratio"]]
    served, ceiling = block["served_audio_s_per_s"], block["ceiling_audio_s_per_s_by_thread"]["main"]
    assert block["ratio"] == pytest.approx(served / ceiling, rel=1e-3)
    assert (tmp_path / "smoke.md").read_text().startswith("smoke (")


def test_replicas_benchmark_measures_two_ray_replicas(bench, tiny_flux, tmp_path):
    """Two Ray replicas, the configuration with every process group (one replica would be one more server and
    Ray cluster per run; the 2 / 1 ratio it feeds is test_replicas_speedups_pair_each_shape's)."""
    bench(
        "replicas",
        "--model",
        tiny_flux,
        "--configs",
        "2",
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
    assert [(r["backend"], r["replicas"]) for r in result["rows"]] == [("ray", 2)]
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
    assert result["speedups"] == []  # no 1-replica row to divide by


def test_replicas_speedups_pair_each_shape_and_variant_against_its_target(monkeypatch):
    """The 2 / 1 replica ratio of each variant and shape, checked against the target for its steps (none for a
    step count without one)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import replicas

    def row(variant, config, shape, req_per_s):
        return {
            "variant": variant,
            "config": config,
            "shape": shape,
            "req_per_s": req_per_s,
            "cpu_bound_req_per_s": 2.5 * req_per_s,
        }

    rows = [
        row("current", "1", "64x64:4", 2.0),
        row("current", "2", "64x64:4", 3.0),
        row("current", "1", "64x64:20", 1.0),
        row("current", "2", "64x64:20", 1.9),
        row("current", "1", "32x32:2", 4.0),
        row("current", "2", "32x32:2", 6.0),
    ]
    got = {s["shape"]: s for s in replicas.speedups(rows, ["1", "2"])}
    assert {k: (v["speedup"], v["target"], v["pass"]) for k, v in got.items()} == {
        "64x64:4": (1.5, 1.6, False),
        "64x64:20": (1.9, 1.8, True),
        "32x32:2": (1.5, None, None),
    }
    assert got["64x64:4"]["cpu_bound_speedup"] == 3.75
    assert replicas.speedups(rows, ["2"]) == []


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
