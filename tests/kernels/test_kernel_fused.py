"""The fused elementwise kernels: RMSNorm and rotary embedding + K/V store.

The references are held to transformers' own Llama modules bit for bit (so the CPU engine's
output cannot move), and the Triton kernels (interpreted on CPU) to the references in fp32 and
fp16; bf16 runs on a GPU only (`test_kernel_gpu.py`).
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import AttentionMetadata, reference

DTYPES = [torch.float32, torch.float16]


def _rms_case(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_reference_is_transformers_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, weight = _rms_case((1, 7, 96), dtype)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        expected = norm(x)
    assert torch.equal(reference.rms_norm(x, weight, 1e-5), expected)


def test_rope_reference_is_transformers_bit_for_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 16, generator=gen)  # transformers' [batch, heads, tokens, head_dim]
    k = torch.randn(1, 2, 5, 16, generator=gen)
    cos, sin = torch.randn(2, 1, 5, 16, generator=gen)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    ours_q = reference.apply_rope(q[0].transpose(0, 1), cos[0], sin[0])
    ours_k = reference.apply_rope(k[0].transpose(0, 1), cos[0], sin[0])
    assert torch.equal(ours_q, q_rot[0].transpose(0, 1))
    assert torch.equal(ours_k, k_rot[0].transpose(0, 1))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 5, 64), (3, 100), (1, 1, 576)], ids=str)
def test_rms_norm_triton(assert_close, dtype, shape):
    from radixkv.kernels.triton_rms_norm import rms_norm

    x, weight = _rms_case(shape, dtype, seed=2)
    actual = rms_norm(x, weight, 1e-6)
    assert actual.shape == x.shape and actual.dtype == dtype
    assert_close(actual, reference.rms_norm(x, weight, 1e-6), dtype)


@pytest.mark.interpreter
def test_rms_norm_triton_promotes_like_transformers(assert_close):
    """fp32 weights over fp16 activations give fp32, as `weight * x.to(fp16)` does."""
    from radixkv.kernels.triton_rms_norm import rms_norm

    x, weight = _rms_case((4, 48), torch.float16)
    actual = rms_norm(x, weight.float(), 1e-6)
    assert actual.dtype == torch.float32
    assert_close(actual, reference.rms_norm(x, weight.float(), 1e-6), torch.float16)


def _rope_case(dtype, *, num_tokens, q_heads, kv_heads, head_dim, block_size, seed=0):
    """q/k/v as the engine's projections give them ([tokens, heads, head_dim] views of one row),
    k and v strided by a transpose, caches poisoned with NaN, some pad tokens (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * (-(-num_tokens // block_size)) + 3
    q = torch.randn(1, num_tokens, q_heads * head_dim, generator=gen).to(dtype)
    q = q.view(num_tokens, q_heads, head_dim)
    k = torch.randn(kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    v = torch.randn(kv_heads, num_tokens, head_dim, generator=gen).to(dtype).transpose(0, 1)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1
    return (q, k, v, cos, sin, *caches, slots.to(torch.int32))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (3, 3, 80, 1), (8, 1, 64, 16)],
    ids=["gqa", "mha-odd-half", "mqa"],
)
def test_rope_store_kv_triton(assert_close, dtype, q_heads, kv_heads, head_dim, block_size):
    from radixkv.kernels.triton_rope_store_kv import rope_store_kv

    shape = {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim}
    case = _rope_case(dtype, num_tokens=9, block_size=block_size, **shape)
    q, k, v, cos, sin, k_cache, v_cache, slots = case
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = reference.rope_store_kv(q, k, v, cos, sin, expected_k, expected_v, slots)
    actual_q = rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert actual_q.is_contiguous() and actual_q.shape == q.shape
    assert_close(actual_q, expected_q, dtype)
    written = slots >= 0
    assert torch.isnan(k_cache).sum() == torch.isnan(expected_k).sum()  # nothing else written
    blocks, offsets = slots[written].long() // block_size, slots[written].long() % block_size
    assert_close(k_cache[blocks, offsets], expected_k[blocks, offsets], dtype)
    assert torch.equal(v_cache[blocks, offsets], v[written])  # V is copied, never rounded


@pytest.mark.interpreter
def test_rope_store_kv_step_equals_the_loose_call():
    from radixkv.kernels import rope_store_kv_step, use_backend

    q, k, v, cos, sin, k_cache, v_cache, _ = _rope_case(
        torch.float32, num_tokens=6, q_heads=4, kv_heads=2, head_dim=16, block_size=4
    )
    # Two requests: 4 new tokens after 3 cached ones, then 2 new tokens from scratch.
    tables = torch.tensor([[5, 2], [0, 0]], dtype=torch.int32)
    slots = torch.tensor([23, 8, 9, 10, 0, 1], dtype=torch.int32)
    meta = AttentionMetadata(
        tables,
        torch.tensor([7, 2], dtype=torch.int32),
        torch.tensor([0, 4, 6], dtype=torch.int32),
        tuple(k_cache.shape),
        slot_mapping=slots,
    )
    results = {}
    for backend in ("torch", "triton"):
        caches = (k_cache.clone(), v_cache.clone())
        with use_backend(backend):
            q_rot = rope_store_kv_step(q, k, v, cos, sin, *caches, meta)
        results[backend] = (q_rot, *caches)
    loose = (k_cache.clone(), v_cache.clone())
    loose_q = reference.rope_store_kv(q, k, v, cos, sin, *loose, slots)
    for got in results.values():
        torch.testing.assert_close(got[0], loose_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], loose[0], rtol=1e-6, atol=1e-6, equal_nan=True)
        torch.testing.assert_close(got[2], loose[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]
)
def test_fused_kernels_reject_bad_input(backend):
    from radixkv.kernels import rms_norm, rope_store_kv, use_backend

    x, weight = _rms_case((2, 8), torch.float32)
    q, k, v, cos, sin, k_cache, v_cache, slots = _rope_case(
        torch.float32, num_tokens=3, q_heads=2, kv_heads=1, head_dim=8, block_size=2
    )
    with use_backend(backend):
        with pytest.raises(ValueError, match="weight"):
            rms_norm(x, weight[:4], 1e-6)
        with pytest.raises(ValueError, match="eps"):
            rms_norm(x, weight, -1.0)
        with pytest.raises(ValueError, match="cos"):
            rope_store_kv(q, k, v, cos[:2], sin, k_cache, v_cache, slots)
        with pytest.raises(ValueError, match="head_dim"):
            rope_store_kv(q[..., :7], k, v, cos, sin, k_cache, v_cache, slots)
        with pytest.raises(ValueError, match="slot_mapping"):
            rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots[:2])
