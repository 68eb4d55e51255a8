"""Triton store_latent: scatter new tokens' [latent | k_pe] into their latent cache slots.

One program takes a tile of tokens and writes each one's two parts side by side into its slot
(slot < 0: padding, skipped), so the model never concatenates them. The latent is a view of the
kv_a projection's output after its norm, k_pe one of RoPE's: their token strides follow the
model's widths, and the slot mapping is a view at a per-step offset of the engine's step buffer,
so neither the token count nor that pointer's alignment specializes the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.latent_checks import check_store_latent, check_store_latent_step
from radixkv.kernels.metadata import AttentionMetadata

__all__ = ["store_latent", "store_latent_step"]


@triton.jit(do_not_specialize=("num_tokens",), do_not_specialize_on_alignment=("slot_mapping_ptr",))
def _store_latent_kernel(
    latent_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_lt,
    stride_pt,
    stride_cb,
    stride_cs,
    LORA: tl.constexpr,
    LORA_P: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    written = slot >= 0
    slot = tl.where(written, slot, 0)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs

    offs_l = tl.arange(0, LORA_P)
    mask_l = written[:, None] & (offs_l < LORA)[None, :]
    latent = tl.load(latent_ptr + t[:, None] * stride_lt + offs_l[None, :], mask=mask_l)
    tl.store(dst[:, None] + offs_l[None, :], latent, mask=mask_l)
    if ROPE > 0:
        offs_r = tl.arange(0, ROPE_P)
        mask_r = written[:, None] & (offs_r < ROPE)[None, :]
        k_pe = tl.load(k_pe_ptr + t[:, None] * stride_pt + offs_r[None, :], mask=mask_r)
        tl.store(dst[:, None] + LORA + offs_r[None, :], k_pe, mask=mask_r)


def store_latent(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' [latent | k_pe] at their slots, in place; slot < 0: skip. Shapes as
    `latent_reference.store_latent`, the spec. Slot values are checked for CPU tensors only."""
    check_store_latent(latent, k_pe, cache, slot_mapping, check_values=cache.device.type == "cpu")
    _launch(latent, k_pe, cache, slot_mapping)


def store_latent_step(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """`store_latent` at `metadata.slot_mapping`, whose values were checked when it was built."""
    check_store_latent_step(latent, k_pe, cache, metadata)
    assert metadata.slot_mapping is not None  # checked above
    _launch(latent, k_pe, cache, metadata.slot_mapping)


def _launch(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, lora = latent.shape
    if num_tokens == 0:
        return
    rope = k_pe.shape[1]
    lora_p = triton.next_power_of_2(lora)
    # ~2k values a program: 4 tokens of DeepSeek V3's 576, a few dozen of a tiny model's.
    tokens = max(1, min(64, 2048 // lora_p))
    _store_latent_kernel[(triton.cdiv(num_tokens, tokens),)](
        latent,
        k_pe,
        cache,
        slot_mapping,
        num_tokens,
        latent.stride(0),
        k_pe.stride(0),
        cache.stride(0),
        cache.stride(1),
        LORA=lora,
        LORA_P=lora_p,
        ROPE=rope,
        ROPE_P=triton.next_power_of_2(max(rope, 1)),
        BLOCK_SIZE=cache.shape[1],
        TOKENS=tokens,
        num_warps=4,
    )
