"""`import vllm_omni` and `import vllm_omni.config` stay light: the CLI's argument checks, the deploy YAML loader and
the unit tests use them without paying for torch, diffusers and vLLM (seconds each to import)."""

import subprocess
import sys

import vllm_omni

HEAVY = ("torch", "diffusers", "vllm")


def test_the_package_and_its_config_import_no_heavy_stack():
    # A fresh interpreter: this one has imported the stack for other tests.
    probe = f"import sys, vllm_omni, vllm_omni.config; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_every_public_name_resolves_on_use():
    assert set(vllm_omni.__all__) == {*vllm_omni._PUBLIC, "__version__"}  # the lazy table and __all__ agree
    for name in vllm_omni.__all__:
        value = getattr(vllm_omni, name)
        assert name == "__version__" or value.__name__ == name
    assert set(vllm_omni.__all__) <= set(dir(vllm_omni))
