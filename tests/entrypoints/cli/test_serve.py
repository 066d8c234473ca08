"""``vllm serve MODEL --omni``: vLLM's parser plus the omni group; every bad flag fails before loading."""

import re
import subprocess
import time

import httpx
import pytest

from vllm_omni.entrypoints.cli.serve import (
    build_serve_config,
    make_serve_parser,
    parse_serve_args,
)
from vllm_omni.testing.processes.server import RemoteOmniServer, vllm_executable

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def parser():
    return make_serve_parser("vllm serve")


def _config(parser, argv):
    args, explicit = parse_serve_args(parser, argv)
    return build_serve_config(parser, args, explicit)


def _error(parser, argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        _config(parser, argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_vllm_flags_and_omni_flags_resolve_with_cli_provenance(parser, tiny_flux):
    source, stages, serving = _config(
        parser,
        [
            tiny_flux,
            "--omni",
            "--max-num-seqs",
            "4",
            "--request-batch-max-wait-ms",
            "25",
            "--dtype",
            "half",
            "--port",
            "9001",
            "--api-key",
            "k1",
            "k2",
            "--served-model-name",
            "tiny",
            "--max-image-pixels",
            "4096",
            "--allowed-origins",
            '["http://localhost"]',
        ],
    )
    stage = stages[0]
    assert (source.kind, source.model) == ("folder", tiny_flux)
    assert (stage.max_num_seqs, stage.request_batch_max_wait_ms, stage.dtype) == (4, 25.0, "float16")
    assert {k: stage.provenance[k] for k in ("max_num_seqs", "request_batch_max_wait_ms", "dtype", "devices")} == {
        "max_num_seqs": "cli",
        "request_batch_max_wait_ms": "cli",
        "dtype": "cli",
        "devices": "default",
    }
    assert (serving.port, serving.api_keys, serving.served_model_names) == (9001, ["k1", "k2"], ["tiny"])
    assert (serving.max_image_pixels, serving.allowed_origins) == (4096, ["http://localhost"])


def test_defaults_are_not_mistaken_for_choices(parser, tiny_flux):
    _, stages, serving = _config(parser, [tiny_flux, "--dtype", "auto"])
    assert stages[0].provenance["max_num_seqs"] == "default" and stages[0].max_num_seqs == 1
    assert stages[0].provenance["dtype"] == "cli"
    assert serving.served_model_names == [tiny_flux] and serving.api_keys == []


def test_strict_fields_is_a_switch_off_by_default(parser, tiny_flux):
    assert _config(parser, [tiny_flux])[2].strict_fields is False
    assert _config(parser, [tiny_flux, "--strict-fields"])[2].strict_fields is True
    assert "--strict-fields" in parser.format_help()


def test_otlp_traces_endpoint_is_vllms_flag_and_off_by_default(parser, tiny_flux):
    assert _config(parser, [tiny_flux])[2].otlp_traces_endpoint is None
    given = _config(parser, [tiny_flux, "--otlp-traces-endpoint", "http://collector:4317"])[2]
    assert given.otlp_traces_endpoint == "http://collector:4317"


def test_profiler_config_is_vllms_flag_as_json_or_dotted_and_off_by_default(parser, tiny_flux, tmp_path):
    assert _config(parser, [tiny_flux])[2].profiler_config.profiler is None  # vLLM's default: off
    json_form = ["--profiler-config", f'{{"profiler": "torch", "torch_profiler_dir": "{tmp_path}"}}']
    dotted = ["--profiler-config.profiler=torch", f"--profiler-config.torch_profiler_dir={tmp_path}"]
    for argv in (json_form, [*dotted, "--profiler-config.torch_profiler_use_gzip=false"]):
        config = _config(parser, [tiny_flux, *argv])[2].profiler_config
        assert (config.profiler, config.torch_profiler_dir) == ("torch", str(tmp_path))
    assert config.torch_profiler_use_gzip is False


def test_deploy_yaml_below_the_global_flag_below_stage_overrides(parser, tiny_flux, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: 2\n    request_batch_max_wait_ms: 40\n")
    _, stages, _ = _config(parser, [tiny_flux, "--deploy-config", str(deploy), "--max-num-seqs", "3"])
    assert (stages[0].max_num_seqs, stages[0].provenance["max_num_seqs"]) == (3, "cli")
    assert stages[0].provenance["request_batch_max_wait_ms"] == "deploy_yaml"
    _, stages, _ = _config(
        parser, [tiny_flux, "--deploy-config", str(deploy), "--stage-overrides", '{"0": {"max_num_seqs": 5}}']
    )
    assert (stages[0].max_num_seqs, stages[0].provenance["max_num_seqs"]) == (5, "stage_override")


def test_execution_mode_flag_resolves_with_cli_provenance(parser, tiny_flux):
    _, stages, _ = _config(parser, [tiny_flux, "--execution-mode", "step", "--max-num-seqs", "4"])
    assert (stages[0].execution_mode, stages[0].provenance["execution_mode"]) == ("step", "cli")
    assert "execution_mode='step' (cli)" in stages[0].describe()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-num-seqs", "0"], r"--max-num-seqs 0: Input should be greater than or equal to 1"),
        (["--max-num-seqs", "four"], r"argument --max-num-seqs: invalid int value: 'four'"),
        (["--request-batch-max-wait-ms", "-1"], r"--request-batch-max-wait-ms -1.0: Input should be greater"),
        (
            ["--tensor-parallel-size", "2"],
            r"--tensor-parallel-size 2: Value error, tensor_parallel_size is accepted as 1 only",
        ),
        (["--stage-overrides", "{"], r"argument --stage-overrides: not valid JSON"),
        (["--stage-overrides", "[1]"], r"argument --stage-overrides: must be a JSON object"),
        (["--stage-overrides", '{"3": {"max_num_seqs": 2}}'], r"stage_overrides names stage 3, which does not exist"),
        (["--deploy-config", "/nonexistent.yaml"], r"deploy config not found: /nonexistent.yaml"),
        (["--max-waiting-requests", "-1"], r"--max-waiting-requests -1: Input should be greater than or equal to 0"),
        (["--max-num-seqs", "8", "--max-waiting-requests", "4"], r"--max-waiting-requests 4 is below max_num_seqs=8"),
        (["--bogus-flag"], r"unrecognized arguments: --bogus-flag"),
        (
            ["--execution-mode", "steps"],
            r"argument --execution-mode: invalid choice: 'steps' \(choose from 'request', 'step'\)",
        ),
        (["--lora-modules", "a"], r"Invalid JSON format for --lora-modules: a"),
        (["--lora-modules", "a=/x", "a=/y"], r"lora_modules names must be unique, repeated: a"),
        (["--max-loras", "0"], r"--max-loras 0: Input should be greater than or equal to 1"),
        (["--max-cpu-loras", "2"], r"--max-cpu-loras: vLLM flag\(s\) that a diffusion server does not use"),
        (["--lora-dtype", "float16"], r"--lora-dtype: vLLM flag\(s\) that a diffusion server does not use"),
        (["--profiler-config.profiler=cuda"], r"--profiler-config: profiler 'cuda' is not supported"),
        (
            ['--profiler-config={"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": 3}'],
            r"--profiler-config: max_iterations is not supported: it applies to vLLM's engine iterations",
        ),
    ],
)
def test_bad_flags_fail_naming_the_flag(parser, tiny_flux, capsys, argv, message):
    assert re.search(message, _error(parser, [tiny_flux, *argv], capsys))


def test_model_must_be_a_diffusers_folder_a_checkpoint_or_a_repo_id(parser, tmp_path, capsys):
    assert "is a folder but neither a diffusers folder" in _error(parser, [str(tmp_path)], capsys)
    assert "give the model (a diffusers folder" in _error(parser, ["--max-num-seqs", "2"], capsys)
    (tmp_path / "notes.txt").write_text("not weights")
    assert "is a file but not a single-file checkpoint" in _error(parser, [str(tmp_path / "notes.txt")], capsys)
    assert "a Hugging Face repo id (org/name) nor a file in one (org/name:FILE): no such path" in _error(
        parser, ["./no/such/dir"], capsys
    )


def test_a_repo_id_takes_vllms_hub_flags_and_is_the_served_name(parser):
    source, _, serving = _config(
        parser, ["org/flux", "--revision", "v1", "--download-dir", "/tmp/hub", "--hf-token", "--port", "9000"]
    )
    assert (source.kind, source.model, source.revision, source.download_dir) == ("repo", "org/flux", "v1", "/tmp/hub")
    assert source.hf_token is True  # vLLM's --hf-token alone: the token `hf auth login` saved
    assert serving.served_model_names == ["org/flux"]
    assert _config(parser, ["org/flux", "--hf-token", "hf_abc"])[0].hf_token == "hf_abc"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--revision", "v1"], r"revision \(--revision\) applies to a Hugging Face repo id"),
        (["--download-dir", "/tmp/hub"], r"download_dir \(--download-dir\) applies to a Hugging Face repo id"),
        (["--hf-token", "x"], r"hf_token \(--hf-token\) applies to a Hugging Face repo id"),
        (["--model-config", "org/flux"], r"model_config \(--model-config\) is for a single-file checkpoint"),
    ],
)
def test_hub_flags_with_a_local_folder_are_refused(parser, tiny_flux, capsys, extra, message):
    assert re.search(message, _error(parser, [tiny_flux, *extra], capsys))


