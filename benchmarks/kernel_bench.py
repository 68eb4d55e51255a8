"""Kernel benchmark: paged decode bandwidth against the device's copy bandwidth, extend TFLOP/s, and
torch SDPA on contiguous K/V of the same lengths. Needs a CUDA GPU.

    .venv/bin/python benchmarks/kernel_bench.py          # full sweep, markdown tables
    .venv/bin/python benchmarks/kernel_bench.py --quick  # a few configurations
    .venv/bin/python benchmarks/kernel_bench.py --check  # compiled kernels vs reference, bf16 too

Every figure is the median time of one call over CUDA-graph replays (see `_bench`), the kernels'
and SDPA's alike.

Decode: 32 query heads over 8 kv heads, head_dim 128, bf16, one new token per request, block tables
a random permutation of the cache's blocks. Achieved bandwidth counts the bytes that must move:
K and V of every context token, the block table, q and the output. It is compared with a
device-to-device copy measured in the same run (bytes read + bytes written per second).

Goals (issue #9), printed as measured ratios in the last table:
- decode at batch 1 / context 16k: paged time <= 1.3x SDPA's on contiguous K/V;
- decode at batch 16 / context 4k: >= 85 % of the copy bandwidth;
- decode at batch >= 16: <= 5 % spread of GB/s across block sizes (per batch and context);
- extend: >= 0.85x SDPA's TFLOP/s.

A split sweep times the decode kernel at a few fixed `num_kv_splits` beside the default's choice
(for a block table exactly as long as the context; the engine's tables are as long as the model's
context, so it may split more), at the shapes where the split choice decides the time (few
requests over long contexts) and at the decode workload's (64 requests, 640 tokens): the figures
that set `_PROGRAMS_PER_SM`, `_MIN_TOKENS_PER_SPLIT` and `_SERIAL_MERGE_SPLITS`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"  # tests swap in "cpu" (with the Triton interpreter) to smoke-test the plumbing
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class DecodeResult:
    batch: int
    context: int
    block_size: int
    ms: float
    gbps: float
    sdpa_ms: float
    max_abs_err: float | None  # against the torch reference, where it was checked


@dataclass(frozen=True, slots=True)
class ExtendResult:
    batch: int
    prefix: int
    new_tokens: int
    block_size: int
    ms: float
    tflops: float
    sdpa_ms: float
    sdpa_tflops: float
    max_abs_err: float  # against the torch reference, in fp32


TIMING = "graph"  # how `_bench` times a call: "graph" or "host" (--timing)


def _bench(fn: Callable[[], object], timing: str | None = None) -> float:
    """Median milliseconds per call, timed as `timing` says (default: TIMING). "graph": over
    replays of a CUDA graph of many calls (triton's do_bench_cudagraph), because timing launches
    from the host times the host: at batch 1 a call's Python outlasts its kernel, as it never
    does in the engine, whose decode steps replay graphs. L2 is not flushed between calls, so a
    working set that fits in L2 (batch 1 at 4k: 16 MiB) reads faster than from memory; the
    goals' configurations do not fit. "host": triton's do_bench, L2 flushed before every call."""
    import triton.testing

    if (timing or TIMING) == "graph":
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy of a buffer far larger than L2: (read + write) bytes per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    # Host-timed whatever --timing says: a millisecond copy has no host gap worth removing, and
    # the same copy captured in a graph runs slower than launched (benchmarks/RESULTS.md).
    ms = _bench(lambda: dst.copy_(src), "host")
    return 2 * num_bytes / ms / 1e6


def _paged_cache(
    batch: int, context: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V caches holding exactly `batch * context` tokens and permuted block tables."""
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64)
    tables = perm.view(batch, blocks_per_req).to(torch.int32)
    return k_cache, v_cache, tables


def _sdpa_decode_ms(batch: int, context: int) -> float:
    q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    return _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def _decode_args(batch: int, context: int, block_size: int) -> tuple[tuple[Any, ...], torch.Tensor]:
    """`paged_attention`'s arguments for one new token per request over `context` tokens each,
    and an output buffer."""
    k_cache, v_cache, tables = _paged_cache(batch, context, block_size)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return (q, k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5), torch.empty_like(q)


