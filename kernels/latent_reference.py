"""Plain-torch latent kernels: the executable spec of the latent cache, and the CPU engine's path.

The cache and the two forms of attention over it are described in `latent_metadata.py`. Math is
fp32 whatever the cache dtype; positions past a request's seq_len may hold anything (NaN) and
never reach an output (zeroed after the gather, masked before the softmax).

- `store_latent`: new tokens' latent [T, L] and k_pe [T, R] written at their slots.
- `latent_attention` (absorbed): queries already in latent space, q_latent [T, N, L] and q_pe
  [T, N, R], attend over the cached latents; returns the weighted latents [T, N, L] (the caller
  multiplies by W_UV). Decode rows in padded batches, prefill / extend rows each by itself, as
  `reference.paged_attention` lays them out (the metadata's `GatherPlan`, read as one KV head).
- `expanded_latent_attention`: queries q_nope [T, N, P] and q_pe [T, N, R] attend over the
  context's latents up-projected by kv_b_proj's weight a chunk of positions at a time, the
  chunks merged by their log-sum-exp; returns [T, N, V]. One request at a time: it serves
  prefill chunks, which are few per step.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from radixkv.kernels.latent_checks import (
    check_expanded_query,
    check_latent_query,
    check_latent_step,
    check_step_tokens,
    check_store_latent,
    check_store_latent_step,
)
from radixkv.kernels.latent_metadata import latent_cache_shape
from radixkv.kernels.metadata import AttentionMetadata, GatherBatch, build_gather_plan

__all__ = [
    "expanded_latent_attention",
    "expanded_latent_attention_step",
    "latent_attention",
    "latent_attention_step",
    "store_latent",
    "store_latent_step",
]

# Rows (query token x head) of one score matrix of the absorbed form: bounds it at
# [n, 4096, kv_len] fp32 (DeepSeek V3's 128 heads: 32 query tokens a matrix).
SCORE_ROWS = 4096
# Context positions of one chunk of the expanded form: at most 512 (queries before a chunk skip
# it, so a long prefill computes about as many causal pairs as the absorbed form's 512-query
# chunks do), fewer when their up-projected values (positions x heads x (P + V)) would pass
# 64 MiB fp32, never fewer than 64.
EXPANDED_CHUNK_ELEMS = 1 << 24
MAX_EXPANDED_CHUNK = 512
MIN_EXPANDED_CHUNK = 64


def store_latent(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' [latent | k_pe] into the latent cache, in place; slots < 0 are skipped.

    latent: [num_tokens, L]; k_pe: [num_tokens, R] (any token stride, unit last stride);
    cache: [num_blocks, block_size, L + R], their dtype; slot_mapping: int32/int64 [num_tokens].
    """
    check_store_latent(latent, k_pe, cache, slot_mapping, check_values=True)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    _store(latent[keep], k_pe[keep], cache, slots // block_size, slots % block_size)


def store_latent_step(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """`store_latent` at `metadata.slot_mapping`, whose values were checked when it was built."""
    check_store_latent_step(latent, k_pe, cache, metadata)
    plan = metadata.gather_plan or build_gather_plan(metadata)
    assert plan.store_blocks is not None and plan.store_offsets is not None, "no store plan"
    if plan.store_rows is not None:
        latent, k_pe = latent[plan.store_rows], k_pe[plan.store_rows]
    _store(latent, k_pe, cache, plan.store_blocks, plan.store_offsets)


def _store(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    lora = latent.shape[1]
    cache[blocks, offsets, :lora] = latent
    cache[blocks, offsets, lora:] = k_pe


def latent_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of latent-space queries over the paged latent cache.

    q_latent: [total_q_tokens, num_heads, L] (q_nope already multiplied by W_UK); q_pe:
        [total_q_tokens, num_heads, R], RoPE applied; any token and head strides.
    cache: [num_blocks, block_size, L + R]; block_tables, seq_lens, cu_seqlens_q as in
        `reference.paged_attention`.
    scale: the softmax scale of the model's attention (of its qk_head_dim, yarn's mscale in).
    out: optional [total_q_tokens, num_heads, L] result buffer in q's dtype.
    num_kv_splits: accepted for signature parity with the Triton kernel; ignored here.
    Returns out: score-weighted sums of latents [total_q_tokens, num_heads, L], q's dtype.
    """
    del num_kv_splits
    check_latent_query(q_latent, q_pe, cache, scale, out)
    metadata = AttentionMetadata(block_tables, seq_lens, cu_seqlens_q, latent_cache_shape(cache))
    return latent_attention_step(q_latent, q_pe, cache, metadata, scale, out=out)


def latent_attention_step(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """`latent_attention` over metadata checked when it was built (its gather plan reused)."""
    del num_kv_splits
    check_latent_step(cache, metadata)
    check_latent_query(q_latent, q_pe, cache, scale, out)
    check_step_tokens(q_latent, metadata)
    if out is None:
        out = q_latent.new_empty(q_latent.shape)
    if metadata.num_reqs == 0 or q_latent.shape[0] == 0:
        return out
    plan = metadata.gather_plan or build_gather_plan(metadata)
    for batch in plan.batches:
        out[batch.q_rows] = _attend(q_latent, q_pe, cache, batch, scale).to(out.dtype)
    return out


def _attend(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    batch: GatherBatch,
    scale: float,
) -> torch.Tensor:
    """The absorbed form over one padded batch: fp32 [n * q_len, num_heads, L]."""
    n, q_len = batch.n, batch.q_len
    _, num_heads, lora = q_latent.shape
    c = _gather(cache, batch)  # [n, kv_len, L + R]
    c_latent, c_pe = c[..., :lora], c[..., lora:]
    # rows: (token, head) pairs, token-major as q's own layout
    ql = q_latent[batch.q_rows].float().reshape(n, q_len * num_heads, lora)
    qp = q_pe[batch.q_rows].float().reshape(n, q_len * num_heads, -1)
    out = ql.new_empty((n, q_len * num_heads, lora))
    tokens = max(1, SCORE_ROWS // num_heads)
    for j0 in range(0, q_len, tokens):
        j1 = min(q_len, j0 + tokens)
        rows = slice(j0 * num_heads, j1 * num_heads)
        scores = torch.bmm(ql[:, rows], c_latent.transpose(1, 2))
        if c_pe.shape[-1]:  # NoPE models (Kimi Linear) store no rope part
            scores.baddbmm_(qp[:, rows], c_pe.transpose(1, 2))
        scores.mul_(scale)
        if batch.hidden is not None:  # [n, q_len, kv_len], every head alike
            scores.view(n, j1 - j0, num_heads, -1).masked_fill_(
                batch.hidden[:, j0:j1, None], float("-inf")
            )
        out[:, rows] = torch.bmm(torch.softmax(scores, dim=-1), c_latent)
    return out.view(n * q_len, num_heads, lora)


def _gather(cache: torch.Tensor, batch: GatherBatch) -> torch.Tensor:
    """Contiguous fp32 latents [n, kv_len, L + R] of the batch's rows; positions past a row's
    own length are zero (never the cache's contents: they may be NaN)."""
    n, width = batch.n, cache.shape[2]
    c = cache.index_select(0, batch.blocks).view(n, -1, width)
    if n == 1:
        c = c[:, : batch.kv_len]
    elif batch.zero_positions is not None:
        # NOTE: zero, never multiply by a mask: an unwritten slot may hold NaN and 0 * NaN = NaN.
        c.view(-1, width).index_fill_(0, batch.zero_positions, 0)
    return c.float()


def expanded_latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged latent cache with the latents up-projected.

    q_nope: [total_q_tokens, num_heads, P]; q_pe: [total_q_tokens, num_heads, R], RoPE applied.
    cache, block_tables, seq_lens, cu_seqlens_q: as in `latent_attention`.
    kv_b_weight: kv_b_proj's weight [num_heads * (P + V), L], each head's rows W_UK then W_UV.
    scale: the softmax scale. chunk_size: context positions up-projected at a time (default:
        `expanded_chunk_size`).
    Returns [total_q_tokens, num_heads, V] in q's dtype.
    """
    check_expanded_query(q_nope, q_pe, cache, kv_b_weight, scale)
    metadata = AttentionMetadata(block_tables, seq_lens, cu_seqlens_q, latent_cache_shape(cache))
    return expanded_latent_attention_step(
        q_nope, q_pe, cache, metadata, kv_b_weight, scale, chunk_size=chunk_size
    )


def expanded_chunk_size(num_heads: int, head_dims: int, chunk_size: int | None) -> int:
    """Positions per chunk: `chunk_size`, or MAX_EXPANDED_CHUNK, fewer where the up-projected
    chunk (positions x num_heads x head_dims values) would pass EXPANDED_CHUNK_ELEMS."""
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return chunk_size
    by_memory = EXPANDED_CHUNK_ELEMS // (num_heads * head_dims)
    return max(MIN_EXPANDED_CHUNK, min(MAX_EXPANDED_CHUNK, by_memory))


def expanded_latent_attention_step(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """`expanded_latent_attention` over metadata checked when it was built."""
    v_dim = check_expanded_query(q_nope, q_pe, cache, kv_b_weight, scale)
    check_latent_step(cache, metadata)
    check_step_tokens(q_nope, metadata)
    num_tokens, num_heads, nope = q_nope.shape
    chunk = expanded_chunk_size(num_heads, nope + v_dim, chunk_size)
    out = q_nope.new_empty((num_tokens, num_heads, v_dim))
    requests = zip(metadata.seq_lens_host, pairwise(metadata.cu_seqlens_q_host), strict=True)
    for r, (seq_len, (start, end)) in enumerate(requests):
        if end > start:
            rows = slice(start, end)
            table = metadata.block_tables[r]
            result = _attend_expanded(
                q_nope[rows], q_pe[rows], cache, table, seq_len, kv_b_weight, scale, chunk
            )
            out[rows] = result.to(out.dtype)
    return out


def _attend_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    kv_b_weight: torch.Tensor,
    scale: float,
    chunk: int,
) -> torch.Tensor:
    """One request's q_len queries (the last of its seq_len positions) over its whole context,
    `chunk` positions up-projected at a time; each chunk's softmax and log-sum-exp merged into
    the running ones. fp32 [q_len, num_heads, V]."""
    q_len, num_heads, nope = q_nope.shape
    lora = cache.shape[2] - q_pe.shape[2]
    block_size = cache.shape[1]
    ctx_len = seq_len - q_len
    heads = kv_b_weight.float().view(num_heads, -1, lora)  # [N, P + V, L]
    w_uk, w_uv = heads[:, :nope].transpose(1, 2), heads[:, nope:].transpose(1, 2)  # [N, L, *]
    qn = q_nope.float().transpose(0, 1)  # [N, q_len, P]
    qp = q_pe.float().transpose(0, 1)  # [N, q_len, R]
    out = lse = None
    for c0 in range(0, seq_len, chunk):
        pos = torch.arange(c0, min(c0 + chunk, seq_len), device=cache.device)
        # Queries before j0 see none of the chunk (causal): left out, each later one sees c0.
        j0 = max(0, c0 - ctx_len)
        c = cache[table[pos // block_size].long(), pos % block_size].float()  # [S, L + R]
        scores = torch.matmul(qn[:, j0:], torch.matmul(c[:, :lora], w_uk).transpose(1, 2))
        if qp.shape[-1]:  # NoPE models store no rope part
            scores += torch.matmul(qp[:, j0:], c[:, lora:].T)
        scores.mul_(scale)
        q_pos = torch.arange(ctx_len + j0, seq_len, device=cache.device)
        scores.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        part = torch.matmul(torch.softmax(scores, dim=-1), torch.matmul(c[:, :lora], w_uv))
        part_lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [N, q_len - j0, 1]
        if out is None or lse is None:  # the first chunk: j0 = 0, every query
            out, lse = part, part_lse
            continue
        merged = torch.logaddexp(lse[:, j0:], part_lse)
        out[:, j0:] = out[:, j0:] * torch.exp(lse[:, j0:] - merged) + part * torch.exp(
            part_lse - merged
        )
        lse[:, j0:] = merged
    assert out is not None, "a request with new tokens has a context"
    return out.transpose(0, 1)
