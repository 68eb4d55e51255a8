"""Triton expanded latent attention: MLA's prefill form, the context up-projected a chunk at a time.

For each chunk of context positions [c0, c0 + chunk) (host-known: the step's lengths are):

    1. `_gather_latents_kernel`: each request's latents of the chunk, through its block table,
       packed into a contiguous [positions, L + R] buffer (request r at cu_seqlens_k[r]);
    2. kv_b_proj on the buffer's latents (a torch matmul): k_nope and v of every head,
       [positions, num_heads, P + V];
    3. `_expanded_chunk_kernel`: causal attention of a tile of BLOCK_M new tokens of one request
       and one head over its positions of the chunk, keys [k_nope | k_pe] (k_pe read from the
       buffer: one copy shared by every head), values v. It resumes the online softmax from the
       running state of the earlier chunks (normalised output and log-sum-exp, fp32) and writes
       it back: the merge of the chunks costs no kernel of its own.

The up-projected chunk is the only memory the form needs beyond the output: positions x heads x
(P + V) values, bounded by the chunk size (`latent_reference.expanded_chunk_size`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixkv.kernels.latent_checks import (
    check_expanded_query,
    check_latent_step,
    check_loose_metadata,
    check_step_tokens,
)
from radixkv.kernels.latent_reference import expanded_chunk_size
from radixkv.kernels.metadata import AttentionMetadata
from radixkv.kernels.triton_latent_attention import softmax_finish, softmax_step
from radixkv.kernels.triton_paged_attention import _LOG2E, Tiles, _find_request

__all__ = ["expanded_latent_attention", "expanded_latent_attention_step"]

# The chunk kernel's tile: query rows of one head x chunk positions an iteration. 16-bit inputs:
# 128 x 32 at 8 warps (sm_90 at DeepSeek V3's P + R = 192, V = 128: 180 registers, 112 KiB, no
# spills; 128 x 32 at 4 warps spills); fp32 takes twice the registers: half the rows.
CHUNK_TILES = Tiles(128, 32, 8, 2)
_WIDE_CHUNK_TILES = Tiles(64, 32, 4, 2)
# Positions a gather program copies: [4, L + R] values, a few registers a thread.
_GATHER_TOKENS = 4


# The step's metadata tensors are views at per-step offsets of the engine's step buffer.
@triton.jit(
    do_not_specialize=("chunk_start", "stride_btr"),
    do_not_specialize_on_alignment=("block_tables_ptr",),
)
def _gather_latents_kernel(
    cache_ptr,
    dst_ptr,
    block_tables_ptr,
    cu_seqlens_k_ptr,
    chunk_start,
    stride_cb,
    stride_cs,
    stride_btr,
    stride_btc,
    LORA: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    req = tl.program_id(1)
    k_begin = tl.load(cu_seqlens_k_ptr + req)
    k_len = tl.load(cu_seqlens_k_ptr + req + 1) - k_begin
    j = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    valid = j < k_len
    pos = chunk_start + j
    table_row = block_tables_ptr + req.to(tl.int64) * stride_btr
    block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_btc, mask=valid, other=0)
    src = (cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs)[:, None]
    dst = dst_ptr + ((k_begin + j).to(tl.int64) * (LORA + ROPE))[:, None]
    # The two parts apart: one padded width of L + R (1024 for 576) would waste 44 % of it.
    offs_l = tl.arange(0, LORA_P)[None, :]
    mask = valid[:, None] & (offs_l < LORA)
    tl.store(dst + offs_l, tl.load(src + offs_l, mask=mask), mask=mask)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_P)[None, :]
        mask = valid[:, None] & (offs_r < ROPE)
        tl.store(dst + LORA + offs_r, tl.load(src + LORA + offs_r, mask=mask), mask=mask)


@triton.jit(
    do_not_specialize=(
        "num_reqs",
        "num_tokens",
        "chunk_start",
        "stride_qnt",
        "stride_qnh",
        "stride_qpt",
        "stride_qph",
    ),
    do_not_specialize_on_alignment=("seq_lens_ptr", "cu_seqlens_q_ptr"),
)
def _expanded_chunk_kernel(
    q_nope_ptr,
    q_pe_ptr,
    kv_ptr,  # [chunk positions, num_heads, NOPE + VDIM]: this chunk's up-projected latents
    latents_ptr,  # [chunk positions, LORA + ROPE]: the gathered latents (k_pe read from them)
    state_ptr,  # fp32 [num_tokens, num_heads, VDIM]: the softmax-normalised output so far
    lse_ptr,  # fp32 [num_tokens, num_heads]: its log-sum-exp (base 2), -inf without mass
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,  # int32 [num_reqs + 1]: request r's chunk positions in the buffers
    num_reqs,
    num_tokens,
    num_heads,
    chunk_start,
    qk_scale,  # softmax scale * log2(e)
    stride_qnt,
    stride_qnh,
    stride_qpt,
    stride_qph,
    LORA: tl.constexpr,
    NOPE: tl.constexpr,
    NOPE_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    VDIM: tl.constexpr,
    VDIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREV: tl.constexpr,  # an earlier chunk wrote the state
    DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    req = _find_request(cu_seqlens_q_ptr, tile_id, num_reqs, BLOCK_M)
    q_begin = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_begin
    q_tile_start = (tile_id - (q_begin // BLOCK_M + req)) * BLOCK_M
    if q_tile_start >= q_len:
        return  # a spare tile of the upper-bound grid
    ctx_len = tl.load(seq_lens_ptr + req) - q_len
    k_begin = tl.load(cu_seqlens_k_ptr + req)
    k_len = tl.load(cu_seqlens_k_ptr + req + 1) - k_begin
    # The tile's last query (position ctx_len + last q_idx) sees chunk positions j < j_end.
    j_end = tl.minimum(k_len, ctx_len + tl.minimum(q_tile_start + BLOCK_M, q_len) - chunk_start)
    if HAS_PREV and j_end <= 0:
        return  # nothing of this chunk is visible: the state stands

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + offs_m
    row_valid = q_idx < q_len
    token = (q_begin + q_idx).to(tl.int64)
    q_pos = ctx_len + q_idx
    offs_p = tl.arange(0, NOPE_P)
    offs_r = tl.arange(0, ROPE_P)
    offs_v = tl.arange(0, VDIM_P)
    q_nope = tl.load(
        q_nope_ptr + token[:, None] * stride_qnt + head * stride_qnh + offs_p[None, :],
        mask=row_valid[:, None] & (offs_p < NOPE)[None, :],
        other=0.0,
    )
    if ROPE > 0:
        q_pe = tl.load(
            q_pe_ptr + token[:, None] * stride_qpt + head * stride_qph + offs_r[None, :],
            mask=row_valid[:, None] & (offs_r < ROPE)[None, :],
            other=0.0,
        )
    state_rows = token * num_heads + head  # [BLOCK_M] rows of state / lse
    v_mask = row_valid[:, None] & (offs_v < VDIM)[None, :]
    if HAS_PREV:
        m_i = tl.load(lse_ptr + state_rows, mask=row_valid, other=float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        o = tl.load(state_ptr + state_rows[:, None] * VDIM + offs_v[None, :], mask=v_mask, other=0)
        acc = o * l_i[:, None]
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, VDIM_P], dtype=tl.float32)

    kv_width = num_heads * (NOPE + VDIM)
    for start_n in range(0, j_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < j_end
        position = (k_begin + offs_n).to(tl.int64)
        kv_row = kv_ptr + position * kv_width + head * (NOPE + VDIM)  # [BLOCK_N]
        k_nope = tl.load(  # [NOPE_P, BLOCK_N]: the transposed operand of q @ k^T
            kv_row[None, :] + offs_p[:, None],
            mask=n_valid[None, :] & (offs_p < NOPE)[:, None],
            other=0.0,
        )
        s = tl.dot(q_nope, k_nope, input_precision=DOT_PRECISION)
        if ROPE > 0:
            k_pe = tl.load(
                latents_ptr + position[None, :] * (LORA + ROPE) + LORA + offs_r[:, None],
                mask=n_valid[None, :] & (offs_r < ROPE)[:, None],
                other=0.0,
            )
            s += tl.dot(q_pe, k_pe, input_precision=DOT_PRECISION)
        s = s * qk_scale
        visible = ((chunk_start + offs_n)[None, :] <= q_pos[:, None]) & n_valid[None, :]
        s = tl.where(visible, s, float("-inf"))

        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        v = tl.load(
            kv_row[:, None] + NOPE + offs_v[None, :],
            mask=n_valid[:, None] & (offs_v < VDIM)[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)

    o, lse = softmax_finish(acc, m_i, l_i)
    tl.store(state_ptr + state_rows[:, None] * VDIM + offs_v[None, :], o, mask=v_mask)
    tl.store(lse_ptr + state_rows, lse, mask=row_valid)


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
    """MLA's expanded attention in Triton; the contract is the reference's. Reads seq_lens and
    cu_seqlens_q on the host (a sync on CUDA: the engine calls the `_step` form)."""
    check_expanded_query(q_nope, q_pe, cache, kv_b_weight, scale)
    check_loose_metadata(q_nope, cache, block_tables, seq_lens, cu_seqlens_q)
    lens, cu = seq_lens.tolist(), cu_seqlens_q.tolist()
    return _launch(
        q_nope,
        q_pe,
        cache,
        (block_tables, seq_lens, cu_seqlens_q),
        lens,
        cu,
        kv_b_weight,
        scale,
        chunk_size,
    )


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
    """`expanded_latent_attention` over metadata checked when it was built (its host lengths
    lay out the chunks: no sync)."""
    check_expanded_query(q_nope, q_pe, cache, kv_b_weight, scale)
    check_latent_step(cache, metadata)
    check_step_tokens(q_nope, metadata)
    tables = (metadata.block_tables, metadata.seq_lens, metadata.cu_seqlens_q)
    return _launch(
        q_nope,
        q_pe,
        cache,
        tables,
        list(metadata.seq_lens_host),
        list(metadata.cu_seqlens_q_host),
        kv_b_weight,
        scale,
        chunk_size,
    )


def _launch(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lens: list[int],
    cu: list[int],
    kv_b_weight: torch.Tensor,
    scale: float,
    chunk_size: int | None,
) -> torch.Tensor:
    block_tables, seq_lens, cu_seqlens_q = tables
    num_tokens, num_heads, nope = q_nope.shape
    rope = q_pe.shape[2]
    width = cache.shape[2]
    lora = width - rope
    v_dim = kv_b_weight.shape[0] // num_heads - nope
    chunk = expanded_chunk_size(num_heads, nope + v_dim, chunk_size)
    device = q_nope.device
    state = torch.empty((num_tokens, num_heads, v_dim), device=device, dtype=torch.float32)
    lse = torch.empty((num_tokens, num_heads), device=device, dtype=torch.float32)
    num_reqs = len(lens)
    if num_tokens == 0 or num_reqs == 0:
        return state.to(q_nope.dtype)
    # Requests without new tokens read nothing.
    spans = [s if cu[r + 1] > cu[r] else 0 for r, s in enumerate(lens)]
    dims = dict(
        LORA=lora,
        NOPE=nope,
        NOPE_P=max(16, triton.next_power_of_2(nope)),
        ROPE=rope,
        ROPE_P=max(16, triton.next_power_of_2(max(rope, 1))),
        VDIM=v_dim,
        VDIM_P=max(16, triton.next_power_of_2(v_dim)),
    )
    for chunk_start in range(0, max(spans), chunk):
        k_lens = [min(max(s - chunk_start, 0), chunk) for s in spans]
        cu_k_host = [0]
        for n in k_lens:
            cu_k_host.append(cu_k_host[-1] + n)
        cu_k = torch.tensor(cu_k_host, dtype=torch.int32, device=device)
        latents = torch.empty((cu_k_host[-1], width), device=device, dtype=cache.dtype)
        _gather_latents_kernel[(triton.cdiv(max(k_lens), _GATHER_TOKENS), num_reqs)](
            cache,
            latents,
            block_tables,
            cu_k,
            chunk_start,
            cache.stride(0),
            cache.stride(1),
            block_tables.stride(0),
            block_tables.stride(1),
            LORA=lora,
            LORA_P=triton.next_power_of_2(lora),
            ROPE=rope,
            ROPE_P=triton.next_power_of_2(max(rope, 1)),
            BLOCK_SIZE=cache.shape[1],
            TOKENS=_GATHER_TOKENS,
            num_warps=4,
        )
        kv = F.linear(latents[:, :lora], kv_b_weight)  # [positions, num_heads * (P + V)]
        tiles = _WIDE_CHUNK_TILES if q_nope.dtype == torch.float32 else CHUNK_TILES
        _expanded_chunk_kernel[(num_tokens // tiles.block_m + num_reqs, num_heads)](
            q_nope,
            q_pe,
            kv,
            latents,
            state,
            lse,
            seq_lens,
            cu_seqlens_q,
            cu_k,
            num_reqs,
            num_tokens,
            num_heads,
            chunk_start,
            scale * _LOG2E,
            q_nope.stride(0),
            q_nope.stride(1),
            q_pe.stride(0),
            q_pe.stride(1),
            **dims,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            HAS_PREV=chunk_start > 0,
            DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else None,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
    return state.to(q_nope.dtype)
