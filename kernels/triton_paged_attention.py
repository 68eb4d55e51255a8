"""Triton paged attention: causal varlen attention over a paged KV cache (decode, extend, prefill).

One program handles a tile of BLOCK_Q new query tokens of one request, for all GROUP query heads
that share one kv head (so K/V are read once per group), over one split of the context:

    grid = (query tiles, num_kv_heads, num_kv_splits)

    tile rows (BLOCK_M = BLOCK_Q * GROUP_P): row m = token m // GROUP_P, group head m % GROUP_P
    context:  0 ........... kv_lo ...... kv_hi ........... kv_end <= seq_len
                            |   split s   |                 (the tile's last query sees kv_end - 1)

Query tiles are laid out without a host sync: request r owns tile ids
`[cu_seqlens_q[r] // BLOCK_Q + r, cu_seqlens_q[r + 1] // BLOCK_Q + r + 1)`, at least its
`ceil(q_len / BLOCK_Q)` tiles; a program finds its request by binary search and exits if its tile is
past q_len. The grid is the upper bound `num_tokens // BLOCK_Q + num_reqs`.

K/V rows are gathered position by position through the block table (block = pos // BLOCK_SIZE,
offset = pos % BLOCK_SIZE), so any block size works (1 .. 256+) independently of BLOCK_N. Loads past
the tile's last visible position are masked: unwritten slots (NaN) are never read.

With more than one split each program writes its normalised partial output and log-sum-exp (base 2)
to fp32 scratch, and `_merge_splits_kernel` combines them; with one split the output is written
directly. Whether to split is a runtime value (the grid's third dimension), not a constexpr, and the
merge loops over the splits: one compiled variant serves every split count.

Compiled variants: Triton compiles a kernel once per specialization of its arguments, and by
default an int argument specializes on being 1 or a multiple of 16 and a pointer on its 16-byte
alignment. The per-step values (request and token counts, the block-table row stride, query and
output strides that follow the token count) are marked `do_not_specialize`, the metadata pointers
(views at per-step offsets of the engine's one step buffer) `do_not_specialize_on_alignment`. What
is left to specialize is fixed per model and dtype (cache strides, head sizes) plus whether a launch
is decode-like, so a warm-up of one decode and one prefill step compiles everything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixkv.kernels.attention_kind import AttentionKind, check_kind
from radixkv.kernels.checks import check_paged_attention
from radixkv.kernels.metadata import AttentionMetadata, check_attention_step

__all__ = ["default_num_kv_splits", "paged_attention", "paged_attention_step"]

_LOG2E = 1.4426950408889634
_LOG2E_JIT: tl.constexpr = tl.constexpr(_LOG2E)
# Decode is memory-bound: keep about 4 programs' loads in flight per SM before splitting further.
_PROGRAMS_PER_SM = 4
# A split of 4 BLOCK_N tiles still amortises its partial-output write and merge read.
_MIN_TOKENS_PER_SPLIT = 256
# Bounds the fp32 scratch (splits x tokens x heads x head_dim) and the merge kernel's loop.
_MAX_KV_SPLITS = 64
# Up to this many splits the merge reads one split an iteration, many heads a program.
_SERIAL_MERGE_SPLITS = 8


@dataclass(frozen=True, slots=True)
class Tiles:
    """A launch's tile: query rows and keys per iteration, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Extend / prefill tiles of 16-bit inputs with head_dim <= 128: 128 query rows x 64 keys with 8
# warps (the shape of Triton's fused-attention tutorial on Hopper); kernel_bench's tile sweep
# times others. fp32 and head_dim > 128 take twice the shared memory: half the tile.
EXTEND_TILES = Tiles(128, 64, 8, 2)
_WIDE_EXTEND_TILES = Tiles(64, 32, 4, 2)
# Decode-like launches: the smallest tile tl.dot accepts on a GPU (M >= 16), keys as above.
_DECODE_TILES = Tiles(16, 64, 4, 2)
_WIDE_DECODE_TILES = Tiles(16, 32, 4, 2)


