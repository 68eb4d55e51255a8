"""Compiled Triton kernels on a CUDA device against the torch reference (run on the same device),
in bf16 / fp16 / fp32, at the sizes the interpreter cannot afford.

tests/conftest.py turns the interpreter on only where no CUDA device is present, so on a GPU:

    python3 -P -m pytest -m gpu tests/kernels
    (or: python3 -P benchmarks/kernel_bench.py --check)
"""

from __future__ import annotations

import os

import pytest
import torch

from radixkv.kernels import AttentionKind, AttentionMetadata, backend_for, reference
from radixkv.kernels.triton_copy_blocks import copy_blocks as triton_copy_blocks
from radixkv.kernels.triton_paged_attention import paged_attention as triton_paged_attention
from radixkv.kernels.triton_paged_attention import (
    paged_attention_step as triton_paged_attention_step,
)
from radixkv.kernels.triton_rms_norm import rms_norm as triton_rms_norm
from radixkv.kernels.triton_rope_store_kv import rope_store_kv as triton_rope_store_kv
from radixkv.kernels.triton_store_kv import store_kv as triton_store_kv
from radixkv.kernels.triton_store_kv import store_kv_step as triton_store_kv_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
        reason="TRITON_INTERPRET is on: run with TRITON_INTERPRET=0 to test compiled kernels",
    ),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _lens(block_size: int) -> tuple[list[int], list[int]]:
    """Decode rows at and around block boundaries, plain prefills, extends over long prefixes."""
    b = block_size
    seq_lens = [1, b - 1 if b > 1 else 1, b, b + 1, 300, 4096, 1500, 777, 2 * b + 3]
    q_lens = [1, 1, b, 1, 37, 1, 200, 777, 5]
    return seq_lens, q_lens


BLOCK_SIZES = [1, 16, 64, 256]
HEADS = [(1, 64), (3, 80), (4, 128), (8, 128)]  # (GQA group, head_dim)


def _pairs() -> list[tuple[torch.dtype, int, tuple[int, int]]]:
    """Each dtype with every block size and every head shape, paired in a shifted Latin square:
    dtype d, block size i takes head shape (i + d) % 4. Every value of each dimension runs in
    each dtype, and 12 of the 16 block-size x head-shape pairs, in 12 compiled variants where the
    full cross product took 48 (the split count is a runtime value: it adds none)."""
    return [
        (dtype, block_size, HEADS[(i + d) % len(HEADS)])
        for d, dtype in enumerate(DTYPES)
        for i, block_size in enumerate(BLOCK_SIZES)
    ]


@pytest.mark.parametrize(
    ("dtype", "block_size", "heads"),
    _pairs(),
    ids=[f"{str(d)[6:]}-b{b}-g{h[0]}-d{h[1]}" for d, b, h in _pairs()],
)
@pytest.mark.parametrize("num_kv_splits", [None, 1, 7])
def test_paged_attention_gpu(paged_batch, assert_close, dtype, block_size, heads, num_kv_splits):
    group, head_dim = heads
    seq_lens, q_lens = _lens(block_size)
    batch = paged_batch(
        seq_lens,
        q_lens,
        block_size=block_size,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device="cuda",
    )
    expected = reference.paged_attention(*batch.args)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_decode_batch_gpu(paged_batch, assert_close, dtype):
    # The benchmark shape (32 q heads over 8 kv heads, head_dim 128), default splits.
    lens = [1024, 4096, 1, 17, 3000, 2048, 64, 16384]
    batch = paged_batch(
        lens,
        [1] * len(lens),
        block_size=16,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        dtype=dtype,
        device="cuda",
    )
    assert backend_for(batch.q.device) == "triton"
    assert_close(triton_paged_attention(*batch.args), reference.paged_attention(*batch.args), dtype)


# Gemma-3-like windows (a window a few hundred tokens wide), Gemma 2's soft-cap, GPT-OSS's sinks.
GPU_KINDS = {
    "window": dict(window=256),
    "window-small": dict(window=33),
    "window-softcap": dict(window=300, softcap=50.0),
    "softcap": dict(softcap=5.0),
    "window-sinks": dict(window=128, sinks=True),
}


@pytest.mark.parametrize("name", list(GPU_KINDS))
@pytest.mark.parametrize(("dtype", "block_size"), [(torch.bfloat16, 16), (torch.float32, 64)])
@pytest.mark.parametrize("num_kv_splits", [None, 7])
def test_paged_attention_kinds_gpu(
    paged_batch, assert_close, name, dtype, block_size, num_kv_splits
):
    seq_lens, q_lens = _lens(block_size)
    batch = paged_batch(
        seq_lens, q_lens, block_size=block_size, group=4, head_dim=128, dtype=dtype, device="cuda"
    )
    options = dict(GPU_KINDS[name])
    if options.pop("sinks", False):
        gen = torch.Generator().manual_seed(1)
        options["sinks"] = torch.randn(batch.q.shape[1], generator=gen).to(dtype).cuda()
    kind = AttentionKind(**options)
    expected = reference.paged_attention(*batch.args, kind=kind)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits, kind=kind)
    assert_close(actual, expected, dtype)


