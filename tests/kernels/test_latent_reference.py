"""The latent kernels' torch reference against the multi-head attention it stands for.

`LatentBatch.dense` computes MLA as transformers does, in fp64: every head's keys and values
up-projected from the cached latents, one softmax per head. Both forms of the reference must
equal it; the absorbed one after the model's W_UV product (`up_project`).
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
    plan_latent_step,
)
from radixkv.kernels.latent_metadata import TORCH_MERGE_COST, TRITON_MERGE_COST

DIMS = LatentDims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12
)
NOPE_DIMS = LatentDims(4, 32, 0, 16, 12)  # Kimi Linear: no rope part at all
# req 0: 1-token prompt; 1: decode at B-1; 2: prefill of B; 3: extend 2 at B+1;
# 4: extend 37 over a 33-token prefix.
SEQ_LENS, Q_LENS = [1, 15, 16, 17, 70], [1, 1, 16, 2, 37]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def _absorbed(batch, **kwargs):
    args = (batch.q_latent(), batch.q_pe, batch.cache, *batch.tables, batch.scale)
    return batch.up_project(latent_reference.latent_attention(*args, **kwargs).float())


def _expanded(batch, **kwargs):
    args = (batch.q_nope, batch.q_pe, batch.cache, *batch.tables, batch.kv_b_weight, batch.scale)
    return latent_reference.expanded_latent_attention(*args, **kwargs)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dims", [DIMS, NOPE_DIMS], ids=["rope", "nope"])
def test_both_forms_equal_dense_attention(block_size, dims):
    batch = build_latent_batch(SEQ_LENS, Q_LENS, block_size=block_size, dims=dims)
    expected = batch.dense()
    torch.testing.assert_close(_absorbed(batch), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(_expanded(batch), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 33, 1000])
def test_expanded_chunks_merge_to_one_softmax(chunk_size):
    # Chunks of 1 position, of sizes that cut blocks and the prefix / new-token boundary, one
    # chunk for all: the online merge of log-sum-exps is exact at any cut.
    batch = build_latent_batch(SEQ_LENS, Q_LENS, block_size=16, dims=DIMS, seed=1)
    torch.testing.assert_close(_expanded(batch, chunk_size=chunk_size), batch.dense())


def test_fp16_cache_is_read_in_fp32():
    batch = build_latent_batch(SEQ_LENS, Q_LENS, block_size=16, dims=DIMS, dtype=torch.float16)
    expected = batch.dense()
    assert _expanded(batch).dtype == torch.float16
    torch.testing.assert_close(_absorbed(batch), expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(_expanded(batch).float(), expected, atol=1e-2, rtol=1e-2)


def test_many_decode_rows_share_a_padded_gather():
    # 9 decode rows of different lengths are batched (zero-filled padding, masked scores).
    lens = [1, 3, 15, 16, 17, 31, 33, 40, 64]
    batch = build_latent_batch(lens, [1] * len(lens), block_size=16, dims=DIMS, seed=2)
    torch.testing.assert_close(_absorbed(batch), batch.dense(), atol=2e-5, rtol=2e-5)


def test_requests_without_new_tokens_are_skipped():
    batch = build_latent_batch([5, 9, 3], [2, 0, 3], block_size=4, dims=DIMS)
    expected = batch.dense()
    torch.testing.assert_close(_absorbed(batch), expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(_expanded(batch), expected, atol=2e-5, rtol=2e-5)


def test_store_latent_writes_both_parts_and_skips_padding():
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((4, 4, DIMS.latent_dim), float("nan"))
    latent = torch.randn(3, DIMS.latent_dim + 5, generator=gen)[:, :32]  # a strided view
    k_pe = torch.randn(3, 8, generator=gen)
    latent_reference.store_latent(latent, k_pe, cache, torch.tensor([13, -1, 2]))
    torch.testing.assert_close(cache[3, 1], torch.cat((latent[0], k_pe[0])))
    torch.testing.assert_close(cache[0, 2], torch.cat((latent[2], k_pe[2])))
    assert cache.isnan().sum() == cache.numel() - 2 * DIMS.latent_dim  # nothing else written


def test_step_forms_read_the_metadata_built_once():
    # The step's metadata (kv_cache_shape read as one KV head) serves store, both forms and the
    # plan of parts; the parts' results, put together, are the dense attention.
    batch = build_latent_batch(SEQ_LENS, Q_LENS, block_size=16, dims=DIMS)
    cache = batch.cache
    metadata = AttentionMetadata(*batch.tables, latent_cache_shape(cache))
    step = plan_latent_step(metadata, DIMS, merge_cost=TRITON_MERGE_COST)
    # By multiply-adds at these sizes: decodes and the 2-token extend absorbed, the 16-token
    # prefill and the 37-token extend over 33 cached tokens expanded: four runs.
    runs = [(p.absorbed, p.rows) for p in step.parts]
    assert runs == [
        (True, slice(0, 2)),
        (False, slice(2, 18)),
        (True, slice(18, 20)),
        (False, slice(20, 57)),
    ]
    q_latent = batch.q_latent()
    out = torch.empty(57, 4, 12)
    for part in step.parts:
        rows = part.rows
        if part.absorbed:
            latents = latent_reference.latent_attention_step(
                q_latent[rows], batch.q_pe[rows], cache, part.metadata, batch.scale
            )
            out[rows] = batch.up_project(latents)
        else:
            out[rows] = latent_reference.expanded_latent_attention_step(
                batch.q_nope[rows],
                batch.q_pe[rows],
                cache,
                part.metadata,
                batch.kv_b_weight,
                batch.scale,
            )
    torch.testing.assert_close(out, batch.dense(), atol=2e-5, rtol=2e-5)


def test_the_cost_rule_absorbs_decodes_and_short_extends():
    v3 = LatentDims(128, 512, 64, 128, 128)

    def absorbed(q_len: int, seq_len: int, cost: int = TRITON_MERGE_COST) -> bool:
        return v3.prefers_absorbed(q_len, seq_len, cost)

    assert absorbed(1, 1) and absorbed(1, 100_000)  # every decode
    assert not absorbed(2, 2)  # a prefill absorbs each query and output: no gain
    assert absorbed(32, 4096)
    # Over a long prefix the crossover is q (2L - P - V + merge) = L (P + V): 170.7 new tokens
    # by multiply-adds alone, 204.8 with the torch reference's merge.
    assert absorbed(170, 100_170) and not absorbed(171, 100_171)
    assert absorbed(204, 100_204, TORCH_MERGE_COST)
    assert not absorbed(205, 100_205, TORCH_MERGE_COST)
    # A tiny model's dots are too narrow for the merge to pay: absorbed throughout on the CPU.
    assert all(DIMS.prefers_absorbed(q, q + c, TORCH_MERGE_COST) for q in (2, 512) for c in (0, 99))


def test_plan_of_one_form_is_the_step_itself():
    batch = build_latent_batch([9, 12], [1, 1], block_size=4, dims=DIMS)
    metadata = AttentionMetadata(*batch.tables, latent_cache_shape(batch.cache))
    step = plan_latent_step(metadata, DIMS)
    assert len(step.parts) == 1 and step.parts[0].metadata is metadata
    assert step.parts[0].absorbed and step.parts[0].rows == slice(0, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda b: latent_reference.store_latent(
                b.cache[0, :2, :30], b.cache[0, :2, 35:], b.cache, torch.tensor([0, 1])
            ),
            "the cache holds 40",
        ),
        (
            lambda b: latent_reference.latent_attention(
                b.q_latent(), b.q_pe[:, :, :4], b.cache, *b.tables, 0.1
            ),
            "= 36 values",
        ),
        (
            lambda b: latent_reference.latent_attention(
                b.q_latent(), b.q_pe, b.cache, *b.tables, 0.0
            ),
            "scale",
        ),
        (
            lambda b: latent_reference.expanded_latent_attention(
                b.q_nope, b.q_pe, b.cache, *b.tables, b.kv_b_weight[:, :8], 0.1
            ),
            "kv_b_weight",
        ),
        (
            lambda b: latent_reference.latent_attention_step(
                b.q_latent(),
                b.q_pe,
                b.cache,
                AttentionMetadata(*b.tables, (b.cache.shape[0], 16, 2, 20)),
                0.1,
            ),
            "latent_cache_shape",
        ),
    ],
)
def test_bad_inputs_name_the_argument(call, message):
    batch = build_latent_batch([5, 9], [2, 1], block_size=16, dims=DIMS)
    with pytest.raises(ValueError, match=message):
        call(batch)
