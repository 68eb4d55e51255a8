"""Input validation of the recurrent kernels, shared by the torch reference and the Triton
launchers: shapes, dtypes and devices against the step's `RecurrentMetadata` (whose values were
checked when it was built). Every failure is a `ValueError` naming the offending argument."""

from __future__ import annotations

import torch

from radixkv.kernels.checks import _check_tensor, _require
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ACTIVATIONS = (None, "silu")


def _check_float(name: str, t: object, ndim: int, device: torch.device) -> torch.Tensor:
    t = _check_tensor(name, t)
    _require(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _require(t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} not in {FLOAT_DTYPES}")
    _require(t.device == device, f"{name} is on {t.device}, expected {device}")
    return t


def _check_tokens(name: str, t: torch.Tensor, metadata: RecurrentMetadata) -> None:
    _require(
        t.shape[0] == metadata.num_tokens,
        f"{name} has {t.shape[0]} tokens, the metadata packs {metadata.num_tokens}",
    )


def _check_states(name: str, states: torch.Tensor, shape: tuple[int, ...]) -> None:
    _require(
        tuple(states.shape[1:]) == shape,
        f"{name} must be [num_slots, {', '.join(map(str, shape))}], got {tuple(states.shape)}",
    )
    _require(states.is_contiguous(), f"{name} must be contiguous")


def _check_metadata(metadata: object, device: torch.device, num_slots: int) -> RecurrentMetadata:
    _require(
        isinstance(metadata, RecurrentMetadata),
        f"metadata must be a RecurrentMetadata, got {type(metadata).__name__}",
    )
    assert isinstance(metadata, RecurrentMetadata)
    _require(metadata.cu_seqlens.device == device, "metadata lives on another device")
    _require(
        all(s < num_slots for s in metadata.slots),
        f"metadata's slots {metadata.slots} exceed the {num_slots} state slots",
    )
    return metadata


def check_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    metadata: RecurrentMetadata,
    activation: str | None,
) -> None:
    """x [T, C]; weight [C, K]; bias [C] or None; conv_states [S, K - 1, C]."""
    device = _check_tensor("x", x).device
    _check_float("x", x, 2, device)
    _check_float("weight", weight, 2, device)
    channels, width = x.shape[1], weight.shape[1]
    _require(
        weight.shape[0] == channels, f"weight must be [{channels}, K], got {tuple(weight.shape)}"
    )
    _require(width >= 2, f"the kernel width must be >= 2, got {width}")
    if bias is not None:
        _check_float("bias", bias, 1, device)
        _require(bias.shape == (channels,), f"bias must be [{channels}], got {tuple(bias.shape)}")
    _check_float("conv_states", conv_states, 3, device)
    _check_states("conv_states", conv_states, (width - 1, channels))
    _require(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}")
    _check_tokens("x", x, _check_metadata(metadata, device, conv_states.shape[0]))


def check_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
) -> None:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv] (Hv a multiple of Hk); g [T, Hv] or [T, Hv, Dk] (a decay
    a key channel); beta [T, Hv]; states [S, Hv, Dk, Dv]."""
    device = _check_tensor("v", v).device
    _check_float("v", v, 3, device)
    _check_float("q", q, 3, device)
    _check_float("k", k, 3, device)
    _require(q.shape == k.shape, f"q {tuple(q.shape)} and k {tuple(k.shape)} differ")
    tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1:]
    _require(
        num_v_heads % num_k_heads == 0,
        f"v's {num_v_heads} heads are not a multiple of q/k's {num_k_heads}",
    )
    _check_float("beta", beta, 2, device)
    _require(beta.shape == (tokens, num_v_heads), f"beta must be [{tokens}, {num_v_heads}]")
    g = _check_tensor("g", g)
    _require(
        g.shape in ((tokens, num_v_heads), (tokens, num_v_heads, k_dim)),
        f"g must be [{tokens}, {num_v_heads}] or [{tokens}, {num_v_heads}, {k_dim}], "
        f"got {tuple(g.shape)}",
    )
    _check_float("g", g, g.dim(), device)
    _check_float("states", states, 4, device)
    _check_states("states", states, (num_v_heads, k_dim, v_dim))
    _check_tokens("q", q, _check_metadata(metadata, device, states.shape[0]))
    _require(v.shape[0] == tokens, f"v has {v.shape[0]} tokens, q has {tokens}")


def check_ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    dt_bias: torch.Tensor | None,
) -> None:
    """x [T, H, P]; dt [T, H]; A [H] or [H, N]; B, C [T, G, N] (H a multiple of G); D and
    dt_bias [H] or None; states [S, H, P, N]."""
    device = _check_tensor("x", x).device
    _check_float("x", x, 3, device)
    tokens, heads, head_dim = x.shape
    _check_float("dt", dt, 2, device)
    _require(dt.shape == (tokens, heads), f"dt must be [{tokens}, {heads}], got {tuple(dt.shape)}")
    _check_float("B", B, 3, device)
    _check_float("C", C, 3, device)
    _require(B.shape == C.shape, f"B {tuple(B.shape)} and C {tuple(C.shape)} differ")
    _require(B.shape[0] == tokens, f"B has {B.shape[0]} tokens, x has {tokens}")
    groups, state_dim = B.shape[1:]
    _require(heads % groups == 0, f"x's {heads} heads are not a multiple of B's {groups} groups")
    A = _check_tensor("A", A)
    _require(
        A.shape in ((heads,), (heads, state_dim)),
        f"A must be [{heads}] or [{heads}, {state_dim}], got {tuple(A.shape)}",
    )
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _check_float(name, t, 1, device)
            _require(t.shape == (heads,), f"{name} must be [{heads}], got {tuple(t.shape)}")
    _check_float("states", states, 4, device)
    _check_states("states", states, (heads, head_dim, state_dim))
    _check_tokens("x", x, _check_metadata(metadata, device, states.shape[0]))
