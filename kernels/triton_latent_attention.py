"""Triton latent attention: MLA's absorbed form over the paged latent cache (decode and extend).

Every head attends over the same latents (one "KV head" of width L + R), so a program takes a
tile of BLOCK_H heads of BLOCK_Q new query tokens of one request over one split of its context:

    grid = (head tiles, query tiles, num_kv_splits)

    tile rows (BLOCK_M = BLOCK_Q * BLOCK_H): row m = token m // BLOCK_H, head m % BLOCK_H
    per BLOCK_N positions: c = cache rows [BLOCK_N, L] loaded once, and serving both dots:
        s = q_latent @ c^T + q_pe @ c_pe^T         (c_pe: the rows' last R values)
        acc += softmax-weights @ c                  (the values are the latents themselves)

The latent tile is the key and the value at once: each block is read once per head tile, where
an expanded cache would be read once per head, key and value apart. The head tiles are the
grid's first dimension, so the programs of one (query tile, split) are launched side by side and
all but the first find its blocks in L2. Query tiles are laid out as in `triton_paged_attention`
(request r owns tile ids from `cu_seqlens_q[r] // BLOCK_Q + r`, no host sync), the causal mask
and the split merge are the same (`_merge_splits_kernel` combines the splits' partial latents),
and so are the compiled variants: the per-step ints and the metadata pointers do not specialize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.latent_checks import (
    check_latent_query,
    check_latent_step,
    check_loose_metadata,
    check_step_tokens,
)
from radixkv.kernels.metadata import AttentionMetadata
from radixkv.kernels.triton_paged_attention import (
    _LOG2E,
    _PER_STEP_POINTERS,
    Tiles,
    _find_request,
    _merge_splits_kernel,
    _merge_tile,
    default_num_kv_splits,
)

__all__ = ["latent_attention", "latent_attention_step"]

# Tiles from sm_90 compiles at DeepSeek V3's shape (bf16, L = 512, R = 64; benchmarks/
# sm90_registers.py, RESULTS.md): the fewest registers without spills.
# Decode-like launches: one token, 16 heads a program (tl.dot's smallest M on a GPU), 16
# positions an iteration at 8 warps: 80 registers, 36.5 KiB, 3 CTAs an SM.
DECODE_TILES = Tiles(16, 16, 8, 2)
# Extend / prefill: 32 rows (heads x tokens) x 32 positions at 8 warps: 128 registers, 74 KiB.
EXTEND_TILES = Tiles(32, 32, 8, 2)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One tile of scores [rows, positions] (base 2, -inf where hidden) into a running softmax:
    returns its weights p, the factor alpha the accumulator is rescaled by, and the new running
    max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf: subtract 0 instead (-inf - -inf = NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_finish(acc, m_i, l_i):
    """The normalised output of a running softmax and its log-sum-exp (base 2; -inf, with a
    zero output, for a row that saw nothing)."""
    has_mass = l_i > 0.0
    o = acc / tl.where(has_mass, l_i, 1.0)[:, None]
    lse = tl.where(has_mass, m_i + tl.log2(tl.where(has_mass, l_i, 1.0)), float("-inf"))
    return o, lse


# Launch arguments that change from step to step (counts, strides that follow the token count).
_PER_STEP_INTS = (
    "num_reqs",
    "num_tokens",
    "stride_qlt",
    "stride_qlh",
    "stride_qpt",
    "stride_qph",
    "stride_ot",
    "stride_oh",
    "stride_btr",
)


@triton.jit(
    do_not_specialize=_PER_STEP_INTS,
    do_not_specialize_on_alignment=_PER_STEP_POINTERS,
)
def _latent_attention_kernel(
    q_latent_ptr,
    q_pe_ptr,
    cache_ptr,
    out_ptr,
    part_out_ptr,  # fp32 [num_splits, num_tokens, num_heads, LORA] (read when num_splits > 1)
    part_lse_ptr,  # fp32 [num_splits, num_tokens, num_heads] (read when num_splits > 1)
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    num_reqs,
    num_tokens,
    num_heads,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    stride_ot,
    stride_oh,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_cb,
    stride_cs,
    stride_btr,
    stride_btc,
    BLOCK_SIZE: tl.constexpr,
    LORA: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_tile = tl.program_id(0)
    tile_id = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    req = _find_request(cu_seqlens_q_ptr, tile_id, num_reqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_begin
    q_tile_start = (tile_id - (q_begin // BLOCK_Q + req)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # a spare tile of the upper-bound grid
    ctx_len = tl.load(seq_lens_ptr + req) - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + offs_m // BLOCK_H
    head = head_tile * BLOCK_H + offs_m % BLOCK_H
    row_valid = (q_idx < q_len) & (head < num_heads)
    token = (q_begin + q_idx).to(tl.int64)
    head = head.to(tl.int64)
    q_pos = ctx_len + q_idx
    offs_l = tl.arange(0, LORA_P)
    l_valid = offs_l < LORA
    offs_r = tl.arange(0, ROPE_P)
    r_valid = offs_r < ROPE

    q_latent = tl.load(
        q_latent_ptr + token[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_l[None, :],
        mask=row_valid[:, None] & l_valid[None, :],
        other=0.0,
    )
    if ROPE > 0:
        q_pe = tl.load(
            q_pe_ptr + token[:, None] * stride_qpt + head[:, None] * stride_qph + offs_r[None, :],
            mask=row_valid[:, None] & r_valid[None, :],
            other=0.0,
        )

    # The tile sees [0, kv_end); split s takes a whole number of BLOCK_N tiles of it.
    kv_end = ctx_len + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    per_split = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * per_split
    kv_hi = tl.minimum(kv_lo + per_split, kv_end)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_btr

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LORA_P], dtype=tl.float32)
    for start_n in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_hi
        block = tl.load(table_row + (offs_n // BLOCK_SIZE) * stride_btc, mask=n_valid, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
        # [BLOCK_N, LORA_P]: the keys' latent part and the values, one load
        c = tl.load(
            rows[:, None] + offs_l[None, :],
            mask=n_valid[:, None] & l_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q_latent, tl.trans(c), input_precision=DOT_PRECISION)
        if ROPE > 0:
            c_pe = tl.load(
                rows[None, :] + LORA + offs_r[:, None],
                mask=n_valid[None, :] & r_valid[:, None],
                other=0.0,
            )
            s += tl.dot(q_pe, c_pe, input_precision=DOT_PRECISION)
        s = s * qk_scale
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :], s, float("-inf"))

        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)

    o, lse = softmax_finish(acc, m_i, l_i)
    mask = row_valid[:, None] & l_valid[None, :]
    if num_splits > 1:
        row = (split.to(tl.int64) * num_tokens + token) * num_heads + head
        tl.store(part_out_ptr + row[:, None] * LORA + offs_l[None, :], o, mask=mask)
        tl.store(part_lse_ptr + row, lse, mask=row_valid)
    else:
        out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=mask)


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
    """MLA's absorbed attention in Triton; the contract is `latent_reference.latent_attention`'s.

    num_kv_splits: split each context into this many parts (merged by log-sum-exp); default: as
    many as fill the GPU (`default_num_kv_splits`), 1 on the CPU. Metadata values are checked
    for CPU tensors only (no sync).
    """
    check_latent_query(q_latent, q_pe, cache, scale, out)
    check_loose_metadata(q_latent, cache, block_tables, seq_lens, cu_seqlens_q)
    return _launch(
        q_latent, q_pe, cache, block_tables, seq_lens, cu_seqlens_q, scale, out, num_kv_splits
    )


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
    """`latent_attention` over metadata checked when it was built (tensor metadata only here)."""
    check_latent_step(cache, metadata)
    check_latent_query(q_latent, q_pe, cache, scale, out)
    check_step_tokens(q_latent, metadata)
    return _launch(
        q_latent,
        q_pe,
        cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.cu_seqlens_q,
        scale,
        out,
        num_kv_splits,
    )


def latent_tiles(num_tokens: int, num_reqs: int, num_heads: int) -> tuple[Tiles, int, int]:
    """The launch's tile and its (BLOCK_H, BLOCK_Q): all of a token's heads in a tile up to the
    tile's rows, then as many tokens as fill them (decode-like launches: one token)."""
    decode_like = num_tokens <= num_reqs
    tiles = DECODE_TILES if decode_like else EXTEND_TILES
    heads_p = triton.next_power_of_2(num_heads)
    if decode_like:  # 16 rows at least (tl.dot's M on a GPU), padded with masked heads
        return tiles, min(max(heads_p, 16), tiles.block_m), 1
    block_h = min(heads_p, tiles.block_m)
    return tiles, block_h, tiles.block_m // block_h