def bench_decode(batch: int, context: int, block_size: int, sdpa_ms: float) -> DecodeResult:
    from radixkv.kernels import reference
    from radixkv.kernels.triton_paged_attention import paged_attention

    args, out = _decode_args(batch, context, block_size)
    q, k_cache, _, tables = args[:4]

    err = None
    if batch * context <= 16 * 4096:  # the reference is cheap enough here
        expected = reference.paged_attention(*args).float()
        err = (paged_attention(*args, out=out).float() - expected).abs().max().item()
    ms = _bench(lambda: paged_attention(*args, out=out))
    elem = k_cache.element_size()
    num_bytes = (
        2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem  # K and V
        + tables.numel() * tables.element_size()
        + 2 * q.numel() * elem  # q and out
    )
    return DecodeResult(batch, context, block_size, ms, num_bytes / ms / 1e6, sdpa_ms, err)


SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
# Extend tiles (BLOCK_M, BLOCK_N, warps, stages), the default first: those that compile for
# sm_90 without spilling registers (ptxas, bf16, head_dim 128, group 4); 128 x 64 with 4 warps
# spills.
EXTEND_SWEEP = (
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 32, 8, 2),
    (128, 32, 8, 3),
    (64, 64, 8, 2),
    (64, 64, 4, 2),
)


def bench_splits(batch: int, context: int, block_size: int) -> tuple[int, list[float]]:
    """The default's split count for this shape, and ms per call at each of SPLIT_SWEEP."""
    from radixkv.kernels.triton_paged_attention import default_num_kv_splits, paged_attention

    args, out = _decode_args(batch, context, block_size)
    span = args[3].shape[1] * block_size  # the block table's capacity, as the engine's launch
    chosen = default_num_kv_splits(batch * NUM_KV_HEADS, span, out.device)
    times = [
        _bench(lambda n=n: paged_attention(*args, out=out, num_kv_splits=n)) for n in SPLIT_SWEEP
    ]
    return chosen, times


def _print_splits(rows: list[tuple[int, int, int, list[float]]]) -> None:
    print("\n### Decode ms by split count (block 16; * marks the default's choice)\n")
    print("| batch | context | default | " + " | ".join(f"{n}" for n in SPLIT_SWEEP) + " |")
    print("|---:|---:|---:|" + "---:|" * len(SPLIT_SWEEP))
    for batch, context, chosen, times in rows:
        marks = ["*" if n == chosen else "" for n in SPLIT_SWEEP]
        cells = [f"{ms:.4f}{mark}" for ms, mark in zip(times, marks, strict=True)]
        print(f"| {batch} | {context} | {chosen} | " + " | ".join(cells) + " |")


def _attention_flops(batch: int, prefix: int, new_tokens: int) -> float:
    # Query j (0-based) of a request sees prefix + j + 1 keys; QK^T and PV are 2 flops per MAC each.
    visible = batch * (new_tokens * prefix + new_tokens * (new_tokens + 1) / 2)
    return 4.0 * NUM_Q_HEADS * HEAD_DIM * visible


def _sdpa_extend_ms(batch: int, prefix: int, new_tokens: int) -> float:
    from torch.nn.attention.bias import causal_lower_right

    total = prefix + new_tokens
    q = torch.randn(batch, NUM_Q_HEADS, new_tokens, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, total, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    # Bottom-right causal: the new tokens sit at the end of the context. K/V are expanded to the
    # query heads before timing (SDPA's causal bias path does not take enable_gqa everywhere).
    k = k.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, dim=1)
    bias = causal_lower_right(new_tokens, total)
    return _bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def bench_extend_tiles(
    batch: int, prefix: int, new_tokens: int, block_size: int
) -> list[ExtendResult]:
    """`bench_extend` at each of EXTEND_SWEEP's tiles (the kernel's EXTEND_TILES swapped for
    the run; each tile compiles once, before it is timed)."""
    from radixkv.kernels import triton_paged_attention as module

    default = module.EXTEND_TILES
    try:
        results = []
        for tiles in EXTEND_SWEEP:
            module.EXTEND_TILES = module.Tiles(*tiles)
            results.append(bench_extend(batch, prefix, new_tokens, block_size))
        return results
    finally:
        module.EXTEND_TILES = default


