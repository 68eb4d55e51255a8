"""Step packing and decode-graph bucketing, on the CPU: the pure logic behind the CUDA-graph path.

The padded buffers are checked by value and then run through the real kernels (the torch
reference): pad rows must write no slot and leave the real rows' outputs unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.step.cuda_graphs import (
    choose_bucket,
    decode_buckets,
    graph_max_blocks,
    is_decode_step,
)
from radixkv.engine.step.step_inputs import (
    PAD_SLOT,
    InputStager,
    StepLayout,
    bucket_layout,
    layout_for,
    pack_step,
    split_step,
)
from radixkv.kernels import reference
from radixkv.scheduler.output import BlockCopy, ScheduledRequest

BLOCK = 4


def decode_row(rid: str, token: int, position: int, table: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, (token,), position, (tuple(table),), True)


def packed(rows, layout, copies=()):
    flat = np.full(layout.total, 12345, dtype=np.int32)  # garbage: every entry must be written
    pack_step(rows, [copies], BLOCK, layout, flat)
    return {k: v.copy() for k, v in layout.split(flat).items()}


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(30) == (1, 2, 4, 8, 16, 24, 30)
    assert decode_buckets(64)[-3:] == (48, 56, 64)
    with pytest.raises(AssertionError, match="max_num_seqs"):  # the door (EngineConfig) checks
        decode_buckets(0)


@given(max_num_seqs=st.integers(1, 300), num_rows=st.integers(1, 320))
def test_choose_bucket_is_the_smallest_that_fits(max_num_seqs, num_rows):
    buckets = decode_buckets(max_num_seqs)
    bucket = choose_bucket(num_rows, buckets)
    if num_rows > max_num_seqs:
        assert bucket is None
    else:
        assert bucket is not None and bucket >= num_rows
        assert all(b < num_rows for b in buckets if b < bucket)
        assert bucket - num_rows < max(8, num_rows)  # padding stays bounded


def test_graph_max_blocks():
    assert graph_max_blocks(2048, 16, 10_000) == 128
    assert graph_max_blocks(2049, 16, 10_000) == 129
    assert graph_max_blocks(2048, 16, 50) == 50  # a request cannot hold more than the pool


def test_is_decode_step():
    assert is_decode_step([decode_row("a", 5, 3, [1])])
    assert not is_decode_step([ScheduledRequest("a", (5, 6), 0, ((1,),), True)])
    assert not is_decode_step([ScheduledRequest("a", (5,), 0, ((1,),), False)])  # a mid-prefill row


def test_eager_layout_packs_rows_exactly():
    rows = [
        ScheduledRequest("a", (10, 11, 12), 2, ((7, 3),), False),  # positions 2..4
        decode_row("b", 20, 5, [9, 1]),
    ]
    copies = [BlockCopy(src_block=4, dst_block=8, num_slots=3)]
    layout = layout_for(rows, num_copies=(1,))
    assert layout == StepLayout(
        num_tokens=4, num_reqs=2, max_blocks=2, num_sampled=1, num_copies=(1,)
    )
    v = packed(rows, layout, copies)
    assert v["input_ids"].tolist() == [10, 11, 12, 20]
    assert v["positions"].tolist() == [2, 3, 4, 5]
    # a: positions 2, 3 in block 7, 4 in block 3; b: position 5 in block 1 (offset 1)
    assert v["slot_mapping"].tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 1 * 4 + 1]
    assert v["block_tables"].tolist() == [[7, 3], [9, 1]]
    assert v["seq_lens"].tolist() == [5, 6]
    assert v["cu_seqlens_q"].tolist() == [0, 3, 4]
    assert v["sample_idx"].tolist() == [3]
    assert (v["copy_src"].tolist(), v["copy_dst"].tolist(), v["copy_slots"].tolist()) == (
        [4],
        [8],
        [3],
    )


def test_padded_layout_fills_pad_rows_that_write_nowhere():
    rows = [decode_row("a", 20, 5, [9, 1]), decode_row("b", 21, 0, [6])]
    layout = bucket_layout(4, 3)
    assert layout == StepLayout(4, 4, 3)
    v = packed(rows, layout)
    assert v["input_ids"].tolist() == [20, 21, 0, 0]
    assert v["positions"].tolist() == [5, 0, 0, 0]
    assert v["slot_mapping"].tolist() == [1 * 4 + 1, 6 * 4 + 0, PAD_SLOT, PAD_SLOT]
    # Columns past a row's blocks and the pad rows' tables are block 0.
    assert v["block_tables"].tolist() == [[9, 1, 0], [6, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert v["seq_lens"].tolist() == [6, 1, 1, 1]
    assert v["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4]
    assert v["sample_idx"].size == 0


def test_pad_rows_change_no_slot_and_no_real_row_output():
    """The padded bucket through the real kernels: pad rows store nothing (the cache is unchanged
    outside the real rows' slots) and the real rows' attention equals the unpadded step's."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, head_dim, q_heads = 12, 2, 8, 4
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    rows = [decode_row("a", 20, 5, [9, 1]), decode_row("b", 21, 2, [6])]

    def run(layout):
        flat = torch.from_numpy(np.empty(layout.total, dtype=np.int32))
        pack_step(rows, (), BLOCK, layout, flat.numpy())
        _, (meta,) = split_step(layout, flat, flat, [shape])  # validated: pad rows are legal
        k, vv = k_cache.clone(), v_cache.clone()
        new_kv = torch.randn(layout.num_tokens, kv_heads, head_dim, generator=gen.manual_seed(1))
        reference.store_kv_step(new_kv, new_kv, k, vv, meta)
        q = torch.randn(layout.num_tokens, q_heads, head_dim, generator=gen.manual_seed(2))
        out = reference.paged_attention_step(q, k, vv, meta, head_dim**-0.5)
        return k, out

    k_eager, out_eager = run(layout_for(rows))
    k_padded, out_padded = run(bucket_layout(8, 4))
    torch.testing.assert_close(k_padded, k_eager, rtol=0, atol=0)
    torch.testing.assert_close(out_padded[: len(rows)], out_eager, rtol=0, atol=0)
    assert torch.isfinite(out_padded).all()
    written = (k_eager != k_cache).flatten(1).any(1).nonzero().squeeze(1).tolist()
    assert written == [1, 6]  # only the real rows' blocks (slots 1*4+1 and 6*4+2)


@settings(max_examples=50, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(1, 20), st.integers(0, 30)), min_size=1, max_size=9
    ),  # (token, position) per row
    extra=st.integers(0, 7),
)
def test_padded_packing_matches_eager_on_real_rows(data, extra):
    rows = [
        decode_row(f"r{i}", tok, pos, list(range(i, i + pos // BLOCK + 1)))
        for i, (tok, pos) in enumerate(data)
    ]
    eager = packed(rows, layout_for(rows))
    max_blocks = max(len(r.block_tables[0]) for r in rows) + 2
    pad = packed(rows, bucket_layout(len(rows) + extra, max_blocks))
    n = len(rows)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert pad[name][:n].tolist() == eager[name].tolist()
        assert len(pad[name]) == n + extra
    assert pad["cu_seqlens_q"].tolist() == list(range(n + extra + 1))
    width = eager["block_tables"].shape[1]
    assert (pad["block_tables"][:n, :width] == eager["block_tables"]).all()
    assert (pad["slot_mapping"][n:] == PAD_SLOT).all() and (pad["seq_lens"][n:] == 1).all()


def per_row_reference(rows, copies, layout) -> dict[str, list]:
    """What `pack_step` must produce, written the plain way: one row at a time."""
    out: dict[str, list] = {name: [] for name, _ in layout.sizes()}
    for row in rows:
        table = [*row.block_tables[0], *[0] * (layout.max_blocks - len(row.block_tables[0]))]
        out["block_tables"].append(table)
        out["cu_seqlens_q"].append(len(out["input_ids"]))
        for j, token in enumerate(row.token_ids):
            pos = row.start_position + j
            out["input_ids"].append(token)
            out["positions"].append(pos)
            out["slot_mapping"].append(table[pos // BLOCK] * BLOCK + pos % BLOCK)
        out["seq_lens"].append(row.start_position + len(row.token_ids))
        if row.sample and layout.num_sampled:
            out["sample_idx"].append(len(out["input_ids"]) - 1)
    for _ in range(layout.num_reqs - len(rows)):
        out["block_tables"].append([0] * layout.max_blocks)
        out["cu_seqlens_q"].append(len(out["input_ids"]))
        out["input_ids"].append(0)
        out["positions"].append(0)
        out["slot_mapping"].append(PAD_SLOT)
        out["seq_lens"].append(1)
    out["cu_seqlens_q"].append(len(out["input_ids"]))
    out["copy_src"] = [c.src_block for c in copies]
    out["copy_dst"] = [c.dst_block for c in copies]
    out["copy_slots"] = [c.num_slots for c in copies]
    return out


row_strategy = st.tuples(
    st.integers(1, 6),  # new tokens
    st.integers(0, 20),  # start position
    st.integers(0, 3),  # spare block-table columns
    st.booleans(),  # sampled
)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(row_strategy, min_size=1, max_size=8),
    extra_rows=st.integers(0, 3),
    num_copies=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_vectorized_packing_equals_packing_row_by_row(specs, extra_rows, num_copies, seed):
    """Mixed prefill chunks and decode rows, tables of any width, pad rows and copies: the
    numpy packing equals the per-row reference model, entry for entry."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, (q_len, start, spare, sample) in enumerate(specs):
        blocks = -(-(start + q_len) // BLOCK) + spare
        tokens = tuple(int(t) for t in rng.integers(0, 1000, q_len))
        table = tuple(int(b) for b in rng.integers(0, 500, blocks))
        rows.append(ScheduledRequest(f"r{i}", tokens, start, (table,), sample))
    copies = [BlockCopy(int(a), int(b), int(c)) for a, b, c in rng.integers(0, 9, (num_copies, 3))]
    eager = layout_for(rows, num_copies=(num_copies,))
    padded = StepLayout(
        eager.num_tokens + extra_rows,
        eager.num_reqs + extra_rows,
        eager.max_blocks + 1,
        eager.num_sampled,
        (num_copies,),
    )
    for layout in (eager, padded):
        got = packed(rows, layout, copies)
        assert {name: got[name].tolist() for name in got} == per_row_reference(rows, copies, layout)


def test_cpu_stager_hands_out_fresh_buffers_and_copies_nothing():
    stager = InputStager(torch.device("cpu"))
    a = stager.host(5)
    b = stager.host(5)
    assert a.dtype == torch.int32 and a.data_ptr() != b.data_ptr()
    assert stager.to_device(a) is a  # the CPU step uses the host tensors directly
    out = torch.zeros(8, dtype=torch.int32)
    a.copy_(torch.arange(5))
    stager.to_device(a, out=out)
    assert out.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


def test_every_group_has_its_own_tables_slots_and_copies():
    """Two KV cache groups: the second's block tables, slots and copies in regions of their own,
    after the first's (whose layout is that of a model of one group)."""
    rows = [
        ScheduledRequest("a", (10, 11, 12), 2, ((7, 3), (5, 0)), False),  # positions 2..4
        ScheduledRequest("b", (20,), 5, ((9, 1), (2, 6)), True),
    ]
    copies = [[], [BlockCopy(src_block=4, dst_block=6, num_slots=1)]]
    layout = layout_for(rows, num_copies=(0, 1))
    assert layout.num_groups == 2 and layout.sizes()[:10] == StepLayout(4, 2, 2, 1).sizes()
    flat = np.full(layout.total, 12345, dtype=np.int32)
    pack_step(rows, copies, BLOCK, layout, flat)
    v = layout.split(flat)
    assert v["block_tables"].tolist() == [[7, 3], [9, 1]]
    assert v["block_tables.1"].tolist() == [[5, 0], [2, 6]]
    assert v["slot_mapping"].tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 1 * 4 + 1]
    assert v["slot_mapping.1"].tolist() == [5 * 4 + 2, 5 * 4 + 3, 0 * 4 + 0, 6 * 4 + 1]
    assert v["copy_src"].size == 0
    assert (v["copy_src.1"].tolist(), v["copy_dst.1"].tolist(), v["copy_slots.1"].tolist()) == (
        [4],
        [6],
        [1],
    )
    shapes = [(10, BLOCK, 2, 8), (7, BLOCK, 2, 8)]
    _, metas = split_step(layout, torch.from_numpy(flat), torch.from_numpy(flat), shapes)
    assert [m.kv_cache_shape for m in metas] == shapes
