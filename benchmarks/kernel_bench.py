"""Kernel benchmark: paged decode bandwidth against the device's copy bandwidth, extend TFLOP/s, and
torch SDPA on contiguous K/V of the same lengths. Needs a CUDA GPU.

    .venv/bin/python benchmarks/kernel_bench.py          # full sweep, markdown tables
    .venv/bin/python benchmarks/kernel_bench.py --quick  # a few configurations
    .venv/bin/python benchmarks/kernel_bench.py --check  # compiled kernels vs reference, bf16 too

Decode: 32 query heads over 8 kv heads, head_dim 128, bf16, one new token per request, block tables
a random permutation of the cache's blocks. Achieved bandwidth counts the bytes that must move:
K and V of every context token, the block table, q and the output. It is compared with a
device-to-device copy measured in the same run (bytes read + bytes written per second).

Goals (issue #3): decode >= 90 % of copy bandwidth at context >= 4k and batch >= 16; < 5 % spread
across block sizes; no slower than SDPA on contiguous K/V at long context.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds (triton's do_bench: L2 flushed before every timed call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def copy_bandwidth_gbps(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy of a buffer far larger than L2: (read + write) bytes per second."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
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


def bench_decode(batch: int, context: int, block_size: int, sdpa_ms: float) -> DecodeResult:
    from radixkv.kernels import reference
    from radixkv.kernels.triton_paged_attention import paged_attention

    k_cache, v_cache, tables = _paged_cache(batch, context, block_size)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5)

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


def bench_extend(batch: int, prefix: int, new_tokens: int, block_size: int) -> ExtendResult:
    from radixkv.kernels.triton_paged_attention import paged_attention

    total = prefix + new_tokens
    k_cache, v_cache, tables = _paged_cache(batch, total, block_size)
    seq_lens = torch.full((batch,), total, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(0, (batch + 1) * new_tokens, new_tokens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch * new_tokens, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5)
    ms = _bench(lambda: paged_attention(*args, out=out))
    sdpa_ms = _sdpa_extend_ms(batch, prefix, new_tokens)
    flops = _attention_flops(batch, prefix, new_tokens)
    return ExtendResult(
        batch, prefix, new_tokens, block_size, ms, flops / ms / 1e9, sdpa_ms, flops / sdpa_ms / 1e9
    )


def _print_decode(results: list[DecodeResult], copy_gbps: float) -> list[str]:
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
    failures = []
    for (batch, context), group in itertools.groupby(results, key=lambda r: (r.batch, r.context)):
        group = list(group)
        rates = [r.gbps for r in group]
        spread = (max(rates) - min(rates)) / (sum(rates) / len(rates))
        if len(group) > 1 and spread >= 0.05:
            failures.append(
                f"decode b={batch} ctx={context}: {100 * spread:.1f} % block-size spread"
            )
        for r in group:
            if batch >= 16 and context >= 4096 and r.gbps < 0.9 * copy_gbps:
                failures.append(
                    f"decode b={batch} ctx={context} B={r.block_size}: "
                    f"{100 * r.gbps / copy_gbps:.1f} % of copy bandwidth (< 90 %)"
                )
            if context >= 16384 and r.ms > r.sdpa_ms:
                failures.append(
                    f"decode b={batch} ctx={context} B={r.block_size}: slower than SDPA "
                    f"({r.ms:.4f} vs {r.sdpa_ms:.4f} ms)"
                )
    return failures


def _print_extend(results: list[ExtendResult]) -> list[str]:
    print("\n### Extend (prefill over a cached prefix; bf16, bottom-right causal)\n")
    print("| batch | prefix | new | block | paged ms | TFLOP/s | SDPA ms | SDPA TFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    failures = []
    for r in results:
        print(
            f"| {r.batch} | {r.prefix} | {r.new_tokens} | {r.block_size} | {r.ms:.3f} | "
            f"{r.tflops:.1f} | {r.sdpa_ms:.3f} | {r.sdpa_tflops:.1f} |"
        )
        if r.prefix >= 16384 and r.ms > r.sdpa_ms:
            failures.append(
                f"extend b={r.batch} prefix={r.prefix} B={r.block_size}: slower than SDPA"
            )
    return failures


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
    args = parser.parse_args(argv)
    if args.check:
        return run_check()
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    if args.quick:
        batches, contexts, block_sizes = [1, 16], [1024, 4096], [16, 256]
        extend_cfgs = [(1, 4096, 512)]
    else:
        batches, contexts, block_sizes = [1, 16, 64], [1024, 4096, 16384], [16, 64, 256]
        extend_cfgs = [(1, 1024, 512), (1, 4096, 512), (4, 4096, 512), (1, 16384, 1024)]

    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"## Kernels on {props.name} ({props.multi_processor_count} SMs)\n")
    print(f"torch {torch.__version__}, triton {triton.__version__}")
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
    failures = _print_decode(decode, copy_gbps) + _print_extend(extend)
    print("\n### Goals\n")
    print("all met" if not failures else "\n".join(f"- MISSED: {f}" for f in failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
