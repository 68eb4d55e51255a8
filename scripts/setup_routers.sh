#!/usr/bin/env bash
# Install the cache-aware routers the fleet recipes and tests run for real, each in its own
# virtual environment under $RADIXKV_ROUTERS_DIR (their dependencies pin different pydantic /
# fastapi releases than radixkv's, and none of them may leak into .venv). The default,
# radixkv/routers in the user's cache folder, lies outside the checkout, so every checkout of a
# user shares one install; examples/fleet/fleet.py reads the same variable and default.
#
#   $RADIXKV_ROUTERS_DIR/sglang-router       python -m sglang_router.launch_router
#   $RADIXKV_ROUTERS_DIR/vllm-router         python -m vllm_router.launch_router
#   $RADIXKV_ROUTERS_DIR/ai-dynamo-runtime   python -m dynamo.indexer (Dynamo's KV indexer)
#
# Pinned: a router's worker protocol changes between releases. The three install side by side (a
# couple of minutes on 2 cores, about 550 MB); a venv whose stamp names its pin is skipped.
# `scripts/setup_env.sh --test` runs this; tests that need a router skip when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUTERS_DIR="${RADIXKV_ROUTERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/radixkv/routers}"
mkdir -p "$ROUTERS_DIR"
PYTHON="${PYTHON:-python3}"
PINS=("sglang-router==0.3.2" "vllm-router==0.1.17" "ai-dynamo-runtime==1.6.1")

install_one() {
    local pin="$1" venv="$ROUTERS_DIR/${1%%==*}"
    if [[ -f "$venv/.radixkv-pin" && "$(cat "$venv/.radixkv-pin")" == "$pin" ]]; then
        return 0
    fi
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$pin" 2>&1 \
        | grep -v "is ignored: it is neither a file nor a directory" || true
    "$venv/bin/python" -m pip show --quiet "${pin%%==*}" >/dev/null
    echo "$pin" > "$venv/.radixkv-pin"
    echo "setup: router $pin installed in $venv"
}

pids=()
for pin in "${PINS[@]}"; do
    install_one "$pin" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
exit $status