def _print_extend_tiles(rows: list[list[ExtendResult]]) -> None:
    print("\n### Extend TFLOP/s by tile (BLOCK_M x BLOCK_N, warps, stages; the default first)\n")
    names = [f"{m}x{n} w{w} s{st}" for m, n, w, st in EXTEND_SWEEP]
    print("| batch | prefix | new | SDPA (median) | " + " | ".join(names) + " | max err |")
    print("|---:|---:|---:|---:|" + "---:|" * len(names) + "---:|")
    for results in rows:
        r = results[0]
        sdpa = statistics.median(x.sdpa_tflops for x in results)
        cells = " | ".join(f"{x.tflops:.1f}" for x in results)
        err = max(x.max_abs_err for x in results)
        print(f"| {r.batch} | {r.prefix} | {r.new_tokens} | {sdpa:.1f} | {cells} | {err:.1e} |")


def bench_extend(batch: int, prefix: int, new_tokens: int, block_size: int) -> ExtendResult:
    from radixkv.kernels import reference
    from radixkv.kernels.triton_paged_attention import paged_attention

    total = prefix + new_tokens
    k_cache, v_cache, tables = _paged_cache(batch, total, block_size)
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * new_tokens, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5)
    expected = reference.paged_attention(*args).float()
    err = (paged_attention(*args, out=out).float() - expected).abs().max().item()
    ms = _bench(lambda: paged_attention(*args, out=out))
    sdpa_ms = _sdpa_extend_ms(batch, prefix, new_tokens)
    flops = _attention_flops(batch, prefix, new_tokens)
    tflops, sdpa_tflops = flops / ms / 1e9, flops / sdpa_ms / 1e9
    return ExtendResult(
        batch, prefix, new_tokens, block_size, ms, tflops, sdpa_ms, sdpa_tflops, err
    )


