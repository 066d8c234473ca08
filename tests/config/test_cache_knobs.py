"""The step-cache knobs through the one resolver: provenance, the CLI's JSON, and every refusal, each naming the
knob as it was written."""

import sys
import typing

import pytest

from vllm_omni.config import resolve_stage_configs
from vllm_omni.config.cache import CACHE_BACKENDS, CacheBackendName, cache_config_keys


def test_the_backend_literal_is_none_then_the_tables_keys_in_order():
    assert typing.get_args(CacheBackendName) == ("none", *CACHE_BACKENDS)


def test_cache_knobs_resolve_with_provenance_from_the_cli_json():
    stage = resolve_stage_configs(
        global_knobs={"cache_backend": "first_block", "cache_config": '{"threshold": 0.2}'}, global_source="cli"
    )[0]
    assert (stage.cache_backend, stage.cache_config) == ("first_block", {"threshold": 0.2})
    assert stage.provenance["cache_backend"] == stage.provenance["cache_config"] == "cli"
    assert "cache_backend='first_block' (cli), cache_config={'threshold': 0.2} (cli)" in stage.describe()


def test_a_stage_override_sets_the_cache_of_one_stage():
    stage = resolve_stage_configs(
        global_knobs={"cache_backend": "taylorseer"},
        stage_overrides={0: {"cache_config": {"cache_interval": 3, "taylor_factors_dtype": "float32"}}},
    )[0]
    assert stage.provenance["cache_config"] == "stage_override"


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"cache_config": {"threshold": 0.2}}, r"--cache-config \{'threshold': 0.2\} \(cli\) configures a step cache"),
        ({"cache_backend": "first_block", "cache_config": {"thresh": 1}}, r"key\(s\) thresh .* allowed: threshold"),
        ({"cache_backend": "magcache"}, r"cache_backend 'magcache': `mag_ratios` must be provided"),
        ({"cache_backend": "faster_cache"}, r"--cache-backend 'faster_cache' \(cli\): diffusers' FasterCache"),
        ({"cache_backend": "pab", "enable_lora": True}, r"--cache-backend 'pab' \(cli\) runs each request's rows"),
        ({"cache_backend": "teacache"}, r"--cache-backend 'teacache'"),
        ({"cache_backend": "first_block", "cache_config": "{threshold"}, r"cache_config must be a JSON object"),
        (
            {"cache_backend": "cache_dit", "max_num_seqs": 2},
            r"'cache_dit' \(cli\) decides for a whole pipeline call .* --max-num-seqs is 2 \(cli\): set max_num_seqs",
        ),
        (
            {"cache_backend": "cache_dit", "execution_mode": "step"},
            r"'cache_dit' \(cli\) keeps its cache context for one pipeline call, which --execution-mode is 'step'",
        ),
        (
            {"cache_backend": "cache_dit", "enable_lora": True},
            r"'cache_dit' \(cli\) has not been checked beside --enable-lora True \(cli\)",
        ),
        (
            {"cache_backend": "cache_dit", "cache_config": {"threshold": 0.1}},
            r"key\(s\) threshold .* allowed: Fn_compute_blocks, Bn_compute_blocks, residual_diff_threshold",
        ),
        (  # the engine sets it from each request
            {"cache_backend": "cache_dit", "cache_config": {"num_inference_steps": 8}},
            r"key\(s\) num_inference_steps are not taken",
        ),
    ],
)
def test_refusals_name_each_knob_as_written(knobs, message):
    with pytest.raises(ValueError, match=message):
        resolve_stage_configs(global_knobs=knobs, global_source="cli")


def test_callbacks_are_not_cache_config_keys():
    assert "current_timestep_callback" not in cache_config_keys("pab")
    assert "spatial_attention_block_skip_range" in cache_config_keys("pab")
    assert "cache_type" not in cache_config_keys("cache_dit") and "max_warmup_steps" in cache_config_keys("cache_dit")


def test_cache_dit_resolves_with_one_request_per_call():
    stage = resolve_stage_configs(
        global_knobs={"cache_backend": "cache_dit", "cache_config": {"residual_diff_threshold": 0.2}}
    )[0]
    assert (stage.cache_backend, stage.max_num_seqs, stage.execution_mode) == ("cache_dit", 1, "request")


def test_the_cache_knobs_apply_to_stages_that_denoise_only(tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "stages:\n"
        "  - {stage_id: 0, stage_type: encode, cache_backend: first_block}\n"
        "  - {stage_id: 1, stage_type: denoise, inputs: [0]}\n"
        "  - {stage_id: 2, stage_type: decode, inputs: [1]}\n"
    )
    with pytest.raises(ValueError, match=r"stage 0 \(encode\): cache_backend \(deploy_yaml\) applies to"):
        resolve_stage_configs(deploy)


def test_cache_dit_without_its_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cache_dit", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ValueError, match=r"needs the cache-dit package: pip install 'vllm-omni\[cache-dit\]'"):
        resolve_stage_configs(global_knobs={"cache_backend": "cache_dit"})
