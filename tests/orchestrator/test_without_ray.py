"""Without Ray installed, the inline backend serves as before, and asking for replicas fails at start-up with
the install command (Python and CLI). The cases run in turn in one fresh interpreter where ``import ray`` fails
(the refusals first: they must come before anything loads), each marked on stdout and stderr so that each test
reads its own case's output."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

NO_RAY = "import sys; sys.modules['ray'] = None  # `import ray` now raises ImportError, as if it were not installed\n"

CASES = {
    "cli": """
from vllm_omni.entrypoints.cli.main import main
sys.argv = ['vllm-omni', 'serve', MODEL, '--distributed-executor-backend', 'ray']
main()
""",
    "python": """
from vllm_omni import Omni
try:
    Omni(MODEL, num_replicas=2)
except ValueError as exc:
    print(exc)
""",
    "inline": """
from vllm_omni import Omni, OmniDiffusionSamplingParams
with Omni(MODEL, max_num_seqs=2) as omni:
    params = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2)
    out = omni.generate(['a cat', 'a dog'], params)
backend = omni.stage_configs[0].distributed_executor_backend
print([o.error for o in out], [len(o.images) for o in out], backend)
""",
}
"""Each case's code, run with ``MODEL`` set; its exit status is the code of a ``SystemExit`` it raises (else 0)."""

_RUNNER = NO_RAY + (
    "import json\n"
    "MODEL = sys.argv[1]\n"
    "for name, code in json.loads(sys.argv[2]).items():\n"
    "    for stream in (sys.stdout, sys.stderr):\n"
    "        print(f'=== case {name} ===', file=stream, flush=True)\n"
    "    try:\n"
    "        exec(code, {'sys': sys, 'MODEL': MODEL})\n"
    "        status = 0\n"
    "    except SystemExit as exc:\n"
    "        status = exc.code if isinstance(exc.code, int) else 1\n"
    "    sys.stdout.flush(); sys.stderr.flush()\n"
    "    print(f'=== status {status} ===', flush=True)\n"
)


def _split(text: str) -> dict[str, str]:
    parts = text.split("=== case ")
    return {part.split(" ===\n", 1)[0]: part.split(" ===\n", 1)[1] for part in parts[1:]}


@pytest.fixture(scope="module")
def cases(tiny_flux) -> dict[str, tuple[int, str, str]]:
    """Each case's (exit status, stdout, stderr)."""
    import json

    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, tiny_flux, json.dumps(CASES)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    out, err = _split(done.stdout), _split(done.stderr)
    assert list(out) == list(CASES), done.stderr
    results = {}
    for name in CASES:
        stdout, status = out[name].rsplit("=== status ", 1)
        results[name] = (int(status.split(" ===")[0]), stdout, err[name])
    return results


def test_the_inline_backend_serves_without_ray(cases):
    status, stdout, stderr = cases["inline"]
    assert status == 0, stderr
    assert stdout.strip().splitlines()[-1] == "[None, None] [1, 1] inline"


def test_asking_for_replicas_names_the_install_command(cases):
    status, stdout, stderr = cases["python"]
    assert status == 0, stderr
    assert stdout.strip().splitlines()[-1] == (
        "stage 0: num_replicas= 2 (python) needs Ray, which is not installed: pip install 'vllm-omni[ray]'"
    )


def test_the_cli_refuses_replicas_before_loading_anything(cases):
    status, _, stderr = cases["cli"]
    assert status == 2
    assert (
        "stage 0: --distributed-executor-backend 'ray' (cli) needs Ray, which is not installed: "
        "pip install 'vllm-omni[ray]'" in stderr
    )
