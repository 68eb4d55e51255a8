"""Dense views of a paged test batch (`conftest.PagedBatch`), for reference computations."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def dense_requests(batch) -> Iterator[tuple[torch.Tensor, ...]]:
    """Each request with new tokens, gathered position by position, in fp32: q [num_q_heads,
    q_len, head_dim], k and v [num_kv_heads, seq_len, head_dim], the positions [seq_len] and the
    queries' positions [q_len]."""
    cu = batch.cu_seqlens_q.tolist()
    block_size = batch.k_cache.shape[1]
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = cu[r + 1] - cu[r]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        blocks = batch.block_tables[r, pos // block_size].long()
        k = batch.k_cache[blocks, pos % block_size].float().transpose(0, 1)
        v = batch.v_cache[blocks, pos % block_size].float().transpose(0, 1)
        q = batch.q[cu[r] : cu[r + 1]].float().transpose(0, 1)
        yield q, k, v, pos, seq_len - q_len + torch.arange(q_len)
