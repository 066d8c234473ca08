"""Stage roles: one per stage type of the deploy graph, and what each owns."""

import pytest

from vllm_omni.config import STAGE_TYPES
from vllm_omni.diffusion.engine.roles import ROLES
from vllm_omni.diffusion.pipeline.components import DENOISERS, TEXT_ENCODERS

DIFFUSERS_STAGE_TYPES = sorted(t for t, spec in STAGE_TYPES.items() if spec.runs == "diffusers")


def test_every_diffusers_stage_type_has_a_role_and_no_role_is_unreachable():
    """The stage types that run a diffusers pipeline have a role here; an llm stage runs on vLLM's engine
    (vllm_omni.orchestrator.llm_replicas) and has none."""
    assert set(ROLES) == set(DIFFUSERS_STAGE_TYPES)
    for stage_type, role in ROLES.items():
        assert role.stage_type == stage_type


@pytest.mark.parametrize("stage_type", DIFFUSERS_STAGE_TYPES)
def test_the_role_that_completes_parameters_is_the_one_that_denoises(stage_type):
    """The stage that holds the denoiser fills in the model's defaults (its config sizes them)."""
    assert ROLES[stage_type].completes_params == STAGE_TYPES[stage_type].denoises


def test_each_split_role_loads_only_what_it_runs():
    assert ROLES["diffusion"].skips == ()
    assert set(ROLES["encode"].skips) == set(DENOISERS)  # the VAE encodes input images
    assert set(ROLES["denoise"].skips) == set(TEXT_ENCODERS)  # the VAE's config sizes the latents
    assert set(ROLES["decode"].skips) == set(TEXT_ENCODERS) | set(DENOISERS)
    assert [t for t, role in ROLES.items() if not role.split] == ["diffusion"]
