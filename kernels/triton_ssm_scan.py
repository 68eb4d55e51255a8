"""Triton ssm_scan: the selective state space recurrence of Mamba-2 (A a scalar per head) and
Mamba-1 (A per head and state channel) over a packed step, in its recurrent form, each request
from and back to its state slot (see `recurrent_reference.ssm_scan` for the contract).

One program per (request, head, tile of head dims) keeps its BLOCK_P x N slice of the state in
registers across the request's tokens and writes it back once, in place. The step size
clamp(softplus(dt + dt_bias)) is computed per token in the kernel, so the caller passes the raw
projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.recurrent_checks import check_ssm_scan
from radixkv.kernels.recurrent_metadata import RecurrentMetadata
from radixkv.kernels.recurrent_reference import NO_LIMIT

__all__ = ["ssm_scan"]

HEAD_DIM_TILE = 32
SOFTPLUS_THRESHOLD = 20.0  # torch's: above it softplus(x) is x


@triton.jit
def _ssm_scan_kernel(
    x_ptr,
    dt_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    d_ptr,
    dt_bias_ptr,
    states_ptr,
    out_ptr,
    cu_seqlens_ptr,
    slots_ptr,
    initial_ptr,
    dt_min,
    dt_max,
    stride_xt,
    stride_xh,
    stride_dtt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_ot,
    stride_oh,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_DIM: tl.constexpr,
    A_PER_STATE: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    start = tl.load(cu_seqlens_ptr + req).to(tl.int64)
    end = tl.load(cu_seqlens_ptr + req + 1).to(tl.int64)
    slot = tl.load(slots_ptr + req)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < HEAD_DIM
    mask_n = offs_n < STATE_DIM
    mask = mask_p[:, None] & mask_n[None, :]
    state_at = states_ptr + slot * stride_ss + head * stride_sh
    state_at += offs_p[:, None] * stride_sp + offs_n[None, :]
    initial = tl.load(initial_ptr + req) != 0  # without one the slot may hold anything
    state = tl.where(initial, tl.load(state_at, mask=mask, other=0.0).to(tl.float32), 0.0)
    if A_PER_STATE:
        a = tl.load(a_ptr + head * STATE_DIM + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        a = tl.load(a_ptr + head).to(tl.float32)
    skip = tl.load(d_ptr + head).to(tl.float32) if HAS_D else 0.0
    bias = tl.load(dt_bias_ptr + head).to(tl.float32) if HAS_DT_BIAS else 0.0
    for t in range(start, end):
        dt = tl.load(dt_ptr + t * stride_dtt + head).to(tl.float32) + bias
        if SOFTPLUS:
            dt = tl.where(dt > SOFTPLUS_THRESHOLD, dt, tl.log(1.0 + tl.exp(dt)))
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + t * stride_xt + head * stride_xh + offs_p, mask=mask_p, other=0.0)
        x = x.to(tl.float32)
        b = tl.load(b_ptr + t * stride_bt + group * stride_bg + offs_n, mask=mask_n, other=0.0)
        c = tl.load(c_ptr + t * stride_ct + group * stride_cg + offs_n, mask=mask_n, other=0.0)
        decay = tl.exp(dt * a)  # [BLOCK_N] per state channel (Mamba-1), else one per head
        if A_PER_STATE:
            decay = decay[None, :]
        state = state * decay + (dt * x)[:, None] * b.to(tl.float32)[None, :]
        y = tl.sum(state * c.to(tl.float32)[None, :], 1) + skip * x
        y_at = out_ptr + t * stride_ot + head * stride_oh + offs_p
        tl.store(y_at, y.to(out_ptr.dtype.element_ty), mask=mask_p)
    tl.store(state_at, state.to(states_ptr.dtype.element_ty), mask=mask)


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
) -> torch.Tensor:
    """See `recurrent_reference.ssm_scan`. x, B, C need a unit stride on their last dim and dt on
    its heads (copied otherwise)."""
    check_ssm_scan(x, dt, A, B, C, D, states, metadata, dt_bias)
    x, dt, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, dt, B, C))
    A = A.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if metadata.num_reqs == 0:
        return out
    heads, head_dim = x.shape[1:]
    groups, state_dim = B.shape[1:]
    block_p = min(HEAD_DIM_TILE, triton.next_power_of_2(head_dim))
    clamp = tuple(dt_limit) != NO_LIMIT
    _ssm_scan_kernel[(metadata.num_reqs, heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        A,
        B,
        C,
        A if D is None else D,
        A if dt_bias is None else dt_bias,
        states,
        out,
        metadata.cu_seqlens,
        metadata.slot_ids,
        metadata.initial,
        float(dt_limit[0]),
        float(min(dt_limit[1], torch.finfo(torch.float32).max)),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        out.stride(0),
        out.stride(1),
        HEADS_PER_GROUP=heads // groups,
        HEAD_DIM=head_dim,
        STATE_DIM=state_dim,
        A_PER_STATE=A.dim() == 2,
        HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None,
        SOFTPLUS=dt_softplus,
        CLAMP=clamp,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(state_dim),
    )
    return out