def test_paged_attention_int64_offsets_gpu(assert_close):
    # A cache past 2^31 elements: block ids near the end need 64-bit offsets.
    num_blocks, block_size, heads, head_dim = 140_000, 16, 8, 128  # 2.3e9 elements, 4.6 GB bf16
    try:
        k_cache = torch.zeros(
            num_blocks, block_size, heads, head_dim, dtype=torch.bfloat16, device="cuda"
        )
        v_cache = torch.zeros_like(k_cache)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a >2^31-element cache")
    table = torch.tensor([[num_blocks - 1, 5, num_blocks - 2]], dtype=torch.int32, device="cuda")
    seq_len = 40
    pos = torch.arange(seq_len, device="cuda")
    blocks, offsets = table[0, pos // block_size].long(), pos % block_size
    k_cache[blocks, offsets] = torch.randn(seq_len, heads, head_dim, device="cuda").bfloat16()
    v_cache[blocks, offsets] = torch.randn(seq_len, heads, head_dim, device="cuda").bfloat16()
    q = torch.randn(2, 4 * heads, head_dim, device="cuda").bfloat16()
    args = (
        q,
        k_cache,
        v_cache,
        table,
        torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
        torch.tensor([0, 2], dtype=torch.int32, device="cuda"),
        head_dim**-0.5,
    )
    assert_close(triton_paged_attention(*args), reference.paged_attention(*args), torch.bfloat16)


@pytest.mark.parametrize("block_size", [1, 16])
def test_step_kernels_from_host_metadata_gpu(paged_batch, block_size):
    """The runner's CUDA path: metadata checked on host tensors, moved once; the step kernels equal
    the loose launchers exactly and never sync (a sync would raise in "error" sync-debug mode)."""
    seq_lens, q_lens = _lens(block_size)
    batch = paged_batch(
        seq_lens, q_lens, block_size=block_size, group=3, dtype=torch.float16, device="cuda"
    )
    cu, slots = batch.cu_seqlens_q.tolist(), []
    for r, seq_len in enumerate(seq_lens):
        for pos in range(seq_len - (cu[r + 1] - cu[r]), seq_len):
            block = int(batch.block_tables[r, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    meta = AttentionMetadata(
        batch.block_tables.cpu(),
        batch.seq_lens.cpu(),
        batch.cu_seqlens_q.cpu(),
        tuple(batch.k_cache.shape),
        slot_mapping=torch.tensor(slots),
        device="cuda",
    )
    assert meta.block_tables.is_cuda and meta.slot_mapping.is_cuda and meta.gather_plan is None
    key = torch.randn(len(slots), *batch.k_cache.shape[2:], device="cuda").half()
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    triton_store_kv(key, key, expected_k, expected_v, meta.slot_mapping)
    expected = triton_paged_attention(batch.q, expected_k, expected_v, *batch.args[3:])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_store_kv_step(key, key, batch.k_cache, batch.v_cache, meta)
        actual = triton_paged_attention_step(
            batch.q, batch.k_cache, batch.v_cache, meta, batch.scale
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(batch.k_cache, expected_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # The reference on CUDA (use_backend("torch")) plans per call from the same metadata.
    torch.testing.assert_close(
        reference.paged_attention_step(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale),
        reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, *batch.args[3:]),
        rtol=0,
        atol=0,
    )


# Below, each dtype meets one size: every dtype and every size run once, one compile each.
@pytest.mark.parametrize(
    ("dtype", "block_size"), list(zip(DTYPES, [1, 16, 256], strict=True)), ids=str
)
def test_store_kv_gpu(dtype, block_size):
    num_blocks, heads, head_dim, num_tokens = 64, 8, 128, 500
    shape = (num_blocks, block_size, heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    num_tokens = min(num_tokens, num_blocks * block_size)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, heads, head_dim, device="cuda").to(dtype)
    value = torch.randn(num_tokens, heads, head_dim, device="cuda").to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    triton_store_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_copy_blocks_gpu(block_size):
    shape = (4, 32, block_size, 8, 128)
    k_cache = torch.randn(shape, device="cuda").bfloat16()
    v_cache = torch.randn(shape, device="cuda").bfloat16()
    src = torch.tensor([3, 0, 9, 3], device="cuda")
    dst = torch.tensor([1, 31, 2, 5], device="cuda")
    num_slots = torch.tensor([block_size - 1, block_size, 0, 1], device="cuda")
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(expected_k, expected_v, src, dst, num_slots)
    triton_copy_blocks(k_cache, v_cache, src, dst, num_slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("dtype", "hidden"), list(zip(DTYPES, [576, 2048, 8192], strict=True)), ids=str
)
def test_rms_norm_gpu(assert_close, dtype, hidden):
    x = (torch.randn(1, 300, hidden, device="cuda") * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    assert_close(triton_rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize(
    ("dtype", "q_heads", "kv_heads", "head_dim"),
    [(torch.bfloat16, 9, 3, 64), (torch.float16, 32, 8, 64), (torch.float32, 32, 8, 128)],
    ids=str,
)
def test_rope_store_kv_gpu(assert_close, dtype, q_heads, kv_heads, head_dim):
    """The engine's layout: q/k/v views of the projections' outputs, cos/sin in the model's
    dtype, NaN-poisoned caches, a few pad tokens."""
    num_tokens, num_blocks, block_size = 300, 64, 16
    hidden = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device="cuda").to(dtype)
    q, k, v = hidden.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in (q, k, v))
    angles = torch.rand(num_tokens, head_dim // 2, device="cuda") * 1000
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens].int()
    slots[::9] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_q = reference.rope_store_kv(q, k, v, cos, sin, expected_k, expected_v, slots)
    actual_q = triton_rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert_close(actual_q, expected_q, dtype)
    written = slots[slots >= 0].long()
    blocks, offsets = written // block_size, written % block_size
    assert_close(k_cache[blocks, offsets], expected_k[blocks, offsets], dtype)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, rtol=0, atol=0)
