"""Which form of MLA attention is faster on this CPU, at which shape: absorbed or expanded.

Run from the repository root:
    .venv/bin/python benchmarks/latent_forms_bench.py            # full run (a few minutes)
    .venv/bin/python benchmarks/latent_forms_bench.py --quick    # smoke run (seconds)

One request of q_len new tokens ending a seq_len-token context of a paged latent cache (block
16, fp32, the CPU engine's torch path, one torch thread), both forms end to end from the
queries to the per-head output [q_len, N, V]:

    absorbed  q_nope @ W_UK, `latent_attention_step` over the latents, @ W_UV
    expanded  `expanded_latent_attention_step` (the context's latents up-projected by kv_b_proj
              a chunk at a time, ordinary attention, chunks merged by log-sum-exp)

Timed in CPU-seconds of this process (`time.process_time`, best of a few runs), not wall time:
the machine is shared. Printed per shape: both times, the faster form, the form the engine's
cost rule (`LatentDims.prefers_absorbed`: multiply-adds, and TORCH_MERGE_COST for the
expanded form's merge) picks, and whether they agree. The
two sizes: DeepSeek V3's per-head dims (L 512, R 64, P 128, V 128) at 16 heads (both forms'
costs are linear in the heads, so the crossover is V3's), and a tiny test model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixkv.kernels import AttentionMetadata, LatentDims, latent_cache_shape, latent_reference
from radixkv.kernels.latent_metadata import TORCH_MERGE_COST

try:
    from benchmarks.cache_bench import machine_line
except ImportError:  # run as a script: benchmarks/ is on the path
    from cache_bench import machine_line  # type: ignore[no-redef]

BLOCK_SIZE = 16
SHAPES: dict[str, LatentDims] = {
    "v3 heads x16": LatentDims(16, 512, 64, 128, 128),
    "tiny": LatentDims(4, 32, 8, 16, 16),
}
# (q_len, cached prefix): decode, short and long extends over a prefix, prefills.
CASES = [
    (1, 2048),
    (16, 2048),
    (64, 2048),
    (128, 2048),
    (256, 2048),
    (512, 2048),
    (16, 0),
    (64, 0),
    (256, 0),
    (1024, 0),
]
QUICK_CASES = [(1, 64), (8, 64), (32, 0)]


@dataclass(frozen=True, slots=True)
class FormResult:
    shape: str
    q_len: int
    seq_len: int
    absorbed_s: float
    expanded_s: float
    rule_absorbed: bool
    max_diff: float  # between the two forms' outputs

    @property
    def faster_absorbed(self) -> bool:
        return self.absorbed_s <= self.expanded_s


def _cpu_seconds(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Best CPU-seconds of `repeats` calls (after one untimed call), and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def run_case(name: str, dims: LatentDims, q_len: int, prefix: int, repeats: int) -> FormResult:
    seq_len = q_len + prefix
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-seq_len // BLOCK_SIZE)
    cache = torch.randn(num_blocks, BLOCK_SIZE, dims.latent_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None]
    metadata = AttentionMetadata(
        tables,
        torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, q_len], dtype=torch.int32),
        latent_cache_shape(cache),
    )
    n, p, v = dims.num_heads, dims.qk_nope_head_dim, dims.v_head_dim
    weight = torch.randn(n * (p + v), dims.kv_lora_rank, generator=gen) / dims.kv_lora_rank**0.5
    heads = weight.view(n, p + v, dims.kv_lora_rank)
    w_uk, w_uv = heads[:, :p], heads[:, p:]
    q_nope = torch.randn(q_len, n, p, generator=gen)
    q_pe = torch.randn(q_len, n, dims.qk_rope_head_dim, generator=gen)
    scale = (p + dims.qk_rope_head_dim) ** -0.5

    def absorbed() -> torch.Tensor:
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        latents = latent_reference.latent_attention_step(q_latent, q_pe, cache, metadata, scale)
        return torch.bmm(latents.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def expanded() -> torch.Tensor:
        return latent_reference.expanded_latent_attention_step(
            q_nope, q_pe, cache, metadata, weight, scale
        )

    absorbed_s, a = _cpu_seconds(absorbed, repeats)
    expanded_s, e = _cpu_seconds(expanded, repeats)
    diff = (a - e).abs().max().item()
    rule = dims.prefers_absorbed(q_len, seq_len, TORCH_MERGE_COST)
    return FormResult(name, q_len, seq_len, absorbed_s, expanded_s, rule, diff)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small cases (smoke run)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cases, repeats = (QUICK_CASES, 1) if args.quick else (CASES, 3)
    print(f"# {machine_line()}; torch {torch.__version__}, 1 thread")
    print(f"# load average at start: {os.getloadavg()[0]:.2f} (CPU-seconds, best of {repeats})")
    print("| shape | q_len | seq_len | absorbed ms | expanded ms | faster | rule | agree |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    agree = 0
    results = []
    for name, dims in SHAPES.items():
        for q_len, prefix in cases:
            r = run_case(name, dims, q_len, prefix, repeats)
            results.append(r)
            same = r.faster_absorbed == r.rule_absorbed
            agree += same
            print(
                f"| {name} | {q_len} | {r.seq_len} | {1e3 * r.absorbed_s:.2f} | "
                f"{1e3 * r.expanded_s:.2f} | {'absorbed' if r.faster_absorbed else 'expanded'} | "
                f"{'absorbed' if r.rule_absorbed else 'expanded'} | {'yes' if same else 'NO'} |",
                flush=True,
            )
    print(f"# the rule picked the faster form at {agree} of {len(results)} shapes")
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")
    worst = max(r.max_diff for r in results)
    print(f"# largest difference between the forms' outputs: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