def _launch(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    num_kv_splits: int | None,
) -> torch.Tensor:
    if num_kv_splits is not None and (not isinstance(num_kv_splits, int) or num_kv_splits < 1):
        raise ValueError(f"num_kv_splits must be a positive int, got {num_kv_splits!r}")
    if out is None:
        out = q_latent.new_empty(q_latent.shape)
    num_tokens, num_heads, lora = q_latent.shape
    rope = q_pe.shape[2]
    num_reqs = block_tables.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_size = cache.shape[1]
    # Launch parameters from shapes only (a captured graph's replays stay right).
    tiles, block_h, block_q = latent_tiles(num_tokens, num_reqs, num_heads)
    head_tiles = triton.cdiv(num_heads, block_h)
    num_tiles = num_tokens // block_q + num_reqs
    if num_kv_splits is None:
        real_tiles = num_reqs if num_tokens <= num_reqs else triton.cdiv(num_tokens, block_q)
        num_kv_splits = default_num_kv_splits(
            real_tiles * head_tiles, block_tables.shape[1] * block_size, q_latent.device
        )
    lora_p = max(16, triton.next_power_of_2(lora))  # tl.dot needs K, N >= 16 on a GPU
    if num_kv_splits > 1:
        part_out = torch.empty(
            (num_kv_splits, num_tokens, num_heads, lora), device=out.device, dtype=torch.float32
        )
        part_lse = torch.empty(
            (num_kv_splits, num_tokens, num_heads), device=out.device, dtype=torch.float32
        )
    else:  # unused, but fp32 like the scratch: a pointer of another dtype is another variant
        part_out = part_lse = torch.empty(0, device=out.device, dtype=torch.float32)
    _latent_attention_kernel[(head_tiles, num_tiles, num_kv_splits)](
        q_latent,
        q_pe,
        cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        num_reqs,
        num_tokens,
        num_heads,
        scale * _LOG2E,
        out.stride(0),
        out.stride(1),
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        BLOCK_SIZE=block_size,
        LORA=lora,
        LORA_P=lora_p,
        ROPE=rope,
        ROPE_P=max(16, triton.next_power_of_2(max(rope, 1))),
        BLOCK_H=block_h,
        BLOCK_Q=block_q,
        BLOCK_N=tiles.block_n,
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else None,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_kv_splits > 1:
        block_h, split_tile = _merge_tile(num_kv_splits, num_heads, lora_p)
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            part_out,
            part_lse,
            out,
            num_kv_splits,
            num_tokens,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=lora,
            HEAD_DIM_P=lora_p,
            BLOCK_H=block_h,
            SPLIT_TILE=split_tile,
            num_warps=4,
        )
    return out
