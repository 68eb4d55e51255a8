"""Triton store_kv: scatter new tokens' K/V into their cache slots (slot < 0: padding, skipped).

The slot mapping is a view at a per-step offset of the engine's step buffer, and the new K/V of
transformers' attention hook are [heads, tokens] views whose head stride follows the token count:
neither specializes (see `triton_paged_attention`'s docstring on compiled variants)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.checks import check_store_kv
from radixkv.kernels.metadata import AttentionMetadata, check_store_step

__all__ = ["store_kv", "store_kv_step"]


@triton.jit(
    do_not_specialize=("stride_kt", "stride_kh", "stride_vt", "stride_vh"),
    do_not_specialize_on_alignment=("slot_mapping_ptr",),
)
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_block * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + in_block * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V at `slot = block_id * block_size + offset`, in place; slot < 0: skip.

    key, value: [num_tokens, num_kv_heads, head_dim] (any token/head strides, unit head_dim stride);
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], key's dtype and device;
    slot_mapping: int32/int64 [num_tokens]. Slot values are checked for CPU tensors only (no sync).
    One program per token.
    """
    check_store_kv(
        key, value, k_cache, v_cache, slot_mapping, check_values=key.device.type == "cpu"
    )
    _launch(key, value, k_cache, v_cache, slot_mapping)


def store_kv_step(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """`store_kv` at `metadata.slot_mapping`, whose values were checked when it was built."""
    check_store_step(key, value, k_cache, v_cache, metadata)
    assert metadata.slot_mapping is not None  # checked above
    _launch(key, value, k_cache, v_cache, metadata.slot_mapping)


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
