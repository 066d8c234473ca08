"""End to end through `Omni` on real tiny diffusers pipelines loaded with from_pretrained."""

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = ["a photo of a cat", "a red car", "an astronaut riding a horse", "a blue house"]


def _params(size=32, **kw):
    return OmniDiffusionSamplingParams(height=size, width=size, num_inference_steps=4, **kw)


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


@pytest.fixture(scope="module")
def omni(tiny_flux):
    with Omni(model=tiny_flux, max_num_seqs=4, request_batch_max_wait_ms=200) as omni:
        yield omni


def test_four_prompts_run_as_one_batch_of_four(omni):
    outputs = omni.generate(PROMPTS, _params(seed=0))
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        assert output.error is None
        assert output.metrics["batch_size"] == 4
        assert [im.size for im in output.images] == [(32, 32)]
        assert output.metrics["exec_ms"] > 0 and output.metrics["queue_ms"] >= 0
    assert omni.stage_configs[0].max_num_seqs == 4
    assert omni.stage_configs[0].provenance["max_num_seqs"] == "python"


def test_requested_size_and_outputs_per_prompt(omni):
    outputs = omni.generate(PROMPTS[:2], _params(size=64, num_outputs_per_prompt=2, seed=3))
    for output in outputs:
        assert [im.size for im in output.images] == [(64, 64), (64, 64)]
        assert output.metrics["batch_size"] == 2
    first, second = outputs[0].images
    assert np.abs(_pixels(first) - _pixels(second)).max() > 0  # n images of one request differ


def test_same_seed_gives_the_same_image_alone_or_in_a_batch_of_four(omni):
    alone = omni.generate([PROMPTS[2]], _params(seed=1234))[0]
    batched = omni.generate(PROMPTS, [_params(seed=1234 if p == PROMPTS[2] else i) for i, p in enumerate(PROMPTS)])[2]
    assert (alone.metrics["batch_size"], batched.metrics["batch_size"]) == (1, 4)
    assert np.abs(_pixels(alone.images[0]) - _pixels(batched.images[0])).max() <= 2


def test_unseeded_requests_report_their_seed_and_reproduce(omni):
    first = omni.generate([PROMPTS[0]], _params())[0]
    seed = first.metrics["seed"]
    again = omni.generate([PROMPTS[0]], _params(seed=seed))[0]
    assert np.abs(_pixels(first.images[0]) - _pixels(again.images[0])).max() <= 2


def test_a_failing_request_fails_alone(omni, poison_t5):
    """A fault injected into the real T5 encoder: any batch holding the poisoned word raises."""
    poison_t5(omni.engine.stages[0].replicas[0].engine.runner.pipeline, "astronaut")
    outputs = omni.generate(PROMPTS, _params(seed=0))
    failed = [o for o in outputs if o.error]
    assert [o.prompt for o in failed] == [PROMPTS[2]]
    assert "RuntimeError: poisoned prompt" in failed[0].error and failed[0].images == []
    for output in outputs:
        if not output.error:
            assert [im.size for im in output.images] == [(32, 32)]
            assert output.metrics["batch_size"] == 1  # re-run one at a time after the batch failed


def test_bad_sampling_params_fail_before_anything_runs(omni):
    with pytest.raises(ValueError, match="extra_args key 'steps' is not an argument of FluxPipeline"):
        omni.generate(["x"], _params(extra_args={"steps": 3}))
    with pytest.raises(ValueError, match="extra_args may not set 'generator'"):
        omni.generate(["x"], _params(extra_args={"generator": None}))
    with pytest.raises(ValueError, match="got 2 prompts but 1 sampling_params"):
        omni.generate(["x", "y"], [_params()])


def test_extra_args_reach_the_pipeline_and_split_batches(omni):
    outputs = omni.generate(
        PROMPTS, [_params(seed=0, extra_args={"max_sequence_length": 16 if i % 2 else 32}) for i in range(4)]
    )
    assert [o.metrics["batch_size"] for o in outputs] == [2, 2, 2, 2]


def test_deprecated_keyword_warns_at_the_caller_and_batches(tiny_flux):
    with pytest.warns(FutureWarning, match="use max_num_seqs instead") as record:
        omni = Omni(model=tiny_flux, diffusion_batch_size=2, request_batch_max_wait_ms=200)
    try:
        assert record[0].filename == __file__
        stage = omni.stage_configs[0]
        assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (2, "legacy_alias")
        outputs = omni.generate(PROMPTS[:2], _params(seed=0))
        assert [o.metrics["batch_size"] for o in outputs] == [2, 2]
    finally:
        omni.close()


def test_deprecated_keyword_conflict_raises_before_loading(tiny_flux):
    with pytest.raises(ValueError, match=r"diffusion_batch_size=1 and max_num_seqs=4"):
        Omni(model=tiny_flux, max_num_seqs=4, diffusion_batch_size=1)


def test_unknown_keyword_is_a_type_error(tiny_flux):
    with pytest.raises(TypeError, match="unexpected keyword argument\\(s\\) max_batch; stage knobs are: max_num_seqs"):
        Omni(model=tiny_flux, max_batch=4)


def test_deploy_yaml_and_stage_override_reach_the_scheduler(tiny_flux, tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("stages:\n  - stage_id: 0\n    max_num_seqs: 2\n    request_batch_max_wait_ms: 200\n")
    with Omni(model=tiny_flux, deploy_config=deploy, stage_overrides={"0": {"max_num_seqs": 3}}) as omni:
        stage = omni.stage_configs[0]
        assert (stage.max_num_seqs, stage.provenance["max_num_seqs"]) == (3, "stage_override")
        assert stage.provenance["request_batch_max_wait_ms"] == "deploy_yaml"
        assert omni.engine.stages[0].replicas[0].engine.scheduler.capacity == 3
        outputs = omni.generate(PROMPTS, _params(seed=0))
        assert sorted(o.metrics["batch_size"] for o in outputs) == [1, 3, 3, 3]


def test_stable_diffusion_with_negative_prompt_and_cfg(tiny_sd):
    with Omni(model=tiny_sd, max_num_seqs=2, request_batch_max_wait_ms=200) as omni:
        params = _params(size=64, seed=0, guidance_scale=7.5, negative_prompt="blurry", num_outputs_per_prompt=2)
        outputs = omni.generate(PROMPTS[:2], params)
        for output in outputs:
            assert output.error is None and output.metrics["batch_size"] == 2
            assert [im.size for im in output.images] == [(64, 64)] * 2
        alone = omni.generate(PROMPTS[1:2], params)[0]
        for a, b in zip(alone.images, outputs[1].images, strict=True):
            assert np.abs(_pixels(a) - _pixels(b)).max() <= 2


def test_not_a_diffusers_folder(tmp_path):
    with pytest.raises(ValueError, match=r"is a folder but neither a diffusers folder \(model_index.json\) nor"):
        Omni(model=tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a transformers folder: a talker, with codec_model
    with pytest.raises(ValueError, match="is a folder but not a diffusers folder: it has no model_index.json"):
        Omni(model=tmp_path)
