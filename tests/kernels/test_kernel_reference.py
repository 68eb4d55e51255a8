"""The torch reference against dense attention (SDPA) over contiguous K/V, and its in-place ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_dense import dense_requests

from radixkv.kernels import reference


def _dense_attention(batch) -> torch.Tensor:
    """Per request: its K/V gathered into contiguous tensors, then SDPA with a bottom-right
    causal mask (query j of q_len sits at position seq_len - q_len + j), all in fp32."""
    outs = []
    for q, k, v, pos, q_pos in dense_requests(batch):
        mask = pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=batch.scale, enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("seq_lens", "q_lens"),
    [
        ([1, 15, 16, 17, 300], [1, 1, 16, 2, 37]),  # mixed decode / prefill / extend
        ([700, 5], [700, 1]),  # prefill longer than the reference's query chunk (512)
        ([33, 64, 1], [1, 1, 1]),  # decode only: one padded batch
        ([40, 9, 12], [4, 0, 12]),  # a request without new tokens
    ],
)
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reference_matches_dense_sdpa(paged_batch, seq_lens, q_lens, block_size, group, dtype):
    batch = paged_batch(
        seq_lens, q_lens, block_size=block_size, group=group, head_dim=80, dtype=dtype
    )
    out = reference.paged_attention(*batch.args)
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert torch.isfinite(out).all(), "a NaN-poisoned free slot reached the output"
    # Both compute in fp32 from the same inputs: only the final rounding to dtype differs.
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), _dense_attention(batch), atol=tol, rtol=tol)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_decode_groups_by_length(paged_batch, group):
    # Short and long decode rows land in different padded batches; every row comes back in place.
    lens = [3000, 5, 2900, 7, 16, 1200]
    batch = paged_batch(lens, [1] * len(lens), block_size=16, group=group, head_dim=64)
    out = reference.paged_attention(*batch.args)
    torch.testing.assert_close(out, _dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_ignores_nan_in_padding_entries_of_block_tables(paged_batch):
    # Padding columns of the block table point at a poisoned block instead of -1.
    batch = paged_batch([5, 40], [5, 1], block_size=16, group=2)
    poisoned = torch.isnan(batch.k_cache[:, 0, 0, 0]).nonzero()[0].item()
    batch.block_tables[batch.block_tables < 0] = poisoned
    out = reference.paged_attention(*batch.args)
    torch.testing.assert_close(out, _dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_writes_into_out(paged_batch):
    batch = paged_batch([20, 3], [2, 3], block_size=16, group=3)
    out = torch.empty_like(batch.q)
    assert reference.paged_attention(*batch.args, out=out) is out
    torch.testing.assert_close(out, _dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_store_kv_then_attend_matches_dense():
    # store_kv and paged_attention agree on the slot layout: store a prompt, attend, compare.
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, seq_len = 4, 2, 64, 11
    shape = (8, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    table = torch.tensor([[6, 1, 3, -1]], dtype=torch.int32)
    pos = torch.arange(seq_len)
    slots = table[0, pos // block_size].long() * block_size + pos % block_size
    key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    reference.store_kv(key, value, k_cache, v_cache, slots)
    q = torch.randn(seq_len, 2 * num_kv_heads, head_dim, generator=gen)
    out = reference.paged_attention(
        q,
        k_cache,
        v_cache,
        table,
        torch.tensor([seq_len], dtype=torch.int32),
        torch.tensor([0, seq_len], dtype=torch.int32),
        head_dim**-0.5,
    )
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


def test_reference_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    reference.store_kv(key, 2 * key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache[1, 1].eq(1).all() and k_cache[0, 0].eq(1).all() and v_cache[1, 1].eq(2).all()
    assert k_cache.sum() == 2 * 8


@pytest.mark.parametrize("stacked", [False, True])
def test_reference_copy_blocks_copies_leading_slots_of_every_layer(stacked):
    shape = (5, 4, 2, 8) if not stacked else (3, 5, 4, 2, 8)
    k_cache = torch.randn(shape)
    v_cache = torch.randn(shape)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    reference.copy_blocks(
        k_cache, v_cache, torch.tensor([3, 0]), torch.tensor([1, 4]), torch.tensor([3, 4])
    )
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for exp, src in ((expected_k, before_k), (expected_v, before_v)):
        exp[..., 1, :3, :, :] = src[..., 3, :3, :, :]  # partial: slot 3 of block 1 kept
        exp[..., 4, :, :, :] = src[..., 0, :, :, :]  # a full block
    torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
