"""Triton rope_store_kv: rotary embedding of q and k fused with the K/V store, in one kernel.

transformers applies RoPE as about ten small kernels per layer (slices, negation, concatenation,
products, sums for q and k) and the attention hook then stores K/V in another; here a program takes
a tile of tokens, reads their q, k, v and cos / sin rows once, writes the rotated q to a new tensor
and the rotated k and v into their cache slots (q only for a pad token, slot < 0). The arithmetic
is fp32 with one rounding at the end, where transformers rounds each product and the sum in the
model's dtype (the same bits in fp32 up to fused multiply-adds).

    x = [x1 | x2] (halves of head_dim)  ->  [x1 * cos1 - x2 * sin1 | x2 * cos2 + x1 * sin2]

The slot mapping is a view at a per-step offset of the engine's step buffer: its alignment does
not specialize the kernel (see `triton_paged_attention`'s docstring on compiled variants).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.checks import check_rope, check_store_kv
from radixkv.kernels.metadata import AttentionMetadata, check_store_step

__all__ = ["rope_store_kv", "rope_store_kv_step"]


@triton.jit
def _rotate(x_ptr, offs, mask, cos1, cos2, sin1, sin2, HALF: tl.constexpr):
    """The rotated halves (fp32) of the rows at x_ptr + offs, offs the start of each row."""
    x1 = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit(do_not_specialize=("num_tokens",), do_not_specialize_on_alignment=("slot_mapping_ptr",))
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_sin,
    stride_qot,
    stride_qoh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_P: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    # A tile of TOKENS tokens; tensors are [TOKENS, heads, HALF_P] (one half of head_dim).
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    t_valid = t < num_tokens
    offs_d = tl.arange(0, HALF_P)
    d_valid = offs_d < HALF
    td = t_valid[:, None] & d_valid[None, :]
    cos_row = cos_ptr + t[:, None] * stride_cos + offs_d[None, :]
    sin_row = sin_ptr + t[:, None] * stride_sin + offs_d[None, :]
    cos1 = tl.load(cos_row, mask=td).to(tl.float32)[:, None, :]
    cos2 = tl.load(cos_row + HALF, mask=td).to(tl.float32)[:, None, :]
    sin1 = tl.load(sin_row, mask=td).to(tl.float32)[:, None, :]
    sin2 = tl.load(sin_row + HALF, mask=td).to(tl.float32)[:, None, :]
    t3 = t[:, None, None]
    d3 = offs_d[None, None, :]

    qh = tl.arange(0, Q_HEADS_P)[None, :, None]
    q_mask = t_valid[:, None, None] & (qh < NUM_Q_HEADS) & d_valid[None, None, :]
    q_offs = t3 * stride_qt + qh * stride_qh + d3
    q1, q2 = _rotate(q_ptr, q_offs, q_mask, cos1, cos2, sin1, sin2, HALF)
    q_out = q_out_ptr + t3 * stride_qot + qh * stride_qoh + d3
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_mapping_ptr + t, mask=t_valid, other=-1).to(tl.int64)
    written = t_valid & (slot >= 0)  # a pad token (slot < 0) gets its q rotated, stores nothing
    slot = tl.where(written, slot, 0)
    block = (slot // BLOCK_SIZE)[:, None, None]
    in_block = (slot % BLOCK_SIZE)[:, None, None]
    kh = tl.arange(0, KV_HEADS_P)[None, :, None]
    kv_mask = written[:, None, None] & (kh < NUM_KV_HEADS) & d_valid[None, None, :]
    k1, k2 = _rotate(
        k_ptr, t3 * stride_kt + kh * stride_kh + d3, kv_mask, cos1, cos2, sin1, sin2, HALF
    )
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs + kh * stride_kch + d3
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_src = v_ptr + t3 * stride_vt + kh * stride_vh + d3
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs + kh * stride_vch + d3
    tl.store(v_dst, tl.load(v_src, mask=kv_mask), mask=kv_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kv_mask), mask=kv_mask)


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
    """Rotary embedding of q and k, k and v written at their slots; returns the rotated q (a new
    contiguous tensor). Shapes as `reference.rope_store_kv`, the spec. Slot values are checked for
    CPU tensors only (no sync)."""
    check_rope(q, k, v, cos, sin)
    check_store_kv(k, v, k_cache, v_cache, slot_mapping, check_values=q.device.type == "cpu")
    return _launch(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


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
    check_store_step(k, v, k_cache, v_cache, metadata)
    assert metadata.slot_mapping is not None  # checked above
    return _launch(q, k, v, cos, sin, k_cache, v_cache, metadata.slot_mapping)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    q_heads_p, half_p = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(half)
    # ~4k q elements a program: a token or two of a large model, tens of a small one.
    tokens = max(1, min(64, 4096 // (2 * q_heads_p * half_p)))
    _rope_store_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        q,
        k,
        v,
        cos,
        sin,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads,
        Q_HEADS_P=q_heads_p,
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_P=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_P=half_p,
        BLOCK_SIZE=k_cache.shape[1],
        TOKENS=tokens,
        num_warps=4,
    )
    return q_out
