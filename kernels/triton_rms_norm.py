"""Triton RMSNorm: a program normalises a tile of whole rows held in registers (hidden <= ~16k).

transformers' LlamaRMSNorm is eight small kernels (cast, pow, mean, add, rsqrt, mul, cast, mul);
this is one. It rounds where transformers rounds: the normalised row back to x's dtype before the
weight multiplies it, so bf16 results differ from transformers' only by the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixkv.kernels.checks import check_rms_norm

__all__ = ["rms_norm"]


@triton.jit(do_not_specialize=("num_rows",))
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    stride_x,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < HIDDEN)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / HIDDEN
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=offs < HIDDEN)
    out = w.to(tl.float32)[None, :] * normed.to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (see `reference.rms_norm`, the spec). x: [..., hidden] with unit
    stride on hidden; weight: [hidden]. Returns a new [..., hidden] tensor in the promoted dtype of
    weight and x."""
    check_rms_norm(x, weight, eps)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)  # a view for the engine's [1, tokens, hidden] activations
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(hidden)
    # ~4k elements a program: whole rows of a large model, many rows of a small one.
    tile_rows = max(1, 4096 // block)
    # A one-row view may report any row stride; pass the dense one so it never specializes apart.
    stride_x = rows.stride(0) if rows.shape[0] > 1 else hidden
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], tile_rows),)](
        rows,
        weight,
        out,
        rows.shape[0],
        stride_x,
        out.stride(0),
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        ROWS=tile_rows,
        num_warps=max(1, min(8, tile_rows * block // 512)),
    )
    return out.view(x.shape)
