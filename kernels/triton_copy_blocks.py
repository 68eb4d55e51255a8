"""Triton copy_blocks: copy the first num_slots[i] slots of block src[i] into dst[i], every layer.

The copy-on-write of a partially matched tail block: a request never writes into a block the radix
tree shares, so the valid leading slots are copied into its fresh private block first. The three
index vectors are views at per-step offsets of the engine's step buffer: their alignment does not
specialize the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.checks import check_copy_blocks

__all__ = ["copy_blocks"]


@triton.jit(do_not_specialize_on_alignment=("src_ptr", "dst_ptr", "num_slots_ptr"))
def _copy_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    src_ptr,
    dst_ptr,
    num_slots_ptr,
    stride_kl,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vl,
    stride_vb,
    stride_vs,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    num_slots = tl.load(num_slots_ptr + pair)
    if tl.program_id(2) * BLOCK_S >= num_slots:
        return
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (
        (offs_s < num_slots)[:, None, None]
        & (offs_h < NUM_KV_HEADS)[None, :, None]
        & (offs_d < HEAD_DIM)[None, None, :]
    )
    s64 = offs_s.to(tl.int64)[:, None, None]
    h64 = offs_h.to(tl.int64)[None, :, None]
    d = offs_d[None, None, :]

    k_in = s64 * stride_ks + h64 * stride_kh + d  # [BLOCK_S, HEADS_P, HEAD_DIM_P]
    k_layer = k_cache_ptr + layer * stride_kl
    k = tl.load(k_layer + src * stride_kb + k_in, mask=mask)
    tl.store(k_layer + dst * stride_kb + k_in, k, mask=mask)

    v_in = s64 * stride_vs + h64 * stride_vh + d
    v_layer = v_cache_ptr + layer * stride_vl
    v = tl.load(v_layer + src * stride_vb + v_in, mask=mask)
    tl.store(v_layer + dst * stride_vb + v_in, v, mask=mask)


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slots: torch.Tensor,
) -> None:
    """Copy the first num_slots[i] slots of block src[i] into block dst[i], in K and V, in place.

    k_cache, v_cache: one layer [num_blocks, block_size, num_kv_heads, head_dim] or all layers
    stacked [num_layers, num_blocks, block_size, num_kv_heads, head_dim] (every layer is copied);
    src, dst, num_slots: int32/int64 [n] on the cache's device. dst blocks must be distinct and not
    among the src blocks (checked for CPU tensors only). grid = (n, num_layers, slot chunks).
    """
    check_copy_blocks(k_cache, v_cache, src, dst, num_slots, check_values=src.device.type == "cpu")
    if src.numel() == 0:
        return
    if k_cache.dim() == 4:  # one layer: a stack of one, layer stride unused
        k_cache, v_cache = k_cache.unsqueeze(0), v_cache.unsqueeze(0)
    num_layers, _, block_size, num_kv_heads, head_dim = k_cache.shape
    heads_p = triton.next_power_of_2(num_kv_heads)
    head_dim_p = triton.next_power_of_2(head_dim)
    # ~4k elements per program: a few KiB in flight per tensor.
    block_s = max(1, min(triton.next_power_of_2(block_size), 4096 // (heads_p * head_dim_p)))
    grid = (src.numel(), num_layers, triton.cdiv(block_size, block_s))
    _copy_blocks_kernel[grid](
        k_cache,
        v_cache,
        src,
        dst,
        num_slots,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=heads_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_S=block_s,
        num_warps=4,
    )
