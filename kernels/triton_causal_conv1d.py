"""Triton causal_conv1d: the depthwise causal convolution of a packed step with per-request
windows (see `recurrent_reference.causal_conv1d` for the contract).

Two launches: the convolution, one program per (request, channel tile, token tile), every output
independent of the others (a tap reads the request's own input or, before its first token, its
window); then the window update, one program per (request, channel tile), which reads the new
window's K - 1 inputs before it writes any, so the first launch never sees a half-written slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.recurrent_checks import check_causal_conv1d
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

__all__ = ["causal_conv1d"]

CHANNEL_TILE = 64
TOKEN_TILE = 16


@triton.jit
def _conv_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,
    states_ptr,
    out_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    initial_ptr,
    stride_xt,
    stride_wc,
    stride_ss,
    stride_sk,
    stride_ot,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64) - start
    t0 = tl.program_id(2) * BLOCK_T
    if t0 >= length:
        return
    slot = tl.load(slots_ptr + req)
    initial = tl.load(initial_ptr + req) != 0
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = t0 + tl.arange(0, BLOCK_T)
    mask_c = offs_c < CHANNELS
    mask_t = offs_t < length
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        # tap j of output t reads seq[t + j], seq = window (K - 1 inputs) ++ the request's tokens
        src = offs_t + j - (WIDTH - 1)
        from_x = (src >= 0) & mask_t
        from_window = (src < 0) & mask_t
        xv = tl.load(
            x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :],
            mask=from_x[:, None] & mask_c[None, :],
            other=0.0,
        ).to(tl.float32)
        wv = tl.load(
            states_ptr
            + slot * stride_ss
            + (WIDTH - 1 + src)[:, None] * stride_sk
            + offs_c[None, :],
            mask=from_window[:, None] & mask_c[None, :],
            other=0.0,
        )
        wv = tl.where(initial, wv.to(tl.float32), 0.0)
        w = tl.load(weight_ptr + offs_c * stride_wc + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv + wv) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    dst = out_ptr + (start + offs_t)[:, None] * stride_ot + offs_c[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _window_kernel(
    x_ptr,
    states_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    initial_ptr,
    stride_xt,
    stride_ss,
    stride_sk,
    CHANNELS: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    length = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64) - start
    slot = tl.load(slots_ptr + req)
    initial = tl.load(initial_ptr + req) != 0
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)
    mask_c = offs_c < CHANNELS
    mask_w = offs_w < WIDTH - 1
    # the new window is seq[length .. length + K - 2]; seq index i is input i - (K - 1)
    src = length + offs_w - (WIDTH - 1)
    from_x = (src >= 0) & mask_w
    from_window = (src < 0) & mask_w
    base = states_ptr + slot * stride_ss
    xv = tl.load(
        x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :],
        mask=from_x[:, None] & mask_c[None, :],
        other=0.0,
    )
    wv = tl.load(
        base + (WIDTH - 1 + src)[:, None] * stride_sk + offs_c[None, :],
        mask=from_window[:, None] & mask_c[None, :],
        other=0.0,
    )
    window = xv.to(tl.float32) + tl.where(initial, wv.to(tl.float32), 0.0)
    dst = base + offs_w[:, None] * stride_sk + offs_c[None, :]
    tl.store(dst, window.to(states_ptr.dtype.element_ty), mask=mask_w[:, None] & mask_c[None, :])


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    metadata: RecurrentMetadata,
    activation: str | None = None,
) -> torch.Tensor:
    """See `recurrent_reference.causal_conv1d`. One program per (request, 64 channels, 16 tokens),
    then one per (request, 64 channels) for the windows."""
    check_causal_conv1d(x, weight, bias, conv_states, metadata, activation)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if metadata.num_reqs == 0:
        return out
    channels, width = weight.shape
    tiles_c = triton.cdiv(channels, CHANNEL_TILE)
    args = (metadata.cu_seqlens, metadata.slot_ids, metadata.initial)
    _conv_kernel[(metadata.num_reqs, tiles_c, triton.cdiv(metadata.max_query_len, TOKEN_TILE))](
        x,
        weight,
        weight if bias is None else bias,
        conv_states,
        out,
        *args,
        x.stride(0),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        out.stride(0),
        CHANNELS=channels,
        WIDTH=width,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_C=CHANNEL_TILE,
        BLOCK_T=TOKEN_TILE,
    )
    _window_kernel[(metadata.num_reqs, tiles_c)](
        x,
        conv_states,
        *args,
        x.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        CHANNELS=channels,
        WIDTH=width,
        BLOCK_C=CHANNEL_TILE,
        BLOCK_W=triton.next_power_of_2(width - 1),
    )
    return out
