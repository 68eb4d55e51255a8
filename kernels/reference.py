"""Plain-torch kernels: the executable spec of `radixkv.kernels`, and the CPU engine's fast path.

Paged KV cache of one layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token `i` of a request lives in block `block_tables[r, i // block_size]` at offset `i % block_size`
(its slot is `block_id * block_size + offset`).

Varlen attention batch, request r (packed in request order):

    context positions  0 .......................... ctx_len ............... seq_len
                       |  cached prefix (read only)  |  q_len new tokens     |
    q rows             cu_seqlens_q[r] ....................... cu_seqlens_q[r + 1]

with `q_len = cu_seqlens_q[r + 1] - cu_seqlens_q[r]` and `ctx_len = seq_len - q_len`; new token j
(absolute position ctx_len + j) attends to positions `[0, ctx_len + j]`. Decode is q_len == 1, plain
prefill ctx_len == 0.

Math is fp32 whatever the cache dtype. Slots past a request's seq_len may hold anything (NaN): they
are zeroed after the gather and masked before the softmax, so they never reach the output.
No per-token Python loops: decode rows are attended in padded batches of similar length, each
prefill/extend row by itself (in query chunks, to bound the score matrix).
"""

from __future__ import annotations

import torch

from radixkv.kernels.checks import check_copy_blocks, check_paged_attention, check_store_kv

__all__ = ["copy_blocks", "paged_attention", "store_kv"]

