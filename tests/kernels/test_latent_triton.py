"""The latent Triton kernels under TRITON_INTERPRET=1 against the torch reference.

fp32 and fp16 only (the interpreter's tl.dot is wrong on bf16); tiny shapes (the interpreter
costs ~8 ms a program-loop iteration). Caches hold NaN wherever no request wrote, block tables
are random permutations, lengths sit around block boundaries, block sizes 1 / 16 / 64.
"""

from __future__ import annotations

import pytest
import torch
from latent_batch import build_latent_batch

from radixkv.kernels import (
    AttentionMetadata,
    LatentDims,
    latent_cache_shape,
    latent_reference,
    triton_latent_attention,
    triton_latent_expanded,
    triton_store_latent,
    use_backend,
)
from radixkv.kernels import dispatch as kernels

pytestmark = pytest.mark.interpreter

DIMS = LatentDims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12
)
# 20 heads: two head tiles of a decode program (16 heads each), odd widths padded and masked.
WIDE = LatentDims(
    num_heads=20, kv_lora_rank=24, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=8
)
NOPE = LatentDims(4, 32, 0, 16, 12)
FLOATS = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _mixed_lens(block_size: int) -> tuple[list[int], list[int]]:
    """A 1-token prompt, a decode at B-1, a prefill of B, an extend of 2 at B+1, an extend of 21
    over a 49-token prefix (block 1: lengths past a few blocks instead)."""
    if block_size == 1:
        return [1, 3, 4, 5, 70], [1, 1, 4, 2, 21]
    return [1, block_size - 1, block_size, block_size + 1, 70], [1, 1, block_size, 2, 21]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(actual).all(), "the kernel read a poisoned (NaN) slot"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _absorbed_args(batch):
    return (batch.q_latent(), batch.q_pe, batch.cache, *batch.tables, batch.scale)


def _expanded_args(batch):
    return (batch.q_nope, batch.q_pe, batch.cache, *batch.tables, batch.kv_b_weight, batch.scale)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", FLOATS)
def test_latent_attention_mixed_batch(block_size, dtype):
    seq_lens, q_lens = _mixed_lens(block_size)
    batch = build_latent_batch(seq_lens, q_lens, block_size=block_size, dims=DIMS, dtype=dtype)
    args = _absorbed_args(batch)
    expected = latent_reference.latent_attention(*args)
    _assert_close(triton_latent_attention.latent_attention(*args), expected, dtype)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("dims", [WIDE, NOPE], ids=["two-head-tiles", "nope"])
def test_latent_attention_decode(num_kv_splits, dims):
    # With 3 splits the 1-token request has two empty splits (lse -inf) the merge ignores.
    batch = build_latent_batch([1, 15, 16, 17, 90], [1] * 5, block_size=16, dims=dims)
    args = _absorbed_args(batch)
    expected = latent_reference.latent_attention(*args)
    actual = triton_latent_attention.latent_attention(*args, num_kv_splits=num_kv_splits)
    _assert_close(actual, expected, torch.float32)


def test_latent_attention_extend_of_many_heads():
    # 20 heads: an extend tile of 32 rows holds one token's heads (padded to 32), not several.
    batch = build_latent_batch([9, 30], [3, 11], block_size=4, dims=WIDE, seed=3)
    args = _absorbed_args(batch)
    _assert_close(
        triton_latent_attention.latent_attention(*args),
        latent_reference.latent_attention(*args),
        torch.float32,
    )


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("chunk_size", [None, 20])
def test_expanded_latent_attention(block_size, dtype, chunk_size):
    # chunk_size 20 cuts blocks and the prefix / new-token boundary: three chunks for the
    # 70-token request, the state carried between them.
    seq_lens, q_lens = _mixed_lens(block_size)
    batch = build_latent_batch(seq_lens, q_lens, block_size=block_size, dims=DIMS, dtype=dtype)
    args = _expanded_args(batch)
    expected = latent_reference.expanded_latent_attention(*args, chunk_size=chunk_size)
    actual = triton_latent_expanded.expanded_latent_attention(*args, chunk_size=chunk_size)
    assert actual.dtype == dtype
    _assert_close(actual, expected, dtype)