def _print_decode(results: list[DecodeResult], copy_gbps: float) -> None:
    print("\n### Decode (32 q heads / 8 kv heads, head_dim 128, bf16, permuted block tables)\n")
    print(
        "| batch | context | block | paged ms | GB/s | % of copy | SDPA ms | paged/SDPA | max err |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        err = "-" if r.max_abs_err is None else f"{r.max_abs_err:.1e}"
        print(
            f"| {r.batch} | {r.context} | {r.block_size} | {r.ms:.4f} | {r.gbps:.0f} | "
            f"{100 * r.gbps / copy_gbps:.1f} | {r.sdpa_ms:.4f} | {r.ms / r.sdpa_ms:.2f} | {err} |"
        )


def _print_extend(results: list[ExtendResult]) -> None:
    print("\n### Extend (prefill over a cached prefix; bf16, bottom-right causal)\n")
    print("| batch | prefix | new | block | paged ms | TFLOP/s | SDPA ms | SDPA TFLOP/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.batch} | {r.prefix} | {r.new_tokens} | {r.block_size} | {r.ms:.3f} | "
            f"{r.tflops:.1f} | {r.sdpa_ms:.3f} | {r.sdpa_tflops:.1f} | "
            f"{r.tflops / r.sdpa_tflops:.2f} |"
        )


@dataclass(frozen=True, slots=True)
class Goal:
    name: str
    target: str
    measured: float | None  # None: the sweep has no configuration for it
    met: bool


def goals(decode: list[DecodeResult], extend: list[ExtendResult], copy_gbps: float) -> list[Goal]:
    """The issue's kernel goals as measured ratios: the worst configuration of each."""

    def worst(values: list[float], higher_is_better: bool) -> float | None:
        if not values:
            return None
        return min(values) if higher_is_better else max(values)

    b1 = worst([r.ms / r.sdpa_ms for r in decode if r.batch == 1 and r.context == 16384], False)
    b16 = worst([r.gbps / copy_gbps for r in decode if r.batch == 16 and r.context == 4096], True)
    spreads = []
    for _key, group in itertools.groupby(decode, key=lambda r: (r.batch, r.context)):
        rates = [r.gbps for r in group]
        if _key[0] >= 16 and len(rates) > 1:
            spreads.append((max(rates) - min(rates)) / (sum(rates) / len(rates)))
    spread = worst(spreads, False)
    ext = worst([r.tflops / r.sdpa_tflops for r in extend], True)
    return [
        Goal("decode b=1 ctx=16k: paged / SDPA time", "<= 1.30", b1, b1 is None or b1 <= 1.3),
        Goal(
            "decode b=16 ctx=4k: share of copy bandwidth",
            ">= 0.85",
            b16,
            b16 is None or b16 >= 0.85,
        ),
        Goal(
            "decode b>=16: block-size spread of GB/s",
            "<= 0.05",
            spread,
            spread is None or spread <= 0.05,
        ),
        Goal("extend: paged / SDPA TFLOP/s", ">= 0.85", ext, ext is None or ext >= 0.85),
    ]


def _print_goals(rows: list[Goal]) -> list[str]:
    """Print the goal table; returns the missed goals."""
    print("\n### Goals (worst configuration of each)\n")
    print("| goal | target | measured | status |")
    print("|---|---:|---:|---|")
    for g in rows:
        measured = "-" if g.measured is None else f"{g.measured:.2f}"
        status = "not in this sweep" if g.measured is None else ("met" if g.met else "MISSED")
        print(f"| {g.name} | {g.target} | {measured} | {status} |")
    return [g.name for g in rows if not g.met]


def run_check() -> int:
    """The GPU correctness suite (bf16/fp16/fp32 against the reference), compiled kernels."""
    pytest_bin = Path(sys.executable).with_name("pytest")
    # Never `python -m pytest` from the repo root: it would put the top-level kernels/ on sys.path.
    cmd = [str(pytest_bin)] if pytest_bin.exists() else [sys.executable, "-P", "-m", "pytest"]
    cmd += ["-m", "gpu", "-q", "-rs", "tests/kernels"]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.call(cmd, cwd=REPO, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few configurations only")
    parser.add_argument("--check", action="store_true", help="run the GPU correctness suite")
    parser.add_argument(
        "--timing",
        choices=("graph", "host"),
        default="graph",
        help="time CUDA-graph replays of each call (default) or host launches (L2 flushed)",
    )
    args = parser.parse_args(argv)
    global TIMING
    TIMING = args.timing
    if args.check:
        return run_check()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    if args.quick:  # exactly the goals' configurations
        batches, contexts, block_sizes = [1, 16], [4096, 16384], [16, 64, 256]
        extend_cfgs = [(1, 4096, 512)]
    else:
        batches, contexts, block_sizes = [1, 16, 64], [1024, 4096, 16384], [16, 64, 256]
        extend_cfgs = [(1, 1024, 512), (1, 4096, 512), (4, 4096, 512), (1, 16384, 1024)]

    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"## Kernels on {props.name} ({props.multi_processor_count} SMs)\n")
    print(f"torch {torch.__version__}, triton {triton.__version__}; timing: {TIMING}")
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write, 1 GiB buffer)")

    decode = []
    for batch, context in itertools.product(batches, contexts):
        sdpa_ms = _sdpa_decode_ms(batch, context)
        for block_size in block_sizes:
            decode.append(bench_decode(batch, context, block_size, sdpa_ms))
            torch.cuda.empty_cache()
    extend = [
        bench_extend(batch, prefix, new, block_size)
        for batch, prefix, new in extend_cfgs
        for block_size in block_sizes
    ]
    splits = [
        (batch, context, *bench_splits(batch, context, 16))
        for batch, context in ((1, 4096), (1, 16384), (4, 16384), (16, 4096), (64, 640))
    ]
    tile_rows = [bench_extend_tiles(*cfg, block_size=16) for cfg in extend_cfgs]
    _print_decode(decode, copy_gbps)
    _print_extend(extend)
    _print_splits(splits)
    _print_extend_tiles(tile_rows)
    _print_goals(goals(decode, extend, copy_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