# Decode requests batched into one padded gather hold at most this many K elements (4 MiB fp32):
# measured on a 2-core machine, larger padded batches got slower than separate calls.
_DECODE_GROUP_ELEMS = 1 << 20
# Query rows per score matrix in the extend path: bounds memory at [heads, 512, seq_len] fp32.
_EXTEND_Q_CHUNK = 512


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V into the paged cache, in place. Slots < 0 are skipped (padding).

    key, value: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim] (same dtype as key); slot_mapping: int32/int64 [num_tokens].
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping, check_values=True)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    # Index with (block, offset) instead of viewing the cache flat: works for any cache strides.
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new query tokens over a paged KV cache (GQA).

    q: [total_q_tokens, num_q_heads, head_dim], packed in request order.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; num_q_heads is a multiple of
        num_kv_heads (query head h reads kv head h // (num_q_heads // num_kv_heads)).
    block_tables: int32 [num_reqs, max_blocks]; seq_lens: int32 [num_reqs], the whole context
        including the new tokens; cu_seqlens_q: int32 [num_reqs + 1].
    scale: softmax scale (usually head_dim ** -0.5).
    out: optional [total_q_tokens, num_q_heads, head_dim] result buffer in q's dtype.
    num_kv_splits: accepted for signature parity with the Triton kernel; ignored here.
    Returns out (or a new tensor): [total_q_tokens, num_q_heads, head_dim] in q's dtype.
    """
    del num_kv_splits  # one pass over the whole context: nothing to split
    check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, check_values=True
    )
    if out is None:
        out = torch.empty_like(q)
    num_reqs = block_tables.shape[0]
    if num_reqs == 0 or q.shape[0] == 0:
        return out
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(num_reqs)]

    decode = [r for r in range(num_reqs) if q_lens[r] == 1]
    for group in _decode_groups(decode, lens, k_cache.shape[2] * k_cache.shape[3]):
        r0 = group[0]
        if len(group) == 1:  # slices: no index tensors, no copies
            rows, tables = slice(cu[r0], cu[r0] + 1), block_tables[r0 : r0 + 1]
        else:
            rows = torch.tensor([cu[r] for r in group], device=q.device)
            tables = block_tables[torch.tensor(group, device=q.device)]
        kv_lens = [lens[r] for r in group]
        result = _attend(
            q[rows].unsqueeze(1),
            k_cache,
            v_cache,
            tables,
            kv_lens=kv_lens,
            q_starts=[n - 1 for n in kv_lens],
            scale=scale,
        )
        out[rows] = result.squeeze(1).to(out.dtype)
    for r in range(num_reqs):
        if q_lens[r] <= 1:
            continue
        ctx_len = lens[r] - q_lens[r]
        for j0 in range(0, q_lens[r], _EXTEND_Q_CHUNK):
            j1 = min(j0 + _EXTEND_Q_CHUNK, q_lens[r])
            # Query chunk [j0, j1) sees positions [0, ctx_len + j1): shorten the gather to that.
            result = _attend(
                q[cu[r] + j0 : cu[r] + j1].unsqueeze(0),
                k_cache,
                v_cache,
                block_tables[r : r + 1],
                kv_lens=[ctx_len + j1],
                q_starts=[ctx_len + j0],
                scale=scale,
            )
            out[cu[r] + j0 : cu[r] + j1] = result.squeeze(0).to(out.dtype)
    return out


def _decode_groups(decode: list[int], lens: list[int], row_elems: int) -> list[list[int]]:
    """Decode requests grouped into padded batches of similar length whose gathered K stays within
    _DECODE_GROUP_ELEMS; a long context is a group of its own. Batching amortises the per-call
    overhead of short contexts; on long ones padding and a working set past the CPU caches cost
    more than separate calls."""
    groups: list[list[int]] = []
    for r in sorted(decode, key=lens.__getitem__):
        group = groups[-1] if groups else None
        # sorted by length: lens[r] is the group's padded length if r joins it
        if group is not None and (len(group) + 1) * lens[r] * row_elems <= _DECODE_GROUP_ELEMS:
            group.append(r)
        else:
            groups.append([r])
    return groups


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    kv_lens: list[int],
    q_starts: list[int],
    scale: float,
) -> torch.Tensor:
    """Padded batch of n rows: q [n, q_len, num_q_heads, head_dim]; row i attends to positions
    [0, kv_lens[i]) of its block table, its query j sitting at position q_starts[i] + j (causal;
    the last query of a row sits at kv_lens[i] - 1). Returns fp32 [n, q_len, num_q_heads, head_dim].
    """
    n, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k, v = _gather_kv(k_cache, v_cache, block_tables, kv_lens)  # [n, kv_len, kv heads, head_dim]
    kv_len = k.shape[1]

    # qh, scores: [kv heads, n, group * q_len, head_dim | kv_len]. bmm reads K/V in place through
    # strides: one bmm over heads when n == 1 (heads are a plain batch dim of k[0]), one per kv head
    # otherwise; a single batched matmul over (n, heads) would first copy K/V head-major.
    qh = (q.float() * scale).view(n, q_len, num_kv_heads, group, head_dim)
    qh = qh.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, n, group * q_len, head_dim)
    scores = qh.new_empty((num_kv_heads, n, group * q_len, kv_len))
    if n == 1:
        torch.bmm(qh[:, 0], k[0].permute(1, 2, 0), out=scores[:, 0])
    else:
        for h in range(num_kv_heads):
            torch.bmm(qh[h], k[:, :, h].transpose(1, 2), out=scores[h])
    if q_len > 1 or min(kv_lens) < kv_len:
        # Causal: the query at position p sees [0, p]; p < kv_lens[i], so this hides padding too.
        pos = torch.arange(kv_len, device=q.device)
        q_pos = (
            torch.arange(q_len, device=q.device) + torch.tensor(q_starts, device=q.device)[:, None]
        )
        hidden = pos[None, None, :] > q_pos[:, :, None]  # [n, q_len, kv_len]
        scores.view(num_kv_heads, n, group, q_len, kv_len).masked_fill_(
            hidden[None, :, None], float("-inf")
        )
    probs = torch.softmax(scores, dim=-1)
    o = qh.new_empty((num_kv_heads, n, group * q_len, head_dim))
    if n == 1:
        torch.bmm(probs[:, 0], v[0].transpose(0, 1), out=o[:, 0])
    else:
        for h in range(num_kv_heads):
            torch.bmm(probs[h], v[:, :, h], out=o[h])
    o = o.view(num_kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4)
    return o.reshape(n, q_len, num_q_heads, head_dim)


def _gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    kv_lens: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous fp32 K, V [n, max(kv_lens), num_kv_heads, head_dim] of n block-table rows;
    positions at or past a row's kv_len are zero (never the cache's contents: they may be NaN)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    n, max_len = len(kv_lens), max(kv_lens)
    num_used_blocks = -(-max_len // block_size)
    padded_len = num_used_blocks * block_size
    # Whole blocks by index_select on the block dim (a copy; several times faster than advanced
    # indexing on CPU). Padding entries of shorter rows may hold any id (even -1): clamp them, their
    # slots are zeroed below.
    blocks = block_tables[:, :num_used_blocks].reshape(-1).long().clamp_(0, num_blocks - 1)
    k = k_cache.index_select(0, blocks).view(n, padded_len, num_kv_heads, head_dim)
    v = v_cache.index_select(0, blocks).view(n, padded_len, num_kv_heads, head_dim)
    if n == 1:
        k, v = k[:, :max_len], v[:, :max_len]  # nothing to zero: the tail is cut off
    elif min(kv_lens) < padded_len:
        # NOTE: zero, never multiply by a mask: an unwritten slot may hold NaN and 0 * NaN = NaN.
        pos = torch.arange(padded_len, device=k.device)
        invalid = pos[None, :] >= torch.tensor(kv_lens, device=k.device)[:, None]  # [n, len]
        rows = invalid.view(-1).nonzero().squeeze(1)
        k.view(-1, num_kv_heads, head_dim).index_fill_(0, rows, 0)
        v.view(-1, num_kv_heads, head_dim).index_fill_(0, rows, 0)
    return k.float(), v.float()


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slots: torch.Tensor,
) -> None:
    """Copy the first num_slots[i] slots of block src[i] into block dst[i], in K and V, in place.

    The copy-on-write of a partially matched tail block. k_cache, v_cache: one layer
    [num_blocks, block_size, num_kv_heads, head_dim] or all layers stacked [num_layers, ...] (all
    layers are copied); src, dst, num_slots: int tensors [n]. Slots past num_slots[i] of dst[i] are
    left as they were.
    """
    check_copy_blocks(k_cache, v_cache, src, dst, num_slots, check_values=True)
    if src.numel() == 0:
        return
    block_size = k_cache.shape[-3]
    keep = torch.arange(block_size, device=src.device)[None, :] < num_slots[:, None]  # [n, B]
    pairs = torch.nonzero(keep)  # one row per (copy, slot) to move
    src_blocks, dst_blocks = src.long()[pairs[:, 0]], dst.long()[pairs[:, 0]]
    slots = pairs[:, 1]
    for cache in (k_cache, v_cache):
        if cache.dim() == 4:
            cache[dst_blocks, slots] = cache[src_blocks, slots]
        else:
            cache[:, dst_blocks, slots] = cache[:, src_blocks, slots]
