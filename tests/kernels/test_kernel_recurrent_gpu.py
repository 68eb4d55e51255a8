"""Compiled recurrent Triton kernels on a CUDA device against the torch reference (run on the same
device), at the head sizes of the real models (Qwen3.5's 128 x 128 delta-rule heads, Kimi Linear's
32 KDA heads of 128 x 128 with a decay a key channel, Mamba-2's 64 x 128 heads, a 1,536-channel
Mamba-1), which the interpreter cannot afford.

    python3 -P -m pytest -m gpu tests/kernels/test_kernel_recurrent_gpu.py
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from radixkv.kernels import RecurrentMetadata, use_backend
from radixkv.kernels import recurrent_reference as ref
from radixkv.kernels.triton_causal_conv1d import causal_conv1d as triton_causal_conv1d
from radixkv.kernels.triton_gated_delta_rule import gated_delta_rule as triton_gated_delta_rule
from radixkv.kernels.triton_ssm_scan import ssm_scan as triton_ssm_scan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
        reason="TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 to test compiled kernels",
    ),
]

# decode rows, a short extend, a long prefill from zeros and one continuing from its slot
LENS, SLOTS, INITIAL = [1, 1, 37, 300, 129], [6, 0, 3, 5, 1], [True, True, True, False, True]
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2}


def _metadata() -> RecurrentMetadata:
    return RecurrentMetadata.build(LENS, SLOTS, INITIAL, device="cuda")


def _states(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    states = torch.randn(8, *shape, device="cuda").to(dtype)
    states[5] = math.nan  # the fresh request's slot: never read
    return states


def _compare(run, states: torch.Tensor, dtype: torch.dtype) -> None:
    expected_states = states.clone()
    with use_backend("torch"):
        expected = run(ref, expected_states)
    got = run(None, states)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(
        states.float(), expected_states.float(), atol=tol, rtol=tol, equal_nan=True
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_at_qwen3_5_heads(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    n = sum(LENS)
    q, k = (torch.randn(n, 4, 128, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(n, 8, 128, device="cuda", dtype=dtype)
    g = -torch.rand(n, 8, device="cuda") * 0.1
    beta = torch.rand(n, 8, device="cuda")
    md = _metadata()

    def run(module, states):
        fn = triton_gated_delta_rule if module is None else ref.gated_delta_rule
        return fn(q, k, v, g, beta, states, md, use_qk_l2norm=True)

    _compare(run, _states((8, 128, 128), torch.float32), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kimi_delta_attention_at_kimi_linear_heads(dtype: torch.dtype) -> None:
    """Kimi Linear's KDA layers: 32 heads of 128 x 128, a decay a head and key channel."""
    torch.manual_seed(0)
    n = sum(LENS)
    q, k, v = (torch.randn(n, 32, 128, device="cuda", dtype=dtype) for _ in range(3))
    g = -torch.rand(n, 32, 128, device="cuda") * 0.5
    beta = torch.rand(n, 32, device="cuda")
    md = _metadata()

    def run(module, states):
        fn = triton_gated_delta_rule if module is None else ref.gated_delta_rule
        return fn(q, k, v, g, beta, states, md, use_qk_l2norm=True)

    _compare(run, _states((32, 128, 128), torch.float32), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mamba1", [False, True])
def test_ssm_scan_at_mamba_heads(dtype: torch.dtype, mamba1: bool) -> None:
    torch.manual_seed(0)
    n = sum(LENS)
    heads, head_dim, groups, state_dim = (1536, 1, 1, 16) if mamba1 else (16, 64, 2, 128)
    x = torch.randn(n, heads, head_dim, device="cuda", dtype=dtype)
    dt = torch.randn(n, heads, device="cuda", dtype=dtype)
    A = -torch.rand((heads, state_dim) if mamba1 else (heads,), device="cuda") - 0.1
    B, C = (torch.randn(n, groups, state_dim, device="cuda", dtype=dtype) for _ in range(2))
    D, dt_bias = torch.randn(heads, device="cuda"), torch.randn(heads, device="cuda")
    md = _metadata()

    def run(module, states):
        fn = triton_ssm_scan if module is None else ref.ssm_scan
        return fn(
            x, dt, A, B, C, D, states, md, dt_bias=dt_bias, dt_softplus=True, dt_limit=(1e-3, 5.0)
        )

    _compare(run, _states((heads, head_dim, state_dim), torch.float32), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_at_qwen3_5_channels(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    channels = 8192  # Qwen3.5-4B's q|k|v
    x = torch.randn(sum(LENS), channels, device="cuda", dtype=dtype)
    weight = torch.randn(channels, 4, device="cuda", dtype=dtype)
    md = _metadata()

    def run(module, states):
        fn = triton_causal_conv1d if module is None else ref.causal_conv1d
        return fn(x, weight, None, states, md, "silu")

    _compare(run, _states((3, channels), dtype), dtype)
