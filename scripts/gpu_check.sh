#!/usr/bin/env bash
# gpu_check.sh: everything to run the moment a GPU is lent, in one command (about 5-7 min on an
# H100; a hard budget of 8 min by default).
#
#     scripts/gpu_check.sh                 # every stage, from the project root
#     scripts/gpu_check.sh bench profile   # only these stages (rerun what failed)
#     scripts/gpu_check.sh --dry-run       # on a CPU: each stage's plumbing on the tiny setup
#
# Stages, in order (each with its own timeout, cut to what is left of the budget):
#   env      nvidia-smi and the python / torch / triton / transformers versions
#   install  pip install -e . without dependencies or an index: the machine's torch stays
#   pytest   pytest -m gpu (collects without the serve extras, which the GPU machine lacks)
#   kernels  benchmarks/kernel_bench.py --quick
#   bench    benchmarks/gpu_bench.py --systems on,sync,off,on: both workloads, cache on with steps
#            overlapped (`async_scheduling`) and not, cache off, then
#            on again with Triton's disk cache warm; JIT compiles in timed runs are counted
#   profile  benchmarks/step_profile.py: host time per step phase, replay time per bucket,
#            kernel-time split, the turn-6 prefill
# Logs go to $OUT (default ./gpu-check-out), one per stage; summary lines go to stdout and to
# $OUT/summary.txt. Environment: OUT, GPU_CHECK_BUDGET_S (default 480), PYTHON (python3).
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
        env | install | pytest | kernels | bench | profile) STAGES+=("$arg") ;;
        -h | --help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown stage or option '$arg'" >&2; exit 2 ;;
    esac
done
((${#STAGES[@]})) || STAGES=(env install pytest kernels bench profile)

OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
START=$SECONDS
# Python never sees the repository root on sys.path (-P for every process, pytest workers too):
# transformers would import the top-level kernels/ folder as its hub `kernels` package.
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$HOME/.triton/radixkv-cache}"
unset RADIXKV_VALIDATE_STEPS
((DRY)) || unset TRITON_INTERPRET
FAILED=()

say() { echo "$*" | tee -a "$SUMMARY"; }
wanted() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

# run_stage NAME CAP_S RESERVE_S -- command...: timeout = min(CAP_S, budget left - RESERVE_S)
run_stage() {
    local name=$1 cap=$2 reserve=$3
    shift 4
    local left=$((BUDGET_S - (SECONDS - START) - reserve))
    local limit=$((cap < left ? cap : left))
    local log="$OUT/$name.log"
    if ((limit < 15)); then
        say "$name: SKIPPED, ${left}s of the budget left after reserving ${reserve}s for later stages"
        FAILED+=("$name")
        return
    fi
    echo "=== $name (timeout ${limit}s): $*" >"$log"
    local t0=$SECONDS rc status
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${limit}s"; FAILED+=("$name") ;;
        *) status="FAILED (rc $rc)"; FAILED+=("$name") ;;
    esac
    say "$name: $status in $((SECONDS - t0))s (log: $log)"
}

# Lines of a log worth reading in the summary: tables, headings, goals, errors.
excerpt() { grep -E "$2" "$OUT/$1.log" 2>/dev/null | tail -n "${3:-40}" | tee -a "$SUMMARY"; }

VERSIONS='import sys, torch, triton, transformers
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "transformers", transformers.__version__)
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'

if wanted env; then
    run_stage env 60 0 -- bash -c 'date -u; nproc; nvidia-smi || echo "no nvidia-smi"; "$0" -c "$1"' \
        "$PY" "$VERSIONS"
    excerpt env "^(python|device:)" 2
fi

if wanted install; then
    # --no-deps --no-index: nothing is downloaded; the machine's torch, triton, transformers stay.
    flags=(-q --disable-pip-version-check --no-deps --no-index --no-build-isolation)
    ((DRY)) && flags+=(--dry-run)
    run_stage install 90 330 -- "$PY" -m pip install "${flags[@]}" -e .
    run_stage import 60 330 -- "$PY" -c 'import torch, radixkv.engine, radixkv.kernels as k; print("radixkv.kernels from", k.__file__, "| backend on", "cuda:", k.backend_for(torch.device("cuda")))'
fi

if wanted pytest; then
    if ((DRY)); then
        # What the GPU machine's pytest sees: the extras it lacks are hidden.
        run_stage pytest 240 240 -- env PYTHONPATH=scripts/without_extras \
            "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider
        excerpt pytest "tests collected|error" 3
    else
        args=(-m gpu -q -rs -p no:cacheprovider)
        "$PY" -c 'import xdist' 2>/dev/null && args+=(-n "${PYTEST_WORKERS:-8}")
        run_stage pytest 200 240 -- "$PY" -m pytest "${args[@]}"
        excerpt pytest "^(FAILED|ERROR)|passed|failed" 15
    fi
fi

if wanted kernels; then
    if ((DRY)); then
        run_stage kernels 240 180 -- "$PY" -m pytest -q -p no:cacheprovider \
            tests/kernels/test_kernel_bench_smoke.py
    else
        run_stage kernels 90 180 -- "$PY" benchmarks/kernel_bench.py --quick
        excerpt kernels "^(##|###|torch|device|\|)" 40
    fi
fi

if wanted bench; then
    tiny=()
    ((DRY)) && tiny=(--tiny)
    run_stage bench 270 60 -- "$PY" benchmarks/gpu_bench.py "${tiny[@]}" --systems on,sync,off,on
    excerpt bench "^(##|\|)" 30
fi

if wanted profile; then
    tiny=()
    ((DRY)) && tiny=(--tiny)
    run_stage profile 60 0 -- "$PY" benchmarks/step_profile.py "${tiny[@]}"
    excerpt profile "^(##|LLM|median|bucket|  )" 40
fi

say "total: $((SECONDS - START))s of a ${BUDGET_S}s budget; stages not passed: ${FAILED[*]:-none}"
for name in "${FAILED[@]}"; do
    [[ -f "$OUT/$name.log" ]] || continue
    echo "---- tail of $name.log"
    tail -n 20 "$OUT/$name.log"
done
((${#FAILED[@]} == 0))