def test_help_lists_the_omni_group(parser):
    text = parser.format_help()
    omni = text[text.index("\nOmni:") :]
    for flag in ("--deploy-config", "--request-batch-max-wait-ms", "--stage-overrides", "--max-waiting-requests"):
        assert flag in omni
    for flag in ("--lora-modules", "--enable-lora", "--max-loras", "--max-lora-rank"):  # vLLM's, used
        assert flag in omni[: omni.index("any other vLLM flag is refused")]


def test_lora_flags_resolve_with_cli_provenance(parser, tiny_flux):
    _, stages, _ = _config(parser, [tiny_flux, "--lora-modules", "a=/x", "--max-loras", "2"])
    stage = stages[0]
    assert [(m.name, m.path) for m in stage.lora_modules] == [("a", "/x")]
    assert {k: (getattr(stage, k), stage.provenance[k]) for k in ("max_loras", "max_lora_rank")} == {
        "max_loras": (2, "cli"),
        "max_lora_rank": (64, "default"),  # not vLLM's default of 16
    }
    assert "lora_modules=(a=/x,) (cli)" in stage.describe()


def test_the_real_vllm_cli_refuses_a_bad_flag_before_loading(tiny_flux):
    started = time.monotonic()
    done = subprocess.run(
        [vllm_executable(), "serve", tiny_flux, "--omni", "--max-num-seqs", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "--max-num-seqs 0" in done.stderr and "Loaded" not in done.stderr + done.stdout
    assert time.monotonic() - started < 120


def test_deploy_config_and_global_flag_show_in_metrics(tiny_flux, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: 2\n    request_batch_max_wait_ms: 40\n")
    with RemoteOmniServer(tiny_flux, ["--deploy-config", str(deploy), "--max-num-seqs", "3"]) as server:
        text = httpx.get(server.url_for("metrics")).text
        assert 'vllm_omni:stage_max_num_seqs{source="cli",stage="0"} 3.0' in text
        assert 'vllm_omni:stage_max_num_seqs{source="deploy_yaml"' not in text
        # Every knob with its own layer: the flag beat the YAML's max_num_seqs, the YAML set the wait.
        assert 'vllm_omni:stage_knob_info{knob="max_num_seqs",source="cli",stage="0",value="3"} 1.0' in text
        wait = 'knob="request_batch_max_wait_ms",source="deploy_yaml",stage="0",value="40.0"'
        assert f"vllm_omni:stage_knob_info{{{wait}}} 1.0" in text
    assert server.returncode == 0


def test_the_vllm_omni_script_has_the_same_serve_command(tiny_flux):
    done = subprocess.run(
        ["vllm-omni", "serve", tiny_flux, "--max-num-seqs", "2", "--max-waiting-requests", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "usage: vllm-omni serve" in done.stderr and "--max-waiting-requests 1 is below" in done.stderr


def test_a_video_model_serves_and_the_images_api_refuses_it(tiny_wan):
    with RemoteOmniServer(tiny_wan, ["--max-num-seqs", "2"]) as server:  # warm-up: one frame at the default size
        response = httpx.post(server.url_for("v1", "images", "generations"), json={"prompt": "x", "size": "32x32"})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "model_not_supported"
        assert "is a video model; this API serves image models only" in response.json()["error"]["message"]
    assert server.returncode == 0


def test_trust_remote_code_is_vllms_flag_and_a_stage_knob(parser, tiny_flux):
    _, stages, _ = _config(parser, [tiny_flux, "--trust-remote-code"])
    assert (stages[0].trust_remote_code, stages[0].provenance["trust_remote_code"]) == (True, "cli")
    _, stages, _ = _config(parser, [tiny_flux])
    assert (stages[0].trust_remote_code, stages[0].provenance["trust_remote_code"]) == (False, "default")


def test_load_format_is_vllms_flag_and_a_stage_knob_taking_our_values(parser, tiny_flux, capsys):
    _, stages, _ = _config(parser, [tiny_flux, "--load-format", "dummy"])
    assert (stages[0].load_format, stages[0].provenance["load_format"]) == ("dummy", "cli")
    _, stages, _ = _config(parser, [tiny_flux])
    assert (stages[0].load_format, stages[0].provenance["load_format"]) == ("auto", "default")
    # vLLM's parser takes its own formats; the resolver takes ours, naming the flag
    assert "--load-format 'safetensors': Input should be 'auto' or 'dummy'" in _error(
        parser, [tiny_flux, "--load-format", "safetensors"], capsys
    )


def test_scheduling_policy_is_vllms_flag_and_a_stage_knob_with_provenance(parser, tiny_flux, capsys):
    _, stages, _ = _config(parser, [tiny_flux, "--scheduling-policy", "priority"])
    assert (stages[0].scheduling_policy, stages[0].provenance["scheduling_policy"]) == ("priority", "cli")
    assert "scheduling_policy='priority' (cli)" in stages[0].describe()
    _, stages, _ = _config(parser, [tiny_flux])
    assert (stages[0].scheduling_policy, stages[0].provenance["scheduling_policy"]) == ("fcfs", "default")
    assert "--scheduling-policy" in _error(parser, [tiny_flux, "--scheduling-policy", "lifo"], capsys)


def test_max_preempted_state_mb_is_a_flag_of_step_mode_under_the_priority_policy(parser, tiny_flux, capsys):
    step = [tiny_flux, "--execution-mode", "step", "--scheduling-policy", "priority"]
    _, stages, _ = _config(parser, [*step, "--max-preempted-state-mb", "256"])
    assert (stages[0].max_preempted_state_mb, stages[0].provenance["max_preempted_state_mb"]) == (256, "cli")
    assert _config(parser, step)[1][0].max_preempted_state_mb == 1024
    error = _error(parser, [tiny_flux, "--execution-mode", "step", "--max-preempted-state-mb", "256"], capsys)
    assert "--max-preempted-state-mb 256 (cli) bounds the state of preempted requests" in error
    assert "but scheduling_policy is 'fcfs' (default): set scheduling_policy to 'priority'" in error
    error = _error(parser, [tiny_flux, "--scheduling-policy", "priority", "--max-preempted-state-mb", "8"], capsys)
    assert "but execution_mode is 'request' (default): set execution_mode to 'step'" in error


def test_num_gpus_is_an_inline_stages_device_count(parser, tiny_flux, capsys):
    """Upstream's --num-gpus: the product of the parallel degrees, given with them; a mismatch names both."""
    _, stages, _ = _config(parser, [tiny_flux, "--num-gpus", "2", "--ulysses-degree", "2"])
    stage = stages[0]
    assert (stage.num_gpus, stage.provenance["num_gpus"], stage.distributed_executor_backend) == (2, "cli", "inline")
    assert "num_gpus=2.0 (cli)" in stage.describe()
    assert "num_gpus" not in _config(parser, [tiny_flux])[1][0].describe()  # unset: not an inline stage's knob
    error = _error(parser, [tiny_flux, "--num-gpus", "2"], capsys)
    assert "--num-gpus 2.0 (cli) is the replica's device count, one per rank, but the parallel degrees" in error
    assert "give num_gpus 1, or set ulysses_degree, ring_degree, cfg_parallel_size or vae_patch_parallel_size" in error
    error = _error(parser, [tiny_flux, "--num-gpus", "4", "--ulysses-degree", "2"], capsys)
    assert "--ulysses-degree 2 (cli) make 2 rank(s): give num_gpus 2" in error


def test_vllm_flags_with_no_effect_here_are_accepted_with_a_log_line(parser, tiny_flux, caplog):
    """Upstream's docs pass --enforce-eager (and --gpu-memory-utilization ...): accepted, logged as doing nothing.
    A real ``vllm serve --enforce-eager`` is the audio API's server (tests/entrypoints/openai/audio/test_generate.py),
    which serves its requests through the real CLI."""
    import logging

    with caplog.at_level(logging.INFO, logger="vllm_omni.entrypoints.cli.serve"):
        _config(parser, [tiny_flux, "--enforce-eager", "--gpu-memory-utilization", "0.5"])
    assert "--enforce-eager, --gpu-memory-utilization: vLLM flag(s) that have no effect on a diffusion server" in (
        caplog.text
    )
