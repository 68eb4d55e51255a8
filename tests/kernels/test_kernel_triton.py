"""Triton kernels under TRITON_INTERPRET=1 (set by tests/conftest.py) against the torch reference.

fp32 and fp16 only: the interpreter's tl.dot returns garbage on bf16 inputs, so bf16 is tested on a
GPU (test_kernel_gpu.py). Cases stay small: the interpreter costs ~10 ms per loop iteration.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kernels import reference
from radixkv.kernels.triton_copy_blocks import copy_blocks as triton_copy_blocks
from radixkv.kernels.triton_paged_attention import paged_attention as triton_paged_attention
from radixkv.kernels.triton_store_kv import store_kv as triton_store_kv

pytestmark = pytest.mark.interpreter

FLOATS = [torch.float32, torch.float16]


def _mixed_lens(block_size: int) -> tuple[list[int], list[int]]:
    """Lengths around a block boundary plus a long one; decode rows beside prefill/extend rows.

    req 0: 1-token prompt (empty prefix)      req 1: decode at B-1
    req 2: prefill of B tokens (empty prefix)  req 3: extend 2 tokens at B+1
    req 4: extend 37 tokens over a 263-token cached prefix
    """
    seq_lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 300]
    q_lens = [1, 1, block_size, 2, 37]
    return seq_lens, q_lens


# ------------------------------------------------------------------------------ paged_attention


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize(
    ("dtype", "head_dim"), [(torch.float32, 80), (torch.float16, 64), (torch.float16, 80)]
)
def test_paged_attention_mixed_batch(paged_batch, assert_close, block_size, group, dtype, head_dim):
    seq_lens, q_lens = _mixed_lens(block_size)
    batch = paged_batch(
        seq_lens, q_lens, block_size=block_size, group=group, head_dim=head_dim, dtype=dtype
    )
    expected = reference.paged_attention(*batch.args)
    assert_close(triton_paged_attention(*batch.args), expected, dtype)


@pytest.mark.parametrize("num_kv_splits", [None, 1, 4])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_attention_decode(paged_batch, assert_close, num_kv_splits, group, dtype):
    # All q_len == 1: the small decode tile. With 4 splits the 1-token request has 3 empty splits
    # (lse = -inf) that the merge must ignore.
    batch = paged_batch(
        [1, 15, 16, 17, 257], [1] * 5, block_size=16, group=group, head_dim=80, dtype=dtype
    )
    expected = reference.paged_attention(*batch.args)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("num_kv_splits", [12, 40])
@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_attention_merge_of_many_splits(paged_batch, assert_close, num_kv_splits, dtype):
    # Past 8 splits the merge loads many splits at once, 32 at head_dim 80: 40 splits of 64
    # positions fill two loads for the 2,560-token request, one and a bit for the 2,049-token
    # one, and the last request's one token leaves every split but one empty.
    batch = paged_batch([2560, 2049, 1], [1] * 3, block_size=16, group=2, head_dim=80, dtype=dtype)
    expected = reference.paged_attention(*batch.args)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_attention_split_extend(paged_batch, assert_close, num_kv_splits, dtype):
    # Splits of a causal extend tile: each query row sees a different prefix of the last split.
    batch = paged_batch([200, 65, 1], [70, 1, 1], block_size=16, group=3, dtype=dtype)
    expected = reference.paged_attention(*batch.args)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits)
    assert_close(actual, expected, dtype)


def test_paged_attention_request_without_new_tokens(paged_batch, assert_close):
    # q_len 0 (cu_seqlens_q repeats a value): the request owns a spare tile and writes nothing.
    batch = paged_batch([20, 33, 5], [3, 0, 5], block_size=16, group=2)
    expected = reference.paged_attention(*batch.args)
    assert_close(triton_paged_attention(*batch.args), expected, torch.float32)


def test_paged_attention_strided_q_and_out(paged_batch, assert_close):
    # q sliced out of a fused qkv projection and out written into a wider buffer: strides are
    # honoured, and out is the returned tensor.
    batch = paged_batch([40, 17], [9, 1], block_size=16, group=4, dtype=torch.float16)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, num_heads + 4, head_dim, dtype=torch.float16)
    qkv[:, :num_heads] = batch.q
    q = qkv[:, :num_heads]
    wide = torch.zeros(num_tokens, 2 * num_heads, head_dim, dtype=torch.float16)
    out = wide[:, num_heads:]
    args = (q, *batch.args[1:])
    result = triton_paged_attention(*args, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference.paged_attention(*batch.args), torch.float16)
    assert (wide[:, :num_heads] == 0).all()


def test_paged_attention_empty_batch(paged_batch):
    batch = paged_batch([5], [0], block_size=16)
    assert triton_paged_attention(*batch.args).shape == (0, 2, 64)


# ------------------------------------------------------------------------------------ store_kv


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv(block_size, dtype, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_kv_heads, head_dim, num_tokens = 24, 3, 80, 20
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens: skipped
    slot_mapping = slots.to(slot_dtype)
    # key/value as strided views of a fused [tokens, 2, heads, dim] buffer
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = kv[:, 0], kv[:, 1]

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    triton_store_kv(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, rtol=0, atol=0)
    # untouched slots are still NaN: exactly num_tokens - skipped slots were written
    written = (~torch.isnan(k_cache[..., 0, 0])).sum().item()
    assert written == int((slot_mapping >= 0).sum())


# --------------------------------------------------------------------------------- copy_blocks


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_copy_blocks(stacked, block_size):
    gen = torch.Generator().manual_seed(2)
    num_layers, num_blocks, num_kv_heads, head_dim = 3, 10, 3, 80
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if stacked:
        shape = (num_layers, *shape)
    k_cache = torch.randn(shape, generator=gen).half()
    v_cache = torch.randn(shape, generator=gen).half()
    src = torch.tensor([4, 0, 7, 4])
    dst = torch.tensor([1, 9, 2, 5])
    num_slots = torch.tensor([block_size - 1, block_size, 0, 1], dtype=torch.int32)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(expected_k, expected_v, src, dst, num_slots)
    triton_copy_blocks(k_cache, v_cache, src, dst, num_slots)
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
