#!/usr/bin/env bash
# gpu_check.sh: everything to run the moment a GPU is lent, in one command (about 5-7 min on an
# H100; a hard budget of 8 min by default).
#
#     scripts/gpu_check.sh                 # every stage, from the project root
#     scripts/gpu_check.sh bench profile   # only these stages (rerun what failed)
#     scripts/gpu_check.sh --dry-run       # on a CPU: each stage's plumbing on the tiny setup
#
# Stages, in order (each with its own timeout, cut to what is left of the budget; the headline
# figures first):
#   env      nvidia-smi and the python / torch / triton / transformers versions
#   install  pip install -e . without dependencies or an index: the machine's torch stays; if
#            that install is refused or not importable, a plain install into a folder put on
#            PYTHONPATH, and failing that the source folders linked there (then `import`).
#            Runs whatever stages are named whenever radixkv cannot be imported: a rerun of a
#            few stages usually lands on a fresh machine.
#   bench    benchmarks/gpu_bench.py --systems on,sync,off,on: both workloads, cache on with steps
#            overlapped (`async_scheduling`) and not, cache off, then
#            on again with Triton's disk cache warm; JIT compiles in timed runs are counted
#   profile  benchmarks/step_profile.py: host time per step phase, replay time per bucket,
#            kernel-time split, the turn-6 prefill
#   pytest   the gpu-marked tests of the files that hold them, each under a timeout
#   kernels  benchmarks/kernel_bench.py --quick (CUDA-graph replays of each kernel and of SDPA;
#            if that fails, again timed from the host)
# Logs go to $OUT (default ./gpu-check-out), one per stage (import writes to install's); summary
# lines and the tail of every failed stage's log go to stdout and to $OUT/summary.txt: at most 7
# files. Environment: OUT, GPU_CHECK_BUDGET_S (default 480), PYTHON (python3).
# --dry-run (no GPU needed): install is pip's --dry-run, pytest collects with the extras hidden
# (scripts/without_extras), kernels runs the kernel bench's CPU smoke test, bench and profile run
# their --tiny configurations.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
DRY=0
STAGES=()
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        env | install | bench | profile | pytest | kernels) STAGES+=("$arg") ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown stage or option '$arg'" >&2; exit 2 ;;
    esac
done
((${#STAGES[@]})) || STAGES=(env install bench profile pytest kernels)

OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
# A plain install (the fallback) goes here, never under $OUT: only 8 files come back from there.
SITE="${GPU_CHECK_SITE:-$PWD/.gpu-check-site}"
: >"$SUMMARY"
for stage in "${STAGES[@]}"; do rm -f "$OUT/$stage.log"; done
START=$SECONDS
# A machine may start this with HOME unset; pip, Triton and torch all want one.
export HOME="${HOME:-$(mktemp -d)}"
# Python never sees the repository root on sys.path (-P for every process, pytest workers too):
# transformers would import the top-level kernels/ folder as its hub `kernels` package.
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/radixkv-cache}"
unset RADIXKV_VALIDATE_STEPS
((DRY)) || unset TRITON_INTERPRET
FAILED=()
[[ -d $SITE ]] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$SUMMARY"; }
wanted() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }
importable() { "$PY" -c 'import radixkv.engine, radixkv.kernels' >/dev/null 2>&1; }

# run_stage NAME CAP_S RESERVE_S -- command...: timeout = min(CAP_S, budget left - RESERVE_S).
# The log is $OUT/NAME.log, or $OUT/$LOG_AS.log when LOG_AS is set (appended to).
run_stage() {
    local name=$1 cap=$2 reserve=$3
    shift 4
    local left=$((BUDGET_S - (SECONDS - START) - reserve))
    local limit=$((cap < left ? cap : left))
    local log="$OUT/${LOG_AS:-$name}.log"
    if ((limit < 15)); then
        say "$name: SKIPPED, ${left}s of the budget left after reserving ${reserve}s for later stages"
        FAILED+=("$name")
        return 1
    fi
    echo "=== $name (timeout ${limit}s): $*" >>"$log"
    local t0=$SECONDS rc status
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s"; FAILED+=("$name") ;;
        *) status="FAILED (rc $rc)"; FAILED+=("$name") ;;
    esac
    say "$name: $status in $((SECONDS - t0))s (log: $log)"
    return $((rc != 0))
}

# Lines of a log worth reading in the summary: tables, headings, goals, errors.
excerpt() { grep -E "$2" "$OUT/$1.log" 2>/dev/null | tail -n "${3:-40}" | tee -a "$SUMMARY"; }

