"""Factories for kernel tests: paged caches, permuted block tables, NaN-poisoned free slots."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

# Per-dtype tolerance of a kernel against the fp32 reference (outputs are O(1)).
TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@dataclass
class PagedBatch:
    """A varlen attention batch over a paged cache; `args` is the positional argument tuple."""

    q: torch.Tensor  # [total_q_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unwritten
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks], -1 past each request's blocks
    seq_lens: torch.Tensor  # int32 [num_reqs]
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    scale: float

    @property
    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.scale,
        )


def build_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    block_size: int,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Requests r with q_lens[r] new tokens at the end of seq_lens[r] context tokens.

    Blocks are drawn from a random permutation of a pool twice as large as needed; every slot not
    covered by some request's [0, seq_len) holds NaN, so a kernel that reads one fails loudly.
    """
    assert len(seq_lens) == len(q_lens)
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_per_req) + 3
    max_blocks = max(blocks_per_req, default=0) + 1  # one padding column at least
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        tables[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
        pos = torch.arange(seq_len)
        blocks, offsets = tables[r, pos // block_size].long(), pos % block_size
        k_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(
            dtype
        )
        v_cache[blocks, offsets] = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(
            dtype
        )
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        q=q.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        scale=head_dim**-0.5,
    )


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Small ops on 2 threads slow down 10-250x when the other core is busy (OpenMP spin-wait),
    # and kernel tests are many small ops. Restored after each test.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return build_paged_batch


def assert_close_finite(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "kernel output holds NaN/inf (read a poisoned slot?)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    return assert_close_finite
