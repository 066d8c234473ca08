"""No field is silently ignored: for each family, every sampling field the HTTP APIs map onto (and the pipeline
extensions they pass through) either changes the output or is dropped with a warning naming it, the output then the
one the request makes without it (``strict_fields`` refuses it instead: test_omni_ignored_fields)."""

import warnings

import numpy as np
import pytest

from vllm_omni import Omni, OmniDiffusionSamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAMILIES = ("flux", "flux_schnell", "sd", "sdxl", "sd3", "wan")

BASE = {"height": 32, "width": 32, "num_inference_steps": 4, "seed": 0}

VARIANTS = {
    "seed": {"seed": 1},
    "num_inference_steps": {"num_inference_steps": 5},
    "size": {"height": 48, "width": 32},
    "num_outputs_per_prompt": {"num_outputs_per_prompt": 2},
    "guidance_scale": {"guidance_scale": 9.0},
    "negative_prompt": {"negative_prompt": "blurry"},
    "negative_prompt with guidance": {"negative_prompt": "blurry", "guidance_scale": 9.0},
    "true_cfg_scale": {"extra_args": {"true_cfg_scale": 3.0}},
    "true_cfg_scale with negative_prompt": {"negative_prompt": "blurry", "extra_args": {"true_cfg_scale": 3.0}},
    "flow_shift": {"extra_args": {"flow_shift": 1.5}},
}
"""Each field's variant of `BASE` (given the field it needs to act, where it needs one)."""

_NO_TRUE_CFG = {"true_cfg_scale", "true_cfg_scale with negative_prompt"}
IGNORED = {
    # True CFG guides with a negative prompt: each alone would do nothing. (The tiny Flux's scheduler has a fixed
    # shift; FLUX.1's own shifts by image size, and drops flow_shift: test_model_card.)
    "flux": {"negative_prompt", "negative_prompt with guidance", "true_cfg_scale"},
    # No guidance embedding either.
    "flux_schnell": {"guidance_scale", "negative_prompt", "negative_prompt with guidance", "true_cfg_scale"},
    # Not flow matching: no shift.
    "sd": _NO_TRUE_CFG | {"flow_shift"},
    "sdxl": _NO_TRUE_CFG | {"flow_shift"},
    "sd3": _NO_TRUE_CFG,
    "wan": _NO_TRUE_CFG,
}
"""The variants in which each family drops a field it would not use; every other one changes the output."""


def _pixels(output) -> list[np.ndarray]:
    frames = output.videos if output.videos else [[image] for image in output.images]
    return [np.stack([np.asarray(frame, dtype=np.int16) for frame in video]) for video in frames]


@pytest.fixture(scope="module", params=FAMILIES)
def family_omni(request):
    model = request.getfixturevalue(f"tiny_{request.param}")
    with Omni(model=model) as omni:
        yield request.param, omni


def _params(family: str, **fields) -> OmniDiffusionSamplingParams:
    video = {"num_frames": 5} if family == "wan" else {}
    return OmniDiffusionSamplingParams(**{**BASE, **video, **fields})


@pytest.mark.parametrize("name", VARIANTS)
def test_each_field_changes_the_output_or_is_dropped_with_a_warning(family_omni, name):
    family, omni = family_omni
    base = _pixels(omni.generate(["a red fox"], _params(family))[0])
    variant = VARIANTS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = omni.generate(["a red fox"], _params(family, **variant))[0]
    assert output.error is None, output.error
    warned = [str(w.message) for w in caught if " ignored: " in str(w.message)]  # not the libraries' own
    dropped = [field.param for field in output.ignored_fields]
    if dropped:  # each one of the variant's fields, named in one warning, and the output is the one without them
        assert name in IGNORED[family], f"{family}: {name} was dropped: {output.ignored_fields}"
        args = {f"extra_args.{key}" for key in variant.get("extra_args", {})}
        assert set(dropped) <= set(variant) | args, dropped
        assert len(warned) == 1 and all(f"{param} ignored: " in warned[0] for param in dropped), warned
        without = {k: v for k, v in variant.items() if k not in dropped and k != "extra_args"}
        extra = {k: v for k, v in variant.get("extra_args", {}).items() if f"extra_args.{k}" not in dropped}
        alone = omni.generate(["a red fox"], _params(family, **without, extra_args=extra))[0]
        assert not alone.ignored_fields
        assert all(np.array_equal(a, b) for a, b in zip(_pixels(output), _pixels(alone), strict=True))
        return
    assert name not in IGNORED[family], f"{family}: {name} was accepted"
    assert not warned, warned
    varied = _pixels(output)
    changed = len(varied) != len(base) or any(
        a.shape != b.shape or np.abs(a - b).max() > 2 for a, b in zip(varied, base, strict=False)
    )
    assert changed, f"{family}: {name} was accepted and changed nothing"


@pytest.mark.parametrize("family", ["sd3", "wan"])
def test_flow_shift_is_each_requests_own_in_both_modes(family, request):
    """Requests with different shifts batch apart in request mode and share forwards in step mode, each equal to
    itself run alone in request mode."""
    model = request.getfixturevalue(f"tiny_{family}")
    shifts = [None, 1.5, 4.0]
    params = [
        _params(family, seed=i, num_inference_steps=4, extra_args={} if shift is None else {"flow_shift": shift})
        for i, shift in enumerate(shifts)
    ]
    alone = []
    with Omni(model=model) as omni:
        for p in params:
            alone.append(_pixels(omni.generate(["a red fox"], p)[0]))
    for mode in ("request", "step"):
        with Omni(model=model, max_num_seqs=3, execution_mode=mode) as omni:
            outputs = omni.generate(["a red fox"] * 3, params)
        for output, expected in zip(outputs, alone, strict=True):
            assert max(np.abs(a - b).max() for a, b in zip(_pixels(output), expected, strict=True)) <= 2, mode
        if mode == "request":  # the shift is in the batch key
            assert [o.metrics["batch_size"] for o in outputs] == [1, 1, 1]