# The source folders linked into $SITE as the package radixkv (kernels/ and scheduler/ inside).
link_packages() {
    rm -rf "$SITE" && mkdir -p "$SITE/radixkv" || return 1
    local entry
    for entry in "$PWD"/radixkv/*; do ln -s "$entry" "$SITE/radixkv/" || return 1; done
    ln -s "$PWD/kernels" "$SITE/radixkv/kernels" && ln -s "$PWD/scheduler" "$SITE/radixkv/scheduler"
}

# The install stages reserve nothing for later ones: every later stage needs radixkv.
install_radixkv() {
    # --no-deps --no-index: nothing is downloaded; the machine's torch, triton, transformers stay.
    local flags=(-q --disable-pip-version-check --no-cache-dir --no-deps --no-index
        --no-build-isolation)
    if ((DRY)); then
        run_stage install 90 0 -- "$PY" -m pip install "${flags[@]}" --dry-run -e .
        return
    fi
    LOG_AS=install run_stage install 90 0 -- "$PY" -m pip install "${flags[@]}" -e .
    if ! importable; then
        say "install: radixkv not importable after the editable install; a plain one into $SITE"
        rm -rf "$SITE"
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        LOG_AS=install run_stage install-plain 90 0 -- \
            "$PY" -m pip install "${flags[@]}" --target "$SITE" .
        if ! importable; then
            say "install: still not importable; the source folders linked into $SITE"
            link_packages >>"$OUT/install.log" 2>&1
        fi
    fi
}

VERSIONS='import sys, torch, triton, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'

if wanted env; then
    run_stage env 60 0 -- bash -c 'date -u; nproc; nvidia-smi || echo "no nvidia-smi"; "$0" -c "$1"' \
        "$PY" "$VERSIONS"
    excerpt env "^(python|device:)" 2
fi

if wanted install || { ((!DRY)) && ! importable; }; then
    wanted install || { say "install: radixkv is not importable here; installing first"; rm -f "$OUT/install.log"; }
    install_radixkv
    LOG_AS=install run_stage import 60 0 -- "$PY" -c 'import torch, radixkv.engine, radixkv.kernels as k; print("radixkv.kernels from", k.__file__, "| backend on", "cuda:", k.backend_for(torch.device("cuda")))'
    excerpt install "^radixkv.kernels from" 1
fi

if wanted bench; then
    tiny=()
    ((DRY)) && tiny=(--tiny)
    run_stage bench 270 120 -- "$PY" benchmarks/gpu_bench.py "${tiny[@]}" --systems on,sync,off,on
    excerpt bench "^(##|\|)" 40
fi

if wanted profile; then
    tiny=()
    ((DRY)) && tiny=(--tiny)
    run_stage profile 75 60 -- "$PY" benchmarks/step_profile.py "${tiny[@]}"
    excerpt profile "^(##|LLM|median|bucket|  )" 80
fi

# The files that hold gpu-marked tests: naming them spares collecting the whole suite.
GPU_TESTS=(tests/engine/test_engine_gpu.py tests/engine/test_host_kv.py
    tests/kernels/test_kernel_gpu.py tests/kernels/test_kernel_recurrent_gpu.py)
if wanted pytest; then
    if ((DRY)); then
        # What the GPU machine's pytest sees: the extras it lacks are hidden.
        run_stage pytest 240 30 -- env PYTHONPATH="scripts/without_extras${PYTHONPATH:+:$PYTHONPATH}" \
            "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${GPU_TESTS[@]}"
        excerpt pytest "tests collected|error" 3
    else
        args=(-m gpu -q -rs -p no:cacheprovider)
        "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout 90)
        "$PY" -c 'import xdist' 2>/dev/null && args+=(-n "${PYTEST_WORKERS:-4}")
        run_stage pytest 200 30 -- "$PY" -m pytest "${args[@]}" "${GPU_TESTS[@]}"
        excerpt pytest "^(FAILED|ERROR)|passed|failed" 15
    fi
fi

if wanted kernels; then
    if ((DRY)); then
        run_stage kernels 240 0 -- "$PY" -m pytest -q -p no:cacheprovider \
            tests/kernels/test_kernel_bench_smoke.py
    else
        # -X faulthandler: a crash inside a driver call prints the Python stack that made it.
        if ! run_stage kernels 150 0 -- "$PY" -X faulthandler benchmarks/kernel_bench.py --quick; then
            LOG_AS=kernels run_stage kernels-host 150 0 -- \
                "$PY" -X faulthandler benchmarks/kernel_bench.py --quick --timing host
        fi
        excerpt kernels "^(##|###|torch|device|\|)" 60
    fi
fi

say "total: $((SECONDS - START))s of a ${BUDGET_S}s budget; stages not passed: ${FAILED[*]:-none}"
for name in "${FAILED[@]}"; do
    log="$OUT/$name.log"
    [[ $name == install-plain || $name == import ]] && log="$OUT/install.log"
    [[ $name == kernels-host ]] && log="$OUT/kernels.log"
    [[ -f $log ]] || continue
    say "---- tail of $(basename "$log") ($name)"
    tail -n 20 "$log" | tee -a "$SUMMARY"
done
((${#FAILED[@]} == 0))