@triton.jit
def _find_request(cu_seqlens_q_ptr, tile_id, num_reqs, BLOCK_Q: tl.constexpr):
    """Last request r whose first tile id `cu_seqlens_q[r] // BLOCK_Q + r` is <= tile_id."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Launch arguments that change from step to step; see the module docstring.
_PER_STEP_INTS = ("num_reqs", "num_tokens", "stride_qt", "stride_qh", "stride_ot", "stride_oh")
_PER_STEP_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr")


@triton.jit(
    # window: a per-layer constant, but one variant serves every value of it
    do_not_specialize=(*_PER_STEP_INTS, "stride_btr", "window"),
    do_not_specialize_on_alignment=_PER_STEP_POINTERS,
)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # fp32 [num_splits, num_tokens, num_q_heads, HEAD_DIM] (read when num_splits > 1)
    part_lse_ptr,  # fp32 [num_splits, num_tokens, num_q_heads] (read when num_splits > 1)
    sinks_ptr,  # [num_q_heads] sink logits (read when HAS_SINKS)
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_reqs,
    num_tokens,
    num_q_heads,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    window,  # a query at position p sees (p - window, p] (read when WINDOWED)
    softcap_log2,  # logit soft-cap * log2(e) (read when SOFTCAP)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_btr,
    stride_btc,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    req = _find_request(cu_seqlens_q_ptr, tile_id, num_reqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_begin
    q_tile_start = (tile_id - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # a spare tile of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + offs_m // GROUP_P  # index among the request's new tokens
    g = offs_m % GROUP_P
    row_valid = (q_idx < q_len) & (g < GROUP)
    token = (q_begin + q_idx).to(tl.int64)
    head = (kv_head * GROUP + g).to(tl.int64)
    q_pos = ctx_len + q_idx  # absolute position of each row's query
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    # This tile sees positions [kv_start, kv_end): from its first query's window (0 without one)
    # to its last query. Split s takes a whole number of BLOCK_N tiles of that range; positions
    # before kv_start are never loaded (nor their block-table entries).
    kv_end = ctx_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(ctx_len + q_tile_start - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = kv_start + split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)

    table_row = block_tables_ptr + req.to(tl.int64) * stride_btr
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is one more score without a value: split 0 starts its running softmax from it
        # (counted once; the merge weighs it in through split 0's log-sum-exp).
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * _LOG2E_JIT
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_hi
        block = tl.load(table_row + (offs_n // BLOCK_SIZE) * stride_btc, mask=n_valid, other=0)
        block = block.to(tl.int64)
        in_block = (offs_n % BLOCK_SIZE).to(tl.int64)

        # K as [HEAD_DIM_P, BLOCK_N]: the transposed operand of q @ k^T.
        k = tl.load(
            k_base + (block * stride_kb + in_block * stride_ks)[None, :] + offs_d[:, None],
            mask=n_valid[None, :] & d_valid[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:  # cap * tanh(s / cap) in base 2, tanh(x) = 2 sigmoid(2x) - 1
            s = softcap_log2 * (2.0 * tl.sigmoid(2.0 * s / softcap_log2) - 1.0)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if WINDOWED:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf: subtract 0 instead (-inf - -inf = NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(
            v_base + (block * stride_vb + in_block * stride_vs)[:, None] + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_mass = l_i > 0.0
    o = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    mask = row_valid[:, None] & d_valid[None, :]
    if num_splits > 1:
        split64 = split.to(tl.int64)
        row = (split64 * num_tokens + token) * num_q_heads + head  # [num_splits, tokens, heads]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask)
        lse = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_valid)
    else:
        out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=("num_splits", "num_tokens", "stride_ot", "stride_oh"))
def _merge_splits_kernel(
    part_out_ptr,  # fp32 [num_splits, num_tokens, num_q_heads, HEAD_DIM]
    part_lse_ptr,  # fp32 [num_splits, num_tokens, num_q_heads], base 2, -inf for an empty split
    out_ptr,
    num_splits,
    num_tokens,
    num_q_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_TILE: tl.constexpr,  # 1, or BLOCK_H is 1
):
    """One token, BLOCK_H heads: the splits' partial outputs combined by an online log-sum-exp.

    Each of the tile's BLOCK_H * SPLIT_TILE rows is one (head, split) pair and keeps its own
    running log-sum-exp while the loop steps through the splits SPLIT_TILE at a time; with one
    head and SPLIT_TILE lanes of splits, the lanes are combined once at the end.
    """
    ROWS: tl.constexpr = BLOCK_H * SPLIT_TILE
    token = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, ROWS)
    head = tl.program_id(1) * BLOCK_H + offs_r // SPLIT_TILE
    lane = offs_r % SPLIT_TILE
    offs_d = tl.arange(0, HEAD_DIM_P)
    h_valid = head < num_q_heads
    d_valid = offs_d < HEAD_DIM

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM_P], dtype=tl.float32)
    for first in range(0, num_splits, SPLIT_TILE):
        split = first + lane
        valid = h_valid & (split < num_splits)
        # rows of the scratch's [num_splits, num_tokens, num_q_heads]
        row = (split.to(tl.int64) * num_tokens + token) * num_q_heads + head
        lse = tl.load(part_lse_ptr + row, mask=valid, other=float("-inf"))
        o = tl.load(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m_i, lse)
        # Only empty splits so far: keep m = -inf and subtract 0 (-inf - -inf = NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        weight = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + weight[:, None] * o
        l_i = l_i * alpha + weight
        m_i = m_new
    if SPLIT_TILE > 1:  # one head: its lanes combined as the splits were
        m = tl.max(m_i, 0)
        scale = tl.exp2(m_i - tl.where(m == float("-inf"), 0.0, m))  # 0 for a lane of no mass
        l_sum = tl.sum(l_i * scale, 0)
        merged = tl.sum(acc * scale[:, None], 0) / tl.where(l_sum > 0.0, l_sum, 1.0)
        out_offs = token * stride_ot + tl.program_id(1).to(tl.int64) * stride_oh + offs_d
        tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=d_valid)
    else:
        # l > 0: every row sees its own position, in some split
        merged = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out_offs = token * stride_ot + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
        mask = h_valid[:, None] & d_valid[None, :]
        tl.store(out_ptr + out_offs, merged.to(out_ptr.dtype.element_ty), mask=mask)


def _merge_tile(num_splits: int, num_q_heads: int, head_dim_p: int) -> tuple[int, int]:
    """(BLOCK_H, SPLIT_TILE) of the merge: a [heads, splits, head_dim] fp32 tile of ~4k elements
    (registers on a GPU). A few splits: many heads a program, one split a load. Many splits
    (a short batch over long contexts, where the grid is small): one head a program, many
    splits a load, so the loads of all splits are in flight at once instead of one per
    iteration. Two compiled variants per head_dim, whatever the split count."""
    elems = 4096 // head_dim_p
    if num_splits <= _SERIAL_MERGE_SPLITS:
        return max(1, min(triton.next_power_of_2(num_q_heads), elems)), 1
    return 1, max(16, min(_MAX_KV_SPLITS, elems))


def _num_sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms_of(index)


@functools.cache
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_kv_splits(num_programs: int, max_context_len: int, device: torch.device) -> int:
    """Split the context only when the (tile, kv head) programs alone cannot fill the GPU.

    `max_context_len` is the block-table capacity (host-known, no sync): an upper bound on what a
    request can read. On the CPU (interpreter) there is nothing to fill: one split.
    """
    if device.type != "cuda" or num_programs <= 0:
        return 1
    target = _PROGRAMS_PER_SM * _num_sms(device)
    if num_programs >= target:
        return 1
    useful = triton.cdiv(max_context_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(triton.cdiv(target, num_programs), useful, _MAX_KV_SPLITS))


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
    """Causal varlen attention of new query tokens over a paged KV cache (GQA), in Triton.

    q: [total_q_tokens, num_q_heads, head_dim], packed in request order.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype.
    block_tables: int32 [num_reqs, max_blocks]; seq_lens: int32 [num_reqs] (whole context including
        the new tokens); cu_seqlens_q: int32 [num_reqs + 1]; all on q's device.
    scale: softmax scale.
    out: optional result buffer like q.
    num_kv_splits: split each context into this many parts (merged by log-sum-exp); default: as
        many as needed to fill the GPU (`default_num_kv_splits`), 1 on the CPU.
    kind: the layer's `AttentionKind`, as in `reference.paged_attention`; each of its options is
        a compiled variant of its own when set (a constexpr), so full attention runs the very
        kernel it ran without them.
    Returns out: [total_q_tokens, num_q_heads, head_dim] in q's dtype.

    Same semantics as `radixkv.kernels.reference.paged_attention`. Metadata contents are checked
    only for CPU tensors (no sync); on CUDA build an `AttentionMetadata` from host tensors (checked
    once) and call `paged_attention_step`.
    """
    check_paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        out,
        check_values=q.device.type == "cpu",
    )
    kind = check_kind(q, kind)
    return _launch(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, num_kv_splits, kind
    )


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
    """`paged_attention` over metadata checked when it was built: only q, the caches, out and the
    attention options are checked here (tensor metadata, no sync)."""
    check_attention_step(q, k_cache, v_cache, metadata, scale, out)
    kind = check_kind(q, kind)
    return _launch(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.cu_seqlens_q,
        scale,
        out,
        num_kv_splits,
        kind,
    )


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    num_kv_splits: int | None,
    kind: AttentionKind,
) -> torch.Tensor:
    if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
        raise ValueError(f"num_kv_splits must be a positive int, got {num_kv_splits!r}")
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # Every launch parameter below comes from tensor shapes only, never from values on the device,
    # so a CUDA graph captured for one bucket of shapes stays right for every replay of it.
    # Decode-like batches (at most one new token per request on average) get the smallest tile
    # tl.dot accepts on a GPU (M >= 16); prefill/extend tiles are larger to reuse K/V across rows.
    decode_like = num_tokens <= num_reqs
    half = q.dtype != torch.float32 and head_dim <= 128
    if decode_like:
        tiles = _DECODE_TILES if half else _WIDE_DECODE_TILES
    else:
        tiles = EXTEND_TILES if half else _WIDE_EXTEND_TILES
    block_m = max(tiles.block_m, group_p)
    block_q = block_m // group_p
    num_tiles = num_tokens // block_q + num_reqs

    if num_kv_splits is None:
        real_tiles = num_reqs if decode_like else triton.cdiv(num_tokens, block_q)
        # What one tile can read: the table's capacity, or its queries' windows (a per-layer
        # constant, like the shapes).
        tile_span = block_tables.shape[1] * block_size
        if kind.window is not None:
            tile_span = min(tile_span, kind.window + block_q - 1)
        num_kv_splits = default_num_kv_splits(real_tiles * num_kv_heads, tile_span, q.device)
    if num_kv_splits > 1:
        part_out = torch.empty(
            (num_kv_splits, num_tokens, num_q_heads, head_dim), device=q.device, dtype=torch.float32
        )
        part_lse = torch.empty(
            (num_kv_splits, num_tokens, num_q_heads), device=q.device, dtype=torch.float32
        )
    else:  # unused, but fp32 like the scratch: a pointer of another dtype is another variant
        part_out = part_lse = torch.empty(0, device=q.device, dtype=torch.float32)
    sinks = kind.sinks if kind.sinks is not None else part_lse  # unused without sinks

    head_dim_p = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on a GPU
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        sinks,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        num_reqs,
        num_tokens,
        num_q_heads,
        scale * _LOG2E,
        kind.window or 0,
        (kind.softcap or 1.0) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n,
        # fp32 inputs: exact fp32 products (tf32 would lose ~3 decimal digits); else the default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        WINDOWED=kind.window is not None,
        SOFTCAP=kind.softcap is not None,
        HAS_SINKS=kind.sinks is not None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_kv_splits > 1:
        block_h, split_tile = _merge_tile(num_kv_splits, num_q_heads, head_dim_p)
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_q_heads, block_h))](
            part_out,
            part_lse,
            out,
            num_kv_splits,
            num_tokens,
            num_q_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            BLOCK_H=block_h,
            SPLIT_TILE=split_tile,
            num_warps=4,
        )
    return out
