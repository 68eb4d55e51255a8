"""Plain-torch kernels: the executable spec of `radixkv.kernels` (and the CPU engine's path where
the compiled CPU attention cannot be built: `cpu_attention.py`).

Paged KV cache of one layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.
Token `i` of a request lives in block `block_tables[r, i // block_size]` at offset `i % block_size`
(its slot is `block_id * block_size + offset`).

Varlen attention batch, request r (packed in request order):

    context positions  0 .......................... ctx_len ............... seq_len
                       |  cached prefix (read only)  |  q_len new tokens     |
    q rows             cu_seqlens_q[r] ....................... cu_seqlens_q[r + 1]

with `q_len = cu_seqlens_q[r + 1] - cu_seqlens_q[r]` and `ctx_len = seq_len - q_len`; new token j
(absolute position ctx_len + j) attends to positions `[0, ctx_len + j]`, or with a sliding window W
to `(ctx_len + j - W, ctx_len + j]`. Decode is q_len == 1, plain prefill ctx_len == 0.

Math is fp32 whatever the cache dtype. Slots past a request's seq_len may hold anything (NaN): they
are zeroed after the gather and masked before the softmax, so they never reach the output.
No per-token Python loops: decode rows are attended in padded batches of similar length, each
prefill/extend row by itself (in query chunks, to bound the score matrix). That layout and its index
tensors are a `GatherPlan` (`metadata.py`): built with an `AttentionMetadata` once per step and
reused by every layer's `*_step` call; the loose-tensor functions build one per call.
"""

from __future__ import annotations

import torch

from radixkv.kernels.attention_kind import AttentionKind, check_kind
from radixkv.kernels.checks import (
    check_copy_blocks,
    check_new_kv,
    check_rms_norm,
    check_rope,
    check_store_kv,
)
from radixkv.kernels.metadata import (
    AttentionMetadata,
    GatherBatch,
    GatherPlan,
    build_gather_batches,
    build_gather_plan,
    call_metadata,
    check_attention_step,
    check_store_step,
)

