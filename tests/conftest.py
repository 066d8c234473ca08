import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _tiny_model(tmp_path_factory, family: str) -> str:
    from vllm_omni.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    """A tiny random-weight FluxPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "flux")


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory) -> str:
    """A tiny random-weight StableDiffusionPipeline folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "sd")


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> str:
    """A tiny random-weight WanPipeline (text-to-video) folder, built offline once per test session."""
    return _tiny_model(tmp_path_factory, "wan")