def test_expanded_without_rope_and_without_new_tokens():
    batch = build_latent_batch([30, 7, 12], [10, 0, 12], block_size=4, dims=NOPE)
    args = _expanded_args(batch)
    _assert_close(
        triton_latent_expanded.expanded_latent_attention(*args, chunk_size=8),
        latent_reference.expanded_latent_attention(*args),
        torch.float32,
    )


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", FLOATS)
def test_store_latent(block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 37
    num_blocks = -(-2 * num_tokens // block_size)
    cache = torch.full((num_blocks, block_size, 40), float("nan"), dtype=dtype)
    expected = cache.clone()
    projected = torch.randn(num_tokens, 48, generator=gen).to(dtype)  # a wider row: strided views
    latent, k_pe = projected[:, :32], projected[:, 40:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    latent_reference.store_latent(latent, k_pe, expected, slots)
    triton_store_latent.store_latent(latent, k_pe, cache, slots)
    assert torch.equal(cache.isnan(), expected.isnan())
    assert torch.equal(cache.nan_to_num(), expected.nan_to_num())


def test_the_step_calls_dispatch_to_triton():
    # use_backend("triton") routes the engine's per-layer calls to the Triton kernels; the
    # latent layer's metadata is the step's, read as one KV head.
    batch = build_latent_batch([5, 20], [5, 1], block_size=4, dims=DIMS)
    tables = batch.block_tables
    positions = [(0, p) for p in range(5)] + [(1, 19)]
    slots = [int(tables[r, p // 4]) * 4 + p % 4 for r, p in positions]
    slots[2] = -1  # a padding token: not written
    metadata = AttentionMetadata(
        *batch.tables,
        latent_cache_shape(batch.cache),
        slot_mapping=torch.tensor(slots, dtype=torch.int32),
    )
    latent = torch.randn(6, 32)
    k_pe = torch.randn(6, 8)
    expected = batch.cache.clone()
    latent_reference.store_latent_step(latent, k_pe, expected, metadata)
    with use_backend("triton"):
        kernels.store_latent_step(latent, k_pe, batch.cache, metadata)
        assert torch.equal(batch.cache.nan_to_num(), expected.nan_to_num())
        q_latent = batch.q_latent()
        absorbed = kernels.latent_attention_step(q_latent, batch.q_pe, batch.cache, metadata, 0.2)
        expanded = kernels.expanded_latent_attention_step(
            batch.q_nope, batch.q_pe, batch.cache, metadata, batch.kv_b_weight, 0.2
        )
    _assert_close(
        absorbed,
        latent_reference.latent_attention_step(q_latent, batch.q_pe, expected, metadata, 0.2),
        torch.float32,
    )
    _assert_close(
        expanded,
        latent_reference.expanded_latent_attention_step(
            batch.q_nope, batch.q_pe, expected, metadata, batch.kv_b_weight, 0.2
        ),
        torch.float32,
    )


def _step_at(offset: int, seq_lens: list[int], q_lens: list[int], block_size: int, cache):
    """An AttentionMetadata whose tensors are views at `offset` of one int32 buffer, as the
    engine's step buffer lays them out (offsets of every alignment, counts of every size)."""
    buffer = torch.zeros(offset + 4096, dtype=torch.int32)
    num_reqs = len(seq_lens)
    width = max(-(-s // block_size) for s in seq_lens)
    tables = buffer[offset : offset + num_reqs * width].view(num_reqs, width)
    tables.copy_(torch.arange(num_reqs * width).view(num_reqs, width) % cache.shape[0])
    lens = buffer[offset + num_reqs * width :][:num_reqs]
    lens.copy_(torch.tensor(seq_lens))
    cu = buffer[offset + num_reqs * width + num_reqs :][: num_reqs + 1]
    cu.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]))
    return AttentionMetadata(tables, lens, cu, latent_cache_shape(cache))


def test_steps_of_every_shape_share_one_variant_per_kind(monkeypatch):
    """Decode steps of 1, 3 and 16 rows over different contexts, at metadata offsets of every
    alignment, compile one variant of the absorbed kernel; extends one more; the expanded form
    one gather and two chunk variants (the first chunk, and one that resumes a state)."""
    from kernel_variants import VariantRecorder, radixkv_kernels

    recorder = VariantRecorder(monkeypatch, radixkv_kernels())
    cache = torch.zeros((64, 4, DIMS.latent_dim))
    with use_backend("triton"):
        for offset, (n, context) in enumerate([(1, 5), (3, 9), (16, 2), (1, 12)]):
            metadata = _step_at(3 * offset + 1, [context + 1] * n, [1] * n, 4, cache)
            batch = build_latent_batch([context + 1] * n, [1] * n, block_size=4, dims=DIMS)
            kernels.latent_attention_step(
                batch.q_latent(), batch.q_pe, cache, metadata, batch.scale
            )
        decode = recorder.variants()["latent_attention"]
        for offset, q_len in enumerate([5, 16, 9]):
            metadata = _step_at(offset + 2, [q_len + 3, 2], [q_len, 1], 4, cache)
            batch = build_latent_batch([q_len + 3, 2], [q_len, 1], block_size=4, dims=DIMS)
            kernels.latent_attention_step(
                batch.q_latent(), batch.q_pe, cache, metadata, batch.scale
            )
            kernels.expanded_latent_attention_step(
                batch.q_nope, batch.q_pe, cache, metadata, batch.kv_b_weight, batch.scale,
                chunk_size=4,
            )  # fmt: skip
    variants = recorder.variants()
    assert len(decode) == 1
    assert len(variants["latent_attention"]) == 2
    assert len(variants["gather_latents"]) == 1
    assert len(variants["expanded_chunk"]) == 2
