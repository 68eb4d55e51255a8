"""The latent decode kernel's bytes a step on a GPU: does it read the latents once, not once a head?

One layer's decode step at DeepSeek V3's shape (128 heads, kv_lora_rank 512, RoPE 64, bf16,
block 64): `--batch` requests of `--context` cached tokens, one new token each, through
`kernels.latent_attention` (the Triton kernel and its split merge on CUDA). What the step must
read is the latent cache of its requests once (batch x context x (L + R) x 2 bytes) plus its
queries and block tables; the issue's goal is DRAM reads within 1.3x of the cache's size.

    time   the median time of a call (CUDA-graph replays, triton's do_bench_cudagraph) x the
           copy bandwidth measured in the same run (read + write bytes a second of a 1 GiB
           device copy): the most a call could have moved in its time. A ratio <= 1.3 proves
           the goal; a larger one does not disprove it (a call can take longer than its bytes).
           The default batch's cache (151 MB) is larger than an H100's or H200's L2.
    ncu    `--once` makes one call after one warm-up, for Nsight Compute to count what it read:
           ncu --metrics dram__bytes_read.sum -k regex:"latent|merge" \\
               .venv/bin/python benchmarks/latent_decode_bytes.py --once
           (the sum of the kernels' figures over the printed cache bytes is the ratio).

Without CUDA (TRITON_INTERPRET=1, tiny sizes) it runs one call of the kernel on the CPU: the
plumbing, not a figure.

    python benchmarks/latent_decode_bytes.py [--batch 32] [--context 4096] [--once]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from radixkv import kernels
from radixkv.kernels import latent_reference

GOAL = 1.3


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """The arguments of one latent decode call, and what it must read."""

    args: tuple
    cache_bytes: int  # the requests' latents, once
    other_bytes: int  # queries, block tables, sequence lengths


def decode_step(
    batch: int, context: int, heads: int, block_size: int, device: str, dtype: torch.dtype
) -> DecodeStep:
    """Random latents in permuted blocks, one query token a request over `context` tokens."""
    latent_dim, rope_dim = 512 + 64, 64
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    cache = torch.randn((num_blocks, block_size, latent_dim), device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = perm.view(batch, blocks_per_req).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q_latent = torch.randn((batch, heads, latent_dim - rope_dim), device=device, dtype=dtype)
    q_pe = torch.randn((batch, heads, rope_dim), device=device, dtype=dtype)
    scale = (128 + rope_dim) ** -0.5
    elem = cache.element_size()
    cache_bytes = batch * context * latent_dim * elem
    other = (q_latent.numel() + q_pe.numel()) * elem + 4 * (tables.numel() + 2 * batch + 1)
    args = (q_latent, q_pe, cache, tables, seq_lens, cu_seqlens_q, scale)
    return DecodeStep(args, cache_bytes, other)


def copy_bandwidth(device: str) -> float:
    """Read + write bytes a second of a 1 GiB device-to-device copy (median of do_bench)."""
    import triton.testing

    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--once", action="store_true", help="one call after a warm-up (ncu)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    step = decode_step(args.batch, args.context, args.heads, args.block_size, device, dtype)
    out = torch.empty_like(step.args[0])

    def call() -> None:
        kernels.latent_attention(*step.args, out=out)

    print(
        f"latent decode, one layer: batch {args.batch} x {args.context} context, {args.heads}"
        f" heads, L 512 + R 64, block {args.block_size}, {dtype}, {device}"
    )
    print(f"latent cache bytes {step.cache_bytes:,}; queries and tables {step.other_bytes:,}")
    with kernels.use_backend("triton"):
        call()  # compiles (or, interpreted, runs once)
    expected = latent_reference.latent_attention(*step.args).float()
    print(f"max |kernel - torch reference|: {(out.float() - expected).abs().max().item():.2e}")
    with kernels.use_backend("triton"):
        if args.once or not cuda:
            t0 = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize()
            print(f"one call: {1e3 * (time.perf_counter() - t0):.3f} ms (host-timed)")
            if not cuda:
                print("no CUDA: the interpreter's run checks the plumbing, not a figure")
            return
        import triton.testing

        ms = float(triton.testing.do_bench_cudagraph(call, return_mode="median"))
    bandwidth = copy_bandwidth(device)
    moved = ms / 1e3 * bandwidth
    print(f"median call {ms:.4f} ms; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)")
    print(
        f"bytes the call could have moved / latent cache bytes: {moved / step.cache_bytes:.2f}x"
        f" (goal <= {GOAL}x: at most this many bytes were read)"
    )


if __name__ == "__main__":
    main()
