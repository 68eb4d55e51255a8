"""One layer's decode attention on the CPU at the default model's shape (9 query heads over 3 KV
heads of 64, block 16, fp32 cache): the compiled kernel against the torch reference, with and
without a prefix that every request of the batch holds in the same blocks (what the radix tree
serves to a batch of chat turns over one system prompt).

    .venv/bin/python -m benchmarks.cpu_attention_bench [--batch 8] [--contexts 300,700,2000]

Each cell is the CPU time of the calling thread per call (one torch thread, best of 7 runs of 20
calls), and the K/V bytes the call had to read (shared blocks once) over that time. Run it alone:
on a busy 2-core machine the figures swing by a third.
"""

from __future__ import annotations

import argparse
import time

import torch

from radixkv.kernels import cpu_attention
from radixkv.kernels.metadata import call_metadata

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64


def batch(size: int, context: int, shared: int, seed: int = 0):
    """`size` decode requests of `context` tokens whose first `shared` tokens sit in the same
    blocks; the rest of each request's blocks its own."""
    gen = torch.Generator().manual_seed(seed)
    per_request, common = -(-context // BLOCK), shared // BLOCK
    num_blocks = common + size * (per_request - common)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.empty(size, per_request, dtype=torch.int32)
    own = common
    for r in range(size):
        tables[r, :common] = torch.arange(common)
        tables[r, common:] = torch.arange(own, own + per_request - common)
        own += per_request - common
    lens = torch.full((size,), context, dtype=torch.int32)
    cu = torch.arange(size + 1, dtype=torch.int32)
    q = torch.randn(size, HEADS, HEAD_DIM, generator=gen)
    read = (common + size * (per_request - common)) * BLOCK * KV_HEADS * HEAD_DIM * 2 * 4
    return q, k, v, call_metadata(q, k, v, tables, lens, cu, HEAD_DIM**-0.5, None), read


def seconds_per_call(fn, calls: int = 20, runs: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="300,700,2000")
    p.add_argument("--shared", type=int, default=512, help="tokens of the shared prefix")
    args = p.parse_args()
    torch.set_num_threads(1)
    assert cpu_attention.available(), "the CPU attention kernel did not build"
    scale = HEAD_DIM**-0.5
    print(f"decode attention, one layer, batch {args.batch}, CPU ms per call (GB/s of K/V read)")
    print("| context | shared prefix | torch reference | kernel | reference / kernel |")
    print("|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        for shared in (0, min(args.shared, context - context % BLOCK)):
            q, k, v, metadata, read = batch(args.batch, context, shared)
            ref = cpu_attention.reference_attention_step(q, k, v, metadata, scale)
            out = cpu_attention.paged_attention_step(q, k, v, metadata, scale)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
            t_ref = seconds_per_call(
                lambda: cpu_attention.reference_attention_step(q, k, v, metadata, scale)  # noqa: B023
            )
            t_kernel = seconds_per_call(
                lambda: cpu_attention.paged_attention_step(q, k, v, metadata, scale)  # noqa: B023
            )
            print(
                f"| {context} | {shared} | {t_ref * 1e3:.3f} ({read / t_ref / 1e9:.1f}) "
                f"| {t_kernel * 1e3:.3f} ({read / t_kernel / 1e9:.1f}) | {t_ref / t_kernel:.2f}x |"
            )


if __name__ == "__main__":
    main()
