#!/usr/bin/env bash
# gpu_check.sh: everything to run the moment a GPU is lent, in one command (about 7-8 min on an
# H200; a hard budget of 500 s by default: call it with a timeout of the budget + 60 s).
#
#     scripts/gpu_check.sh                 # every stage, from the project root
#     scripts/gpu_check.sh bench profile   # only these stages (rerun what failed)
#     scripts/gpu_check.sh --dry-run       # on a CPU: each stage's plumbing on the tiny setup
#
# Carry .peers/ (python3 -P benchmarks/peer_kernels.py fetch, where pip reaches the index): the
# kernels stage times vLLM's and SGLang's kernels from it, and says so when it is missing.
#
# Stages, in order (each with its own timeout, cut to what is left of the budget after what the
# later stages reserve; the headline figures and the peers' table first), with what each took or
# is expected to take on an H200:
#   env      nvidia-smi and the python / torch / triton / transformers versions (~10 s)
#   install  pip install -e . without dependencies or an index: the machine's torch stays; if
#            that install is refused or not importable, a plain install into a folder put on
#            PYTHONPATH, and failing that the source folders linked there (then `import`).
#            Runs whatever stages are named whenever radixkv cannot be imported: a rerun of a
#            few stages usually lands on a fresh machine (~10 s)
#   bench    benchmarks/gpu_bench.py --systems on,sync,off,on: both workloads, cache on with steps
#            overlapped (`async_scheduling`) and not, cache off, then on again with Triton's disk
#            cache warm; each figure beside its roofline share; JIT compiles in timed runs
#            counted (~60 s)
#   kernels  benchmarks/kernel_bench.py --quick: radixkv's decode and extend beside vLLM's,
#            SGLang's and SDPA at the engine's shapes first, then the split, decode-tile and
#            extend-tile sweeps, then the goals; it stops measuring when its share of the budget
#            is spent. If it dies, again timed from the host, resuming: what printed is
#            reprinted, what was in flight is retried last (~180 s)
#   pytest   the gpu-marked tests of the files that hold them (GPU_TESTS), then the files whose
#            tests run on CUDA whenever it is there (CUDA_TESTS), each under a timeout (~120 s)
#   profile  benchmarks/step_profile.py: host time per step phase, replay time per bucket,
#            kernel-time split, the turn-6 prefill, each against its roofline (~25 s)
#   hf       benchmarks/gpu_bench.py --systems on,batch,generate: transformers' continuous
#            batching (one manager for the system's calls) and `generate` beside radixkv; its
#            log is bench's (~60 s)
# Logs go to $OUT (default ./gpu-check-out), one per stage (import writes to install's, hf to
# bench's, the fallbacks to their stage's); summary lines and the tail of every failed stage's
# log go to stdout and to $OUT/summary.txt: at most 7 files. Environment: OUT, GPU_CHECK_BUDGET_S
# (default 500), PYTHON (python3).
# --dry-run (no GPU needed): install is pip's --dry-run, pytest collects with the extras hidden
# (scripts/without_extras), kernels runs the kernel bench's --tiny sections under the Triton
# interpreter (the peers' kernels too where .peers/ is here), bench, hf and profile run their
# --tiny configurations.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
DRY=0
STAGES=()
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        env | install | bench | kernels | pytest | profile | hf) STAGES+=("$arg") ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown stage or option '$arg'" >&2; exit 2 ;;
    esac
