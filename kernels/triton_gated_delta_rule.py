"""Triton gated_delta_rule: Gated DeltaNet (a decay a head) and Kimi Delta Attention (a decay a
head and key channel) over a packed step, in the recurrent form, each request from and back to its
state slot (see `recurrent_reference.gated_delta_rule` for the contract).

One program per (request, value head, tile of value dims) holds its K x BLOCK_V slice of the
state in registers for the whole run of the request's tokens and writes it back once, in place:
the state never leaves the chip between tokens, which is what decode (one token per request, the
state read and written once) is bound by. A value tile needs every key dim (the delta rule's
prediction S^T k sums over them), so K is one tile, padded to a power of two.

Long prefills walk their tokens one after another here; the chunked form (matrix products over
chunks of tokens, `recurrent_reference.gated_delta_rule_chunked`) is what would use the tensor
cores for them, measured on a GPU before it is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.recurrent_checks import check_gated_delta_rule
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

__all__ = ["gated_delta_rule"]

VALUE_TILE = 32


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    states_ptr,
    out_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    initial_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ot,
    stride_oh,
    HEAD_RATIO: tl.constexpr,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    L2NORM: tl.constexpr,
    KEY_DECAY: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    qk_head = head // HEAD_RATIO
    start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64)
    slot = tl.load(slots_ptr + req)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < K_DIM
    mask_v = offs_v < V_DIM
    mask = mask_k[:, None] & mask_v[None, :]
    state_at = states_ptr + slot * stride_ss + head * stride_sh
    state_at += offs_k[:, None] * stride_sk + offs_v[None, :]
    # NOTE: a request without an initial state starts from zeros: its slot may hold anything.
    initial = tl.load(initial_ptr + req) != 0
    state = tl.where(initial, tl.load(state_at, mask=mask, other=0.0).to(tl.float32), 0.0)
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_qt + qk_head * stride_qh + offs_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + qk_head * stride_kh + offs_k, mask=mask_k, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + offs_v, mask=mask_v, other=0.0)
        beta = tl.load(beta_ptr + t * stride_bt + head).to(tl.float32)
        g_at = g_ptr + t * stride_gt + head * stride_gh
        if KEY_DECAY:  # a decay a key channel: the state's rows decay apart
            decay = tl.exp(tl.load(g_at + offs_k, mask=mask_k, other=0.0).to(tl.float32))
            state = state * decay[:, None]
        else:
            state = state * tl.exp(tl.load(g_at).to(tl.float32))
        predicted = tl.sum(state * k[:, None], 0)  # [BLOCK_V]
        delta = (v.to(tl.float32) - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(state * (q * scale)[:, None], 0)
        o_at = out_ptr + t * stride_ot + head * stride_oh + offs_v
        tl.store(o_at, o.to(out_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_at, state.to(states_ptr.dtype.element_ty), mask=mask)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """See `recurrent_reference.gated_delta_rule`. q, k, v need a unit stride on their last dim
    (copied otherwise), as do g (on its heads, or its key channels) and beta (on its heads)."""
    check_gated_delta_rule(q, k, v, g, beta, states, metadata)
    q, k, v, g, beta = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if metadata.num_reqs == 0:
        return out
    num_k_heads, k_dim = q.shape[1:]
    num_v_heads, v_dim = v.shape[1:]
    block_v = min(VALUE_TILE, triton.next_power_of_2(v_dim))
    grid = (metadata.num_reqs, num_v_heads, triton.cdiv(v_dim, block_v))
    _gated_delta_rule_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        states,
        out,
        metadata.cu_seqlens,
        metadata.slot_ids,
        metadata.initial,
        k_dim**-0.5 if scale is None else scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        out.stride(0),
        out.stride(1),
        HEAD_RATIO=num_v_heads // num_k_heads,
        K_DIM=k_dim,
        V_DIM=v_dim,
        L2NORM=use_qk_l2norm,
        KEY_DECAY=g.dim() == 3,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=block_v,
    )
    return out
