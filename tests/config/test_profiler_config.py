"""``--profiler-config`` / ``profiler_config=``: vLLM's own ProfilerConfig, checked for what the diffusion engines
record, without importing vLLM until a value is checked."""

import os

import pytest

from vllm_omni.config.profiler import profiler_config, profiling
from vllm_omni.config.vllm_device import set_device_hint


def test_vllms_config_its_fields_or_json_are_taken_as_vllms_type(tmp_path):
    set_device_hint()  # as a user's process must before importing vllm.config on a CPU host
    from vllm.config import ProfilerConfig

    given = ProfilerConfig(profiler="torch", torch_profiler_dir=str(tmp_path))
    assert profiler_config(given) is given and profiling(given)
    as_dict = profiler_config({"profiler": "torch", "torch_profiler_dir": "traces"})
    assert isinstance(as_dict, ProfilerConfig) and as_dict.torch_profiler_dir == os.path.abspath("traces")
    assert profiler_config('{"profiler": "torch", "torch_profiler_dir": "/t"}').torch_profiler_dir == "/t"
    assert profiler_config(None) is None and not profiling(None) and not profiling(ProfilerConfig())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"profiler": "cuda"}, "profiler 'cuda' is not supported"),
        ({"profiler": "torch", "torch_profiler_dir": "gs://bucket/x"}, "must be a local folder"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "delay_iterations": 2}, "delay_iterations is not supported"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "warmup_iterations": 1}, "warmup_iterations is not"),
        ({"profiler": "torch"}, "torch_profiler_dir must be set"),  # vLLM's own check
    ],
)
def test_what_the_engines_cannot_record_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        profiler_config(fields)
