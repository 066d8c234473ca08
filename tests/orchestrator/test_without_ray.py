"""Without Ray installed, the inline backend serves as before, and asking for replicas fails at start-up with
the install command (Python and CLI). Each case runs in a fresh interpreter where ``import ray`` fails."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

NO_RAY = "import sys; sys.modules['ray'] = None  # `import ray` now raises ImportError, as if it were not installed\n"


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_RAY + code, *args], capture_output=True, text=True, timeout=300)


def test_the_inline_backend_serves_without_ray(tiny_flux):
    done = _run(
        "from vllm_omni import Omni, OmniDiffusionSamplingParams\n"
        "with Omni(sys.argv[1], max_num_seqs=2) as omni:\n"
        "    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2)\n"
        "    out = omni.generate(['a cat', 'a dog'], params)\n"
        "backend = omni.stage_configs[0].distributed_executor_backend\n"
        "print([o.error for o in out], [len(o.images) for o in out], backend)\n",
        tiny_flux,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[None, None] [1, 1] inline"


def test_asking_for_replicas_names_the_install_command(tiny_flux):
    done = _run(
        "from vllm_omni import Omni\n"
        "try:\n"
        "    Omni(sys.argv[1], num_replicas=2)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n",
        tiny_flux,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "stage 0: num_replicas= 2 (python) needs Ray, which is not installed: pip install 'vllm-omni[ray]'"
    )


def test_the_cli_refuses_replicas_before_loading_anything(tiny_flux):
    done = _run(
        "from vllm_omni.entrypoints.cli.main import main\n"
        "sys.argv = ['vllm-omni', 'serve', sys.argv[1], '--distributed-executor-backend', 'ray']\n"
        "main()\n",
        tiny_flux,
    )
    assert done.returncode == 2
    assert (
        "stage 0: --distributed-executor-backend 'ray' (cli) needs Ray, which is not installed: "
        "pip install 'vllm-omni[ray]'" in done.stderr
    )
