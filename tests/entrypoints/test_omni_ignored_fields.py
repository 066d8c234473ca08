"""The Python API's choice for a field the model would not use (``true_cfg_scale`` without a negative prompt, on
Flux): by default `Omni` and `AsyncOmni` drop it with a ``UserWarning`` that points at the caller and one log line,
list it in the output's ``ignored_fields``, and make what the request makes without it; ``strict_fields=True``
refuses it with the `SamplingParamsError` naming it, as the HTTP server's ``--strict-fields`` does."""

import asyncio
import logging
import warnings

import numpy as np
import pytest

from vllm_omni import AsyncOmni, IgnoredField, Omni, OmniDiffusionSamplingParams, SamplingParamsError

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FAST = {"height": 32, "width": 32, "num_inference_steps": 2, "seed": 3, "output_type": "np"}
PLAIN = OmniDiffusionSamplingParams(**FAST)
UNUSED = OmniDiffusionSamplingParams(**FAST, extra_args={"true_cfg_scale": 4.0})
"""True CFG without a negative prompt: Flux would not use it."""
REASON = "true_cfg_scale=4 does nothing on FluxPipeline without a negative_prompt"


def test_omni_drops_the_field_with_a_warning_and_strict_fields_refuses_it(tiny_flux, caplog):
    with Omni(model=tiny_flux) as omni:
        (plain,) = omni.generate("a fox", PLAIN)
        with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match=REASON) as caught:
            (output,) = omni.generate("a fox", UNUSED)
        assert [w.filename for w in caught if REASON in str(w.message)] == [__file__]  # the caller's line
        logged = [r.getMessage() for r in caplog.records if "extra_args.true_cfg_scale ignored: " in r.getMessage()]
        assert len(logged) == 1 and output.request_id in logged[0]
        (field,) = output.ignored_fields
        assert isinstance(field, IgnoredField) and field.param == "extra_args.true_cfg_scale"
        assert field.reason.startswith(REASON) and plain.ignored_fields == []
        assert np.array_equal(np.asarray(output.images), np.asarray(plain.images))  # the image without it
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # admit lists the field for its caller, who reports it
            assert omni.admit(UNUSED).ignored == (field,)
    with Omni(model=tiny_flux, strict_fields=True) as strict:
        with pytest.raises(SamplingParamsError) as refused:
            strict.generate("a fox", UNUSED)
        assert (refused.value.param, str(refused.value)) == (field.param, field.reason)
        (again,) = strict.generate("a fox", PLAIN)
        assert np.array_equal(np.asarray(again.images), np.asarray(plain.images))


def test_async_omni_takes_the_same_choice(tiny_flux):
    async def run(strict: bool) -> list:
        async with AsyncOmni(model=tiny_flux, strict_fields=strict) as omni:
            return [output async for output in omni.generate("a fox", UNUSED)]

    with pytest.warns(UserWarning, match=REASON) as caught:
        (output,) = asyncio.run(run(False))
    assert [w.filename for w in caught if REASON in str(w.message)] == [__file__]
    assert [field.param for field in output.ignored_fields] == ["extra_args.true_cfg_scale"]
    with pytest.raises(SamplingParamsError) as refused:
        asyncio.run(run(True))
    assert refused.value.param == "extra_args.true_cfg_scale" and str(refused.value).startswith(REASON)