done
((${#STAGES[@]})) || STAGES=(env install bench kernels pytest profile hf)

OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
BUDGET_S="${GPU_CHECK_BUDGET_S:-500}"
PY="${PYTHON:-python3}"
SUMMARY="$OUT/summary.txt"
# A plain install (the fallback) goes here, never under $OUT: only 8 files come back from there.
SITE="${GPU_CHECK_SITE:-$PWD/.gpu-check-site}"
# The kernel bench's record of its points, for the host-timed fallback to resume from.
STATE="${GPU_CHECK_STATE:-$PWD/.gpu-check-state}"
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

# stage_limit CAP_S RESERVE_S: min(CAP_S, budget left - RESERVE_S), the seconds a stage may run.
stage_limit() {
    local left=$((BUDGET_S - (SECONDS - START) - $2))
    echo $(($1 < left ? $1 : left))
}

# run_stage NAME CAP_S RESERVE_S -- command...: the command under timeout `stage_limit`.
# The log is $OUT/NAME.log, or $OUT/$LOG_AS.log when LOG_AS is set (appended to).
run_stage() {
    local name=$1 cap=$2 reserve=$3
    shift 4
    local limit
    limit=$(stage_limit "$cap" "$reserve")
    local log="$OUT/${LOG_AS:-$name}.log"
    if ((limit < 15)); then
        say "$name: SKIPPED, $((BUDGET_S - (SECONDS - START)))s of the budget left after reserving ${reserve}s for later stages"
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

TINY=()
((DRY)) && TINY=(--tiny)
# What gpu_bench's tables and per-system lines look like.
BENCH_LINES="^(##|\||- |ceilings|systems that failed)"

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
    run_stage bench 150 330 -- "$PY" benchmarks/gpu_bench.py "${TINY[@]}" --systems on,sync,off,on
    excerpt bench "$BENCH_LINES" 40
fi

if wanted kernels; then
    "$PY" -c 'import sys; sys.path.insert(0, "benchmarks"); import peer_kernels as p; sys.exit(not p.fetched())' ||
        say "kernels: .peers/ is not here: no vLLM / SGLang columns (benchmarks/peer_kernels.py fetch, then carry .peers)"
    mkdir -p "$STATE" && rm -f "$STATE/kernels.progress"
    bench=(benchmarks/kernel_bench.py --quick --progress "$STATE/kernels.progress")
    ((DRY)) && bench=(benchmarks/kernel_bench.py --tiny --progress "$STATE/kernels.progress")
    # It stops measuring 15 s before its stage's timeout, so its goals always print.
    # -X faulthandler: a crash inside a driver call prints the Python stack that made it.
    if ! run_stage kernels 180 150 -- "$PY" -X faulthandler "${bench[@]}" \
        --budget-s $(($(stage_limit 180 150) - 15)); then
        ((DRY)) || LOG_AS=kernels run_stage kernels-host 120 150 -- \
            "$PY" -X faulthandler "${bench[@]}" --timing host \
            --budget-s $(($(stage_limit 120 150) - 15))
    fi
    excerpt kernels "^(## |peers|ceilings|\| hd |\([a-z-]+: |[0-9]+ points)|FAILED" 40
fi

# The files that hold gpu-marked tests: naming them spares collecting the whole suite.
GPU_TESTS=(tests/engine/test_engine_gpu.py tests/engine/test_host_kv.py
    tests/kernels/test_kernel_gpu.py tests/kernels/test_kernel_recurrent_gpu.py)
# Files whose tests run on CUDA whenever it is there, unmarked (the architectures through the
# engine, the attention kinds); the hybrid-state and latent-attention issues' CUDA tests go here.
CUDA_TESTS=(tests/engine/test_architectures.py tests/kernels/test_kernel_attention_kinds.py)
if wanted pytest; then
    if ((DRY)); then
        # What the GPU machine's pytest sees: the extras it lacks are hidden. Both lists in one
        # collection (what the two runs below select, without their -m).
        run_stage pytest 240 30 -- env PYTHONPATH="scripts/without_extras${PYTHONPATH:+:$PYTHONPATH}" \
            "$PY" -m pytest --collect-only -q -p no:cacheprovider "${GPU_TESTS[@]}" "${CUDA_TESTS[@]}"
        excerpt pytest "tests collected|error" 4
    else
        args=(-q -rs -p no:cacheprovider)
        "$PY" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout 90)
        "$PY" -c 'import xdist' 2>/dev/null && args+=(-n "${PYTEST_WORKERS:-4}")
        run_stage pytest 100 120 -- "$PY" -m pytest -m gpu "${args[@]}" "${GPU_TESTS[@]}"
        LOG_AS=pytest run_stage pytest-cuda 100 80 -- "$PY" -m pytest "${args[@]}" "${CUDA_TESTS[@]}"
        excerpt pytest "^(FAILED|ERROR)|passed|failed" 20
    fi
fi

if wanted profile; then
    run_stage profile 60 60 -- "$PY" benchmarks/step_profile.py "${TINY[@]}"
    excerpt profile "^(##|LLM|ceilings|median|bucket|  (GEMM|radixkv|other|the GEMMs))" 40
fi

if wanted hf; then
    LOG_AS=bench run_stage hf 120 0 -- "$PY" benchmarks/gpu_bench.py "${TINY[@]}" \
        --systems on,batch,generate
    excerpt bench "$BENCH_LINES" 40
fi

say "total: $((SECONDS - START))s of a ${BUDGET_S}s budget; stages not passed: ${FAILED[*]:-none}"
for name in "${FAILED[@]}"; do
    log="$OUT/$name.log"
    case $name in
        install-plain | import) log="$OUT/install.log" ;;
        kernels-host) log="$OUT/kernels.log" ;;
        pytest-cuda) log="$OUT/pytest.log" ;;
        hf) log="$OUT/bench.log" ;;
    esac
    [[ -f $log ]] || continue
    say "---- tail of $(basename "$log") ($name)"
    tail -n 20 "$log" | tee -a "$SUMMARY"
done
((${#FAILED[@]} == 0))