__all__ = [
    "copy_blocks",
    "paged_attention",
    "paged_attention_step",
    "rms_norm",
    "rope_store_kv",
    "rope_store_kv_step",
    "store_kv",
    "store_kv_step",
]


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
    _store(key[keep], value[keep], k_cache, v_cache, slots // block_size, slots % block_size)


def store_kv_step(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """`store_kv` at `metadata.slot_mapping`, whose values were checked when it was built."""
    check_store_step(key, value, k_cache, v_cache, metadata)
    plan = _plan_of(metadata)
    assert plan.store_blocks is not None and plan.store_offsets is not None, "no store plan"
    if plan.store_rows is not None:
        key, value = key[plan.store_rows], value[plan.store_rows]
    _store(key, value, k_cache, v_cache, plan.store_blocks, plan.store_offsets)


def _store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    # Index with (block, offset) instead of viewing the cache flat: works for any cache strides.
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


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
    kind: AttentionKind | None = None,
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
    kind: the layer's `AttentionKind` (sliding window, logit soft-cap, sinks); None: full
        causal attention.
    Returns out (or a new tensor): [total_q_tokens, num_q_heads, head_dim] in q's dtype.

    The same computation as `paged_attention_step` with metadata built (and checked) for this one
    call.
    """
    del num_kv_splits  # one pass over the whole context: nothing to split
    metadata = call_metadata(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    return paged_attention_step(q, k_cache, v_cache, metadata, scale, out=out, kind=kind)


def paged_attention_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    kind: AttentionKind | None = None,
) -> torch.Tensor:
    """`paged_attention` over metadata checked when it was built; only q, the caches, out and the
    attention options are checked here (shapes, dtypes, devices), and the metadata's gather plan
    is reused."""
    del num_kv_splits
    check_attention_step(q, k_cache, v_cache, metadata, scale, out)
    kind = check_kind(q, kind)
    if out is None:
        out = torch.empty_like(q)
    if metadata.num_reqs == 0 or q.shape[0] == 0:
        return out
    for batch in _batches_of(metadata, kind.window):
        n, q_len = batch.n, batch.q_len
        # unflatten: a view whatever q's token / head strides
        q_batch = q[batch.q_rows].unflatten(0, (n, q_len))
        result = _attend(q_batch, k_cache, v_cache, batch, scale, kind.softcap, kind.sinks)
        out[batch.q_rows] = result.flatten(0, 1).to(out.dtype)
    return out


def _plan_of(metadata: AttentionMetadata) -> GatherPlan:
    # Built with the metadata on the CPU; the reference on another device (use_backend("torch"))
    # plans per call.
    return metadata.gather_plan or build_gather_plan(metadata)


def _batches_of(metadata: AttentionMetadata, window: int | None) -> tuple[GatherBatch, ...]:
    """The gather batches of full attention, or of `window` (built once per step and window)."""
    if window is None or window >= metadata.max_seq_len:  # the window hides nothing
        return _plan_of(metadata).batches
    batches = metadata.window_batches.get(window)
    if batches is None:
        batches = build_gather_batches(metadata, window)
        if metadata.gather_plan is not None:  # on the CPU, like the plan itself
            metadata.window_batches[window] = batches
    return batches


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: GatherBatch,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, q_len, num_q_heads, head_dim] of one padded batch (see `GatherBatch`).
    Returns fp32 [n, q_len, num_q_heads, head_dim]."""
    n, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k, v = _gather_kv(k_cache, v_cache, batch)  # [n, kv_len, kv heads, head_dim]
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
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if batch.hidden is not None:  # [n, q_len, kv_len]
        scores.view(num_kv_heads, n, group, q_len, kv_len).masked_fill_(
            batch.hidden[None, :, None], float("-inf")
        )
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # one more score per (query, head), dropped after the softmax: it has no value
        sink = sinks.float().view(num_kv_heads, 1, group, 1, 1)
        sink = sink.expand(num_kv_heads, n, group, q_len, 1).reshape(num_kv_heads, n, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :kv_len]
    o = qh.new_empty((num_kv_heads, n, group * q_len, head_dim))
    if n == 1:
        torch.bmm(probs[:, 0], v[0].transpose(0, 1), out=o[:, 0])
    else:
        for h in range(num_kv_heads):
            torch.bmm(probs[h], v[:, :, h], out=o[h])
    o = o.view(num_kv_heads, n, group, q_len, head_dim).permute(1, 3, 0, 2, 4)
    return o.reshape(n, q_len, num_q_heads, head_dim)


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: GatherBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous fp32 K, V [n, kv_len, num_kv_heads, head_dim] of the batch's block-table rows;
    positions at or past a row's own length are zero (never the cache's contents: they may be
    NaN)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    n = batch.n
    # Whole blocks by index_select on the block dim (a copy; several times faster than advanced
    # indexing on CPU).
    k = k_cache.index_select(0, batch.blocks).view(n, -1, num_kv_heads, head_dim)
    v = v_cache.index_select(0, batch.blocks).view(n, -1, num_kv_heads, head_dim)
    if n == 1:
        k, v = k[:, : batch.kv_len], v[:, : batch.kv_len]  # nothing to zero: the tail is cut off
    elif batch.zero_positions is not None:
        # NOTE: zero, never multiply by a mask: an unwritten slot may hold NaN and 0 * NaN = NaN.
        k.view(-1, num_kv_heads, head_dim).index_fill_(0, batch.zero_positions, 0)
        v.view(-1, num_kv_heads, head_dim).index_fill_(0, batch.zero_positions, 0)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, exactly as transformers' LlamaRMSNorm computes it: the mean
    square in fp32, the normalised x rounded back to x's dtype, then times weight.

    x: [..., hidden]; weight: [hidden]. Returns [..., hidden] in the promoted dtype of weight and
    x (the model's dtype when both are).
    """
    check_rms_norm(x, weight, eps)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [num_tokens, heads, head_dim] at cos / sin [num_tokens, head_dim]
    in transformers' "rotate half" layout: x * cos + rotate_half(x) * sin, the same ops in the
    same order (so the same bits) as its `apply_rotary_pos_emb`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None]) + (rotated * sin[:, None])


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotary embedding of q and k, then k and v written at their slots (`store_kv`).

    q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (any token
    and head strides, unit head_dim stride); cos, sin: [num_tokens, head_dim] in q's dtype (the
    rotary tables at each token's position); caches and slot_mapping as in `store_kv`.
    Returns the rotated q, [num_tokens, num_q_heads, head_dim] in q's dtype.
    """
    check_rope(q, k, v, cos, sin)
    store_kv(apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return apply_rope(q, cos, sin)


def rope_store_kv_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """`rope_store_kv` at `metadata.slot_mapping`, whose values were checked when it was built."""
    check_rope(q, k, v, cos, sin)
    check_new_kv(k, v, k_cache)
    store_kv_step(apply_rope(k, cos, sin), v, k_cache, v_cache, metadata)
    return apply_rope(q, cos, sin)
