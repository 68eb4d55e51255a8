"""Attention kinds per layer: sliding window, logit soft-capping, attention sinks.

The torch reference against a dense computation written out op by op (the formulas of
transformers' eager attention for Mistral / Gemma 2 / GPT-OSS), and the Triton kernel (under
TRITON_INTERPRET=1) against the reference. Windows are small next to the contexts, so every
batch has rows whose window hides most of their context, rows whose window hides nothing, and
window starts inside and at the edges of blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_dense import dense_requests

from radixkv.kernels import AttentionKind, AttentionMetadata, reference
from radixkv.kernels.triton_paged_attention import paged_attention as triton_paged_attention


def _dense(batch, kind: AttentionKind) -> torch.Tensor:
    """Per request: its K/V gathered position by position, scores, cap, mask, sink, softmax."""
    outs = []
    for q, k, v, pos, q_pos in dense_requests(batch):
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) * batch.scale
        if kind.softcap is not None:
            scores = torch.tanh(scores / kind.softcap) * kind.softcap
        visible = pos[None, :] <= q_pos[:, None]
        if kind.window is not None:
            visible &= pos[None, :] > q_pos[:, None] - kind.window
        scores = scores.masked_fill(~visible, float("-inf"))
        if kind.sinks is not None:
            sink = kind.sinks.float().view(-1, 1, 1).expand(-1, q_pos.shape[0], 1)
            scores = torch.cat((scores, sink), dim=-1)
        probs = scores.softmax(-1)[..., : pos.shape[0]]
        outs.append((probs @ v).transpose(0, 1))
    return torch.cat(outs)


def _sinks(batch, seed: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(batch.q.shape[1], generator=gen)).to(batch.q.dtype)


# Rows: a 1-token prompt, decode rows short and long, a prefill longer than the window, an extend
# over a long cached prefix, a row without new tokens.
SEQ_LENS = [1, 6, 17, 41, 130, 300, 20]
Q_LENS = [1, 1, 1, 41, 1, 37, 0]
KINDS = {
    "window": dict(window=9),
    "window-16": dict(window=16),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "window-softcap": dict(window=7, softcap=1.5),
    "window-sinks": dict(window=12, sinks=True),
}


def _poison_before_window(batch, window: int) -> None:
    """Point every block-table entry wholly before all of its row's windows at a NaN-poisoned
    block: a kernel that reads one returns NaN."""
    block_size = batch.k_cache.shape[1]
    poisoned = torch.isnan(batch.k_cache[:, 0, 0, 0]).nonzero()[0].item()
    cu = batch.cu_seqlens_q.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        first_seen = seq_len - (cu[r + 1] - cu[r]) - window + 1
        batch.block_tables[r, : max(first_seen, 0) // block_size] = poisoned
    assert (batch.block_tables == poisoned).sum() >= 10


def _kind(batch, name: str) -> AttentionKind:
    options = dict(KINDS[name])
    if options.pop("sinks", False):
        options["sinks"] = _sinks(batch)
    return AttentionKind(**options)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_dense(paged_batch, name, block_size, dtype):
    batch = paged_batch(SEQ_LENS, Q_LENS, block_size=block_size, group=2, dtype=dtype)
    kind = _kind(batch, name)
    out = reference.paged_attention(*batch.args, kind=kind)
    assert torch.isfinite(out).all(), "a NaN-poisoned slot reached the output"
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), _dense(batch, kind), atol=tol, rtol=tol)
    # The option changed the result (full causal attention is not what was computed).
    full = reference.paged_attention(*batch.args)
    assert (out.float() - full.float()).abs().max() > 10 * tol


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 70), st.integers(0, 70)).map(lambda t: (t[0] + t[1], t[0])),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 3, 16]),
    window=st.integers(1, 40),
    softcap=st.sampled_from([None, 0.5, 4.0]),
    with_sinks=st.booleans(),
)
def test_reference_matches_dense_for_any_batch(
    paged_batch, rows, block_size, window, softcap, with_sinks
):
    """Any mix of (seq_len, q_len) rows, window and options: the windowed gathers, their padded
    decode groups and their masks equal the dense formula."""
    seq_lens, q_lens = [s for s, _ in rows], [q for _, q in rows]
    batch = paged_batch(seq_lens, q_lens, block_size=block_size, group=2, head_dim=16)
    sinks = _sinks(batch) if with_sinks else None
    kind = AttentionKind(window=window, softcap=softcap, sinks=sinks)
    out = reference.paged_attention(*batch.args, kind=kind)
    torch.testing.assert_close(out, _dense(batch, kind), atol=1e-5, rtol=1e-5)


def test_reference_never_reads_blocks_before_the_window(paged_batch):
    """Block-table entries wholly before every query's window may name any block (a later memory
    scheme frees them): here they name a NaN-poisoned one, and nothing changes."""
    batch = paged_batch([40, 23, 31], [1, 1, 9], block_size=4, group=2)
    kind = AttentionKind(window=6)
    expected = _dense(batch, kind)
    _poison_before_window(batch, 6)
    out = reference.paged_attention(*batch.args, kind=kind)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_step_keeps_one_gather_per_window(paged_batch):
    """A step's layers of one window share its gather batches; a window wider than every
    context is full attention and reuses the full plan."""
    batch = paged_batch([30, 12], [1, 12], block_size=4, group=1)
    meta = AttentionMetadata(
        batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, tuple(batch.k_cache.shape)
    )
    args = (batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    first = reference.paged_attention_step(*args, kind=AttentionKind(window=5))
    again = reference.paged_attention_step(*args, kind=AttentionKind(window=5))
    assert list(meta.window_batches) == [5]
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    wide = reference.paged_attention_step(*args, kind=AttentionKind(window=30))
    assert list(meta.window_batches) == [5]
    torch.testing.assert_close(wide, reference.paged_attention_step(*args), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("window", 0, "window must be a positive int"),
        ("window", 2.0, "window must be a positive int"),
        ("window", True, "window must be a positive int"),
        ("softcap", -1.0, "softcap must be a positive float"),
        ("sinks", torch.zeros(4, 1), "sinks must be"),
        ("sinks", torch.zeros(4, dtype=torch.int32), "sinks dtype"),
    ],
)
def test_bad_kinds_are_refused(option, value, message):
    with pytest.raises(ValueError, match=message):
        AttentionKind(**{option: value})


@pytest.mark.parametrize("kernel", [reference.paged_attention, triton_paged_attention])
def test_sinks_of_another_head_count_are_refused(paged_batch, kernel):
    batch = paged_batch([5], [5], block_size=4, group=2)  # 4 query heads
    with pytest.raises(ValueError, match=r"sinks must be \[num_q_heads=4\]"):
        kernel(*batch.args, kind=AttentionKind(sinks=torch.zeros(3)))
    with pytest.raises(ValueError, match="kind must be an AttentionKind"):
        kernel(*batch.args, kind={"window": 3})


# ----------------------------------------------------------------------------------- Triton


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("num_kv_splits", [None, 3])
def test_triton_matches_reference(paged_batch, name, block_size, num_kv_splits, assert_close):
    """Mixed decode / prefill / extend rows; with 3 splits a window's range is split too, and a
    split can hold no visible position of a row (and the sink is counted once)."""
    batch = paged_batch(SEQ_LENS, Q_LENS, block_size=block_size, group=4, head_dim=40)
    kind = _kind(batch, name)
    expected = reference.paged_attention(*batch.args, kind=kind)
    actual = triton_paged_attention(*batch.args, num_kv_splits=num_kv_splits, kind=kind)
    assert_close(actual, expected, torch.float32)


@pytest.mark.interpreter
def test_triton_fp16_window_softcap_sinks(paged_batch, assert_close):
    batch = paged_batch(
        [90, 17, 33], [1, 17, 5], block_size=16, group=2, head_dim=64, dtype=torch.float16
    )
    kind = AttentionKind(window=10, softcap=3.0, sinks=_sinks(batch))
    expected = reference.paged_attention(*batch.args, kind=kind)
    assert_close(triton_paged_attention(*batch.args, kind=kind), expected, torch.float16)


@pytest.mark.interpreter
def test_triton_never_reads_blocks_before_the_window(paged_batch, assert_close):
    batch = paged_batch([40, 23, 31], [1, 1, 9], block_size=4, group=2)
    kind = AttentionKind(window=6)
    expected = reference.paged_attention(*batch.args, kind=kind)
    _poison_before_window(batch, 6)
    actual = triton_paged_attention(*batch.args, kind=kind, num_kv_splits=2)
    assert_close(actual, expected, torch.float32)
