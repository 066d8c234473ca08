"""The keys of an llm stage (model, engine_args, python_executable, mode, system_prompt, prompt_template, sampling):
every refusal names the key as it was written (deploy YAML, stage_overrides, CLI flag or Python keyword) and what to
do instead; the pipeline knobs are refused on an llm stage and the llm keys on a diffusion stage, while a global flag
just does not reach the stages it does not apply to."""

import re
import sys
import textwrap

import pytest

from vllm_omni.config import resolve_stage_configs
from vllm_omni.config.stage import LLM_KNOBS, PIPELINE_KNOBS
from vllm_omni.config.stage_types import check_stage_graph

PIPELINE_TYPES = "diffusion and encode and denoise and decode stages only"
MAX_NUM_SEQS_OWNER = (
    "engine_args must not set 'max_num_seqs': it is set by the stage's max_num_seqs knob (--max-num-seqs, or "
    "max_num_seqs in the stage's YAML), which goes to vLLM as its max_num_seqs"
)
NOT_EXECUTABLE = (
    "is not an executable file; build the CPU venv with `make llm-cpu-venv` (then .venv-llm-cpu/bin/python), or "
    "leave it unset to run the server's own vLLM"
)


def _deploy(tmp_path, llm: str = ", model: /models/llm", diffusion: str = "") -> str:
    """An llm stage 0 writing the prompt of diffusion stage 1, with extra flow-mapping entries for each."""
    path = tmp_path / "deploy.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            stages:
              - {{stage_id: 0, stage_type: llm{llm}}}
              - {{stage_id: 1, stage_type: diffusion, inputs: [0]{diffusion}}}
            """
        )
    )
    return str(path)


def _llm(extra: str = "") -> str:
    return ", model: /models/llm" + extra


def _refused(deploy, message: str, **kwargs) -> str:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        resolve_stage_configs(deploy, **kwargs)
    return str(info.value)


def _fields_listed(error: str) -> set[str]:
    return set(re.search(r"\(fields: (.*)\)$", error).group(1).split(", "))


# A valid deploy.


def test_a_valid_llm_then_diffusion_deploy_resolves_with_provenance(tmp_path):
    deploy = _deploy(
        tmp_path,
        _llm(", max_num_seqs: 4, engine_args: {dtype: float32}, sampling: {temperature: 0.5, max_tokens: 16}"),
    )
    llm, diffusion = resolve_stage_configs(deploy)
    assert (llm.stage_id, llm.stage_type, diffusion.stage_id, diffusion.inputs) == (0, "llm", 1, (0,))
    assert (llm.max_num_seqs, llm.provenance["max_num_seqs"]) == (4, "deploy_yaml")
    assert (llm.distributed_executor_backend, llm.provenance["distributed_executor_backend"]) == ("ray", "default")
    assert (diffusion.distributed_executor_backend, diffusion.max_num_seqs) == ("inline", 1)
    assert llm.model == "/models/llm" and llm.provenance["model"] == "deploy_yaml"
    assert llm.engine_args == {"dtype": "float32"}
    assert llm.sampling == {"temperature": 0.5, "max_tokens": 16}
    assert (llm.mode, llm.system_prompt, llm.prompt_template, llm.python_executable) == ("chat", None, None, None)


def test_the_llm_stage_comes_first_in_request_order_even_when_listed_last(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "stages:\n"
        "  - {stage_id: 0, stage_type: diffusion, inputs: [1]}\n"
        "  - {stage_id: 1, stage_type: llm, model: /models/llm}\n"
    )
    stages = resolve_stage_configs(str(path))
    assert [(s.stage_id, s.stage_type) for s in check_stage_graph(stages)] == [(1, "llm"), (0, "diffusion")]


def test_a_global_cli_max_num_seqs_reaches_the_llm_stage(tmp_path):
    llm, diffusion = resolve_stage_configs(_deploy(tmp_path), global_knobs={"max_num_seqs": 3}, global_source="cli")
    assert (llm.max_num_seqs, llm.provenance["max_num_seqs"]) == (3, "cli")
    assert (diffusion.max_num_seqs, diffusion.provenance["max_num_seqs"]) == (3, "cli")
    assert "max_num_seqs=3 (cli)" in llm.describe()


def test_a_global_scheduling_policy_reaches_every_stage_the_llm_stage_too(tmp_path):
    stages = resolve_stage_configs(_deploy(tmp_path), global_knobs={"scheduling_policy": "priority"})
    assert [(s.scheduling_policy, s.provenance["scheduling_policy"]) for s in stages] == [("priority", "python")] * 2


def test_a_stage_override_of_max_num_seqs_beats_the_global_flag_on_the_llm_stage(tmp_path):
    llm, diffusion = resolve_stage_configs(
        _deploy(tmp_path, _llm(", max_num_seqs: 2")),
        global_knobs={"max_num_seqs": 3},
        global_source="cli",
        stage_overrides={"0": {"max_num_seqs": 8}},
    )
    assert (llm.max_num_seqs, llm.provenance["max_num_seqs"]) == (8, "stage_override")
    assert (diffusion.max_num_seqs, diffusion.provenance["max_num_seqs"]) == (3, "cli")


@pytest.mark.parametrize("source", ["cli", "python"])
def test_a_global_request_batch_max_wait_ms_skips_the_llm_stage_and_reaches_the_diffusion_stage(tmp_path, source):
    llm, diffusion = resolve_stage_configs(
        _deploy(tmp_path), global_knobs={"request_batch_max_wait_ms": 20}, global_source=source
    )
    assert "request_batch_max_wait_ms" not in llm.applied_knobs()
    assert llm.provenance["request_batch_max_wait_ms"] == "default"
    assert diffusion.applied_knobs()["request_batch_max_wait_ms"] == (20.0, source)
    assert "request_batch_max_wait_ms" not in llm.describe()


@pytest.mark.parametrize(
    ("knobs", "absent"),
    [
        ({"dtype": "float16", "vae_tiling": True}, ("dtype", "vae_tiling")),
        ({"execution_mode": "step"}, ("execution_mode",)),
        ({"max_loras": 2, "enable_lora": True}, ("enable_lora", "max_loras")),
    ],
)
def test_other_global_diffusion_knobs_skip_the_llm_stage(tmp_path, knobs, absent):
    llm, diffusion = resolve_stage_configs(_deploy(tmp_path), global_knobs=knobs, global_source="python")
    for knob in absent:
        assert knob not in llm.applied_knobs()
        assert llm.provenance[knob] == "default"
        assert diffusion.applied_knobs()[knob] == (knobs[knob], "python")


def test_describe_of_the_llm_stage_lists_the_llm_keys_and_not_the_pipeline_knobs(tmp_path):
    llm, diffusion = resolve_stage_configs(
        _deploy(tmp_path, _llm(", mode: completion, prompt_template: 'Describe: {prompt}'"))
    )
    line = llm.describe()
    assert line.startswith("stage 0 (llm): max_num_seqs=1 (default)")
    for knob in LLM_KNOBS:
        assert f"{knob}=" in line, knob
    assert "prompt_template='Describe: {prompt}' (deploy_yaml)" in line
    assert "distributed_executor_backend='ray' (default)" in line
    for knob in (*PIPELINE_KNOBS, "execution_mode", "enable_lora", "compile", "cache_backend"):
        assert f"{knob}=" not in line, knob
    assert set(LLM_KNOBS) <= set(llm.applied_knobs())
    assert not set(LLM_KNOBS) & set(diffusion.applied_knobs())
    assert not any(f"{knob}=" in diffusion.describe() for knob in ("engine_args", "sampling", "python_executable"))


@pytest.mark.parametrize(
    "extra",
    [
        ", mode: completion",
        ", mode: completion, prompt_template: 'Rewrite {prompt} vividly, in {{braces}}'",
        ", mode: chat, system_prompt: 'Rewrite the prompt vividly.'",
    ],
)
def test_valid_prompt_keys_of_each_mode_resolve(tmp_path, extra):
    llm, _ = resolve_stage_configs(_deploy(tmp_path, _llm(extra)))
    assert llm.provenance["mode"] == "deploy_yaml"


def test_python_executable_that_is_an_executable_file_is_taken(tmp_path):
    llm, _ = resolve_stage_configs(_deploy(tmp_path, _llm(f", python_executable: {sys.executable}")))
    assert (llm.python_executable, llm.provenance["python_executable"]) == (sys.executable, "deploy_yaml")


# engine_args and sampling: vLLM's own fields, none the stage sets itself.


def test_max_num_seqs_in_engine_args_is_refused_naming_the_stage_knob(tmp_path):
    deploy = _deploy(tmp_path, _llm(", engine_args: {max_num_seqs: 4}"))
    _refused(deploy, f"invalid engine_args in stage 0 of {deploy}: {MAX_NUM_SEQS_OWNER}")


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("model", "the stage's model key"),
        (
            "scheduling_policy",
            "the stage's scheduling_policy knob (--scheduling-policy, or scheduling_policy in the stage's YAML), which "
            "goes to vLLM as its scheduling_policy",
        ),
        (
            "disable_log_stats",
            "nothing: the stage's metrics (vllm_omni:batch_num_requests) come from vLLM's scheduler stats, so they "
            "stay on",
        ),
        (
            "enable_logging_iteration_details",
            "nothing: the stage's batch metric (vllm_omni:batch_num_requests) reads the sequences of each engine "
            "step from them, so they stay on",
        ),
    ],
)
def test_engine_args_the_stage_sets_itself_are_refused_naming_what_sets_them(tmp_path, key, owner):
    deploy = _deploy(tmp_path, _llm(f", engine_args: {{{key}: x}}"))
    _refused(
        deploy, f"invalid engine_args in stage 0 of {deploy}: engine_args must not set {key!r}: it is set by {owner}"
    )


def test_engine_args_that_is_not_a_mapping_is_refused(tmp_path):
    deploy = _deploy(tmp_path, _llm(", engine_args: [dtype]"))
    _refused(
        deploy,
        f"invalid engine_args in stage 0 of {deploy}: engine_args must be a mapping of vLLM EngineArgs fields to "
        "values, got ['dtype']",
    )


@pytest.mark.parametrize(
    ("key", "owner"),
    [
        ("seed", "the request's seed (drawn when it gives none), so that a re-run makes the same prompt"),
        ("n", "nothing: the stage makes one revised prompt per request"),
        ("output_kind", "nothing: the stage reads each request's final output"),
    ],
)
def test_sampling_keys_the_stage_sets_per_request_are_refused(tmp_path, key, owner):
    deploy = _deploy(tmp_path, _llm(f", sampling: {{{key}: 2}}"))
    _refused(deploy, f"invalid sampling in stage 0 of {deploy}: sampling must not set {key!r}: it is set by {owner}")


@pytest.mark.parametrize(
    ("knob", "written", "unknown", "owner", "allowed", "owned"),
    [
        (
            "engine_args",
            "{max_num_sequences: 4, dtype: float32}",
            "max_num_sequences",
            "EngineArgs",
            {"dtype", "max_model_len", "enforce_eager"},
            {"max_num_seqs", "model", "disable_log_stats", "enable_logging_iteration_details"},
        ),
        (
            "sampling",
            "{temprature: 0.5, max_tokens: 8}",
            "temprature",
            "SamplingParams",
            {"temperature", "max_tokens", "top_p", "min_tokens"},
            {"seed", "n", "output_kind"},
        ),
    ],
)
def test_an_unknown_key_is_refused_by_name_listing_the_fields_allowed(
    tmp_path, knob, written, unknown, owner, allowed, owned
):
    deploy = _deploy(tmp_path, _llm(f", {knob}: {written}"))
    error = _refused(
        deploy,
        f"invalid {knob} in stage 0 of {deploy}: {knob} has unknown key(s) '{unknown}': not fields of vLLM's "
        f"{owner} (fields: ",
    )
    fields = _fields_listed(error)
    assert allowed <= fields
    assert not owned & fields  # the stage sets those


@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("engine_args", {"max_num_seqs": 4}, MAX_NUM_SEQS_OWNER),
        ("engine_args", {"no_such_arg": 1}, "engine_args has unknown key(s) 'no_such_arg'"),
        ("sampling", {"seed": 1}, "sampling must not set 'seed'"),
        ("sampling", {"no_such_param": 1}, "sampling has unknown key(s) 'no_such_param'"),
    ],
)
def test_engine_args_and_sampling_are_refused_in_stage_overrides_too(tmp_path, knob, value, message):
    _refused(
        _deploy(tmp_path),
        f"invalid value in stage_overrides for stage 0: {knob} {value!r}: Value error, {message}",
        stage_overrides={0: {knob: value}},
    )


def test_engine_args_given_as_a_python_keyword_are_refused_naming_the_keyword(tmp_path):
    _refused(
        _deploy(tmp_path),
        f"invalid value in the Omni arguments: engine_args= {{'max_num_seqs': 4}}: Value error, {MAX_NUM_SEQS_OWNER}",
        global_knobs={"engine_args": {"max_num_seqs": 4}},
        global_source="python",
    )


def test_sampling_given_as_a_python_keyword_is_refused_naming_it(tmp_path):
    _refused(
        _deploy(tmp_path),
        "invalid value in the Omni arguments: sampling= {'n': 2}: Value error, sampling must not set 'n'",
        global_knobs={"sampling": {"n": 2}},
        global_source="python",
    )


def test_omni_refuses_bad_engine_args_before_loading_anything(tmp_path):
    from vllm_omni import Omni

    with pytest.raises(ValueError, match=re.escape(MAX_NUM_SEQS_OWNER)):
        Omni(str(tmp_path / "no-model"), deploy_config=_deploy(tmp_path), engine_args={"max_num_seqs": 4})


# Knobs of diffusers pipelines on an llm stage, and llm keys on a diffusion stage.


@pytest.mark.parametrize(
    ("yaml", "layer"),
    [
        (_llm(", request_batch_max_wait_ms: 5"), {}),
        (_llm(), {"stage_overrides": {"0": {"request_batch_max_wait_ms": 5}}}),
    ],
    ids=["deploy_yaml", "stage_override"],
)
def test_request_batch_max_wait_ms_on_an_llm_stage_is_refused(tmp_path, yaml, layer):
    source = "stage_override" if layer else "deploy_yaml"
    _refused(
        _deploy(tmp_path, yaml),
        f"stage 0 (llm): request_batch_max_wait_ms ({source}) applies to {PIPELINE_TYPES} (an llm stage leaves "
        "batching to vLLM); remove it",
        **layer,
    )


@pytest.mark.parametrize(
    ("knob", "value", "types"),
    [
        ("execution_mode", "step", "diffusion and denoise stages only"),
        ("compile", "regional", "diffusion and denoise stages only"),
        ("cache_backend", "first_block", "diffusion and denoise stages only"),
        ("enable_lora", "true", "diffusion stages only"),
        ("dtype", "float16", PIPELINE_TYPES),
        ("vae_tiling", "true", PIPELINE_TYPES),
        ("vae_slicing", "true", PIPELINE_TYPES),
        ("devices", "'0'", PIPELINE_TYPES),
        ("cpu_offload", "model", PIPELINE_TYPES),
        ("max_batch_pixels", "4096", PIPELINE_TYPES),
    ],
)
def test_diffusion_knobs_on_an_llm_stage_are_refused_naming_the_knob(tmp_path, knob, value, types):
    error = _refused(
        _deploy(tmp_path, _llm(f", {knob}: {value}")),
        f"stage 0 (llm): {knob} (deploy_yaml) applies to {types}",
    )
    assert error.endswith("; remove it")


def test_a_pipeline_knob_on_an_llm_stage_is_refused_in_stage_overrides(tmp_path):
    error = _refused(
        _deploy(tmp_path),
        f"stage 0 (llm): dtype (stage_override) applies to {PIPELINE_TYPES}",
        stage_overrides={0: {"dtype": "float16"}},
    )
    assert error.endswith("; remove it")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("model", "/models/other"),
        ("engine_args", "{dtype: float32}"),
        ("sampling", "{temperature: 0.5}"),
        ("mode", "completion"),
        ("system_prompt", "hi"),
        ("prompt_template", "'{prompt}'"),
        ("python_executable", sys.executable),
    ],
)
def test_llm_keys_on_a_diffusion_stage_are_refused(tmp_path, key, value):
    _refused(
        _deploy(tmp_path, diffusion=f", {key}: {value}"),
        f"stage 1 (diffusion): {key} (deploy_yaml) applies to llm{' and codec' if key == 'model' else ''} stages "
        "only; remove it",
    )


def test_an_llm_key_on_a_diffusion_stage_is_refused_in_stage_overrides(tmp_path):
    _refused(
        _deploy(tmp_path),
        "stage 1 (diffusion): sampling (stage_override) applies to llm stages only; remove it",
        stage_overrides={"1": {"sampling": {"temperature": 0.5}}},
    )


def test_llm_keys_on_a_deploy_without_llm_stage_are_refused(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  - {stage_id: 0, model: /models/llm}\n")
    _refused(str(path), "stage 0 (diffusion): model (deploy_yaml) applies to llm and codec stages only; remove it")


# The keys of an llm stage together.


@pytest.mark.parametrize("llm", ["", ", model: ''", ", model: null"], ids=["missing", "empty", "null"])
def test_an_llm_stage_without_model_is_refused(tmp_path, llm):
    _refused(_deploy(tmp_path, llm), "stage 0 (llm): model is required: the LLM's folder or Hugging Face repo id")


@pytest.mark.parametrize(
    ("kwargs", "written"),
    [
        ({}, "distributed_executor_backend 'inline' (deploy_yaml)"),
        (
            {"global_knobs": {"distributed_executor_backend": "inline"}, "global_source": "cli"},
            "--distributed-executor-backend 'inline' (cli)",
        ),
    ],
    ids=["deploy_yaml", "cli"],
)
def test_an_inline_backend_on_an_llm_stage_is_refused(tmp_path, kwargs, written):
    llm = _llm(", distributed_executor_backend: inline") if not kwargs else _llm()
    _refused(
        _deploy(tmp_path, llm),
        f"stage 0 (llm): {written}: an llm stage's replicas are Ray actors (vLLM's engine runs in a process of its "
        "own); set it to 'ray' or leave it unset",
        **kwargs,
    )


def test_an_explicit_ray_backend_on_an_llm_stage_is_taken(tmp_path):
    llm, _ = resolve_stage_configs(_deploy(tmp_path, _llm(", distributed_executor_backend: ray")))
    assert llm.applied_knobs()["distributed_executor_backend"] == ("ray", "deploy_yaml")


@pytest.mark.parametrize(
    ("extra", "mode"),
    [
        (", prompt_template: 'x {prompt}'", "mode 'chat' (default)"),
        (", mode: chat, prompt_template: 'x {prompt}'", "mode 'chat' (deploy_yaml)"),
    ],
)
def test_prompt_template_in_chat_mode_is_refused(tmp_path, extra, mode):
    _refused(
        _deploy(tmp_path, _llm(extra)),
        f"stage 0 (llm): prompt_template 'x {{prompt}}' (deploy_yaml) is for mode 'completion', but {mode}: in chat "
        "mode the tokenizer's chat template frames the prompt (with system_prompt); remove prompt_template or set "
        "mode to 'completion'",
    )


def test_prompt_template_given_as_a_python_keyword_in_chat_mode_is_refused_naming_the_keyword(tmp_path):
    _refused(
        _deploy(tmp_path),
        "stage 0 (llm): prompt_template= 'x {prompt}' (python) is for mode 'completion', but mode 'chat' (default)",
        global_knobs={"prompt_template": "x {prompt}"},
        global_source="python",
    )


@pytest.mark.parametrize(
    ("llm", "kwargs", "written"),
    [
        (_llm(", mode: completion, system_prompt: hi"), {}, "system_prompt 'hi' (deploy_yaml)"),
        (
            _llm(", mode: completion"),
            {"stage_overrides": {0: {"system_prompt": "hi"}}},
            "system_prompt 'hi' (stage_override)",
        ),
    ],
)
def test_system_prompt_in_completion_mode_is_refused(tmp_path, llm, kwargs, written):
    _refused(
        _deploy(tmp_path, llm),
        f"stage 0 (llm): {written} is for mode 'chat', but mode 'completion' (deploy_yaml): put the instructions "
        "into prompt_template, or set mode to 'chat'",
        **kwargs,
    )


@pytest.mark.parametrize(
    "template",
    [
        "no field at all",
        "{{prompt}}",  # a literal brace pair, not the field
        "{prompt} in {style}",
        "{prompt} {0}",
        "{}",
        "{prompt} {",
        "{prompt}}",
        "{prompt!r}",
    ],
)
def test_a_prompt_template_without_prompt_or_with_another_field_is_refused(tmp_path, template):
    deploy = _deploy(tmp_path, _llm(f", mode: completion, prompt_template: {template!r}"))
    _refused(
        deploy,
        f"stage 0 (llm): prompt_template {template!r} (deploy_yaml) must contain {{prompt}} (where the request's "
        "prompt goes) and no other {field}; write a literal brace as {{ or }}",
    )


def test_a_prompt_template_with_an_attribute_of_prompt_is_refused_as_a_value_error(tmp_path):
    deploy = _deploy(tmp_path, _llm(", mode: completion, prompt_template: '{prompt.title_case}'"))
    _refused(deploy, "prompt_template '{prompt.title_case}' (deploy_yaml) must contain {prompt}")


def _not_executable(tmp_path) -> str:
    path = tmp_path / "python.txt"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o644)
    return str(path)


@pytest.mark.parametrize(
    "make_path",
    [lambda tmp_path: str(tmp_path / "no" / "python"), lambda tmp_path: str(tmp_path), _not_executable],
    ids=["missing", "folder", "not-executable"],
)
def test_a_python_executable_that_is_not_an_executable_file_is_refused(tmp_path, make_path):
    executable = make_path(tmp_path)
    _refused(
        _deploy(tmp_path, _llm(f", python_executable: {executable}")),
        f"stage 0 (llm): python_executable {executable!r} (deploy_yaml) {NOT_EXECUTABLE}",
    )


@pytest.mark.parametrize(
    ("kwargs", "written"),
    [
        (
            {"stage_overrides": {0: {"python_executable": "/no/python"}}},
            "python_executable '/no/python' (stage_override)",
        ),
        (
            {"global_knobs": {"python_executable": "/no/python"}, "global_source": "python"},
            "python_executable= '/no/python' (python)",
        ),
    ],
    ids=["stage_override", "python"],
)
def test_a_python_executable_that_is_not_executable_is_refused_at_every_layer(tmp_path, kwargs, written):
    _refused(_deploy(tmp_path), f"stage 0 (llm): {written} {NOT_EXECUTABLE}", **kwargs)


def test_a_global_python_executable_reaches_the_llm_stage_only(tmp_path):
    llm, diffusion = resolve_stage_configs(
        _deploy(tmp_path), global_knobs={"python_executable": sys.executable}, global_source="python"
    )
    assert llm.applied_knobs()["python_executable"] == (sys.executable, "python")
    assert diffusion.python_executable is None and "python_executable" not in diffusion.applied_knobs()


def test_an_unknown_mode_is_refused_naming_the_modes(tmp_path):
    deploy = _deploy(tmp_path, _llm(", mode: instruct"))
    _refused(deploy, f"invalid mode='instruct' in stage 0 of {deploy}: Input should be 'chat', 'completion' or 'tts'")
