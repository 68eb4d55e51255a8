"""`AttentionMetadata` and the `*_step` kernels: the validated-once path equals the loose path
exactly, bad metadata is rejected when it is built, and the per-layer calls still check their own
tensors against it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import radixkv.kernels as kernels
from radixkv.kernels import AttentionMetadata, reference
from radixkv.kernels import metadata as metadata_module
from radixkv.kernels.triton_paged_attention import paged_attention as triton_paged_attention
from radixkv.kernels.triton_paged_attention import (
    paged_attention_step as triton_paged_attention_step,
)
from radixkv.kernels.triton_store_kv import store_kv as triton_store_kv
from radixkv.kernels.triton_store_kv import store_kv_step as triton_store_kv_step


def _metadata(batch, slot_mapping: torch.Tensor | None = None, **kwargs) -> AttentionMetadata:
    return AttentionMetadata(
        batch.block_tables,
        batch.seq_lens,
        batch.cu_seqlens_q,
        tuple(batch.k_cache.shape),
        slot_mapping=slot_mapping,
        **kwargs,
    )


def _slots_of(batch) -> torch.Tensor:
    """The slot of every new token in the batch's block tables (the runner's slot_mapping)."""
    block_size = batch.k_cache.shape[1]
    cu, lens = batch.cu_seqlens_q.tolist(), batch.seq_lens.tolist()
    slots = []
    for r, seq_len in enumerate(lens):
        for pos in range(seq_len - (cu[r + 1] - cu[r]), seq_len):
            block = int(batch.block_tables[r, pos // block_size])
            slots.append(block * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.int64)


# ------------------------------------------------------------------- step path == loose path


# The Triton launchers on CPU tensors need the interpreter (skipped on a GPU machine).
IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]

LENS = [
    pytest.param([1, 15, 16, 17, 300], [1, 1, 16, 2, 37], id="mixed"),
    pytest.param([700, 5], [700, 1], id="prefill-past-the-query-chunk"),
    pytest.param([33, 64, 1, 2], [1, 1, 1, 1], id="decode-padded-batch"),
    pytest.param([40, 9, 12], [4, 0, 12], id="request-without-new-tokens"),
    pytest.param([3000, 20, 2500], [1, 1, 1], id="decode-groups-split-by-size"),
]


@pytest.mark.parametrize(("seq_lens", "q_lens"), LENS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_step_equals_loose(paged_batch, seq_lens, q_lens, block_size, dtype):
    batch = paged_batch(seq_lens, q_lens, block_size=block_size, group=3, dtype=dtype)
    meta = _metadata(batch)
    expected = reference.paged_attention(*batch.args)
    # The same metadata serves several layers (here: twice), always giving the same result.
    for _ in range(2):
        out = torch.empty_like(batch.q)
        with kernels.use_backend("torch"):  # the reference's step, whatever the CPU default
            actual = kernels.paged_attention_step(
                batch.q, batch.k_cache, batch.v_cache, meta, batch.scale, out=out
            )
        assert actual is out
        assert torch.equal(actual, expected)


def test_reference_step_accepts_strided_q(paged_batch):
    # q as a view of a fused [tokens, 2, heads, dim] buffer: rows are strided, head_dim is not.
    batch = paged_batch([20, 5], [3, 5], block_size=16, group=2)
    fused = torch.stack([batch.q, torch.zeros_like(batch.q)], dim=1)
    q = fused[:, 0]
    assert not q.is_contiguous()
    expected = reference.paged_attention(*batch.args)
    actual = reference.paged_attention_step(q, batch.k_cache, batch.v_cache, _metadata(batch), 0.2)
    assert torch.equal(actual, reference.paged_attention(q, *batch.args[1:6], 0.2))
    assert not torch.equal(actual, expected)  # a different scale: the comparison is not vacuous


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_step_equals_loose(paged_batch, block_size):
    batch = paged_batch([1, 15, 17, 40], [1, 1, 2, 7], block_size=block_size, group=3)
    expected = triton_paged_attention(*batch.args)
    actual = triton_paged_attention_step(
        batch.q, batch.k_cache, batch.v_cache, _metadata(batch), batch.scale
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("skip", [False, True], ids=["all-written", "some-skipped"])
def test_store_kv_step_equals_loose(paged_batch, impl, skip):
    batch = paged_batch([20, 5, 33], [3, 5, 1], block_size=16)
    slots = _slots_of(batch)
    if skip:
        slots[::3] = -1
    meta = _metadata(batch, slots)
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, slots.shape[0], *batch.k_cache.shape[2:], generator=gen)
    loose = {"reference": reference.store_kv, "triton": triton_store_kv}[impl]
    step = {"reference": reference.store_kv_step, "triton": triton_store_kv_step}[impl]
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    loose(key, value, expected_k, expected_v, slots)
    step(key, value, batch.k_cache, batch.v_cache, meta)
    torch.testing.assert_close(batch.k_cache, expected_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(batch.v_cache, expected_v, equal_nan=True, rtol=0, atol=0)


# ------------------------------------------------------------------- rejected when built


def _good() -> dict:
    # req 0: 3 new tokens at positions [17, 20) of blocks [2, 0]; req 1: 5 new at [0, 5) of [3]
    return {
        "block_tables": torch.tensor([[2, 0], [3, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 5], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
        "kv_cache_shape": (4, 16, 2, 64),
        "slot_mapping": torch.tensor([1, 2, 3, 48, 49, 50, 51, 52]),
    }


def _set(name: str, value: object) -> Callable[[dict], None]:
    def mutate(args: dict) -> None:
        args[name] = value

    return mutate


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


BUILD_ERRORS = [
    ("block_tables int64", _set("block_tables", torch.tensor([[2, 0], [3, -1]])), "int32"),
    ("block_tables 1-D", _set("block_tables", _i32(2, 0)), "block_tables must be"),
    ("seq_lens int64", _set("seq_lens", torch.tensor([20, 5])), "seq_lens"),
    ("seq_lens count", _set("seq_lens", _i32(20)), "seq_lens has 1"),
    ("not a tensor", _set("seq_lens", [20, 5]), "seq_lens must be a torch.Tensor"),
    ("cu_seqlens_q length", _set("cu_seqlens_q", _i32(0, 3)), r"num_reqs \+ 1"),
    ("cu_seqlens_q start", _set("cu_seqlens_q", _i32(1, 3, 8)), r"cu_seqlens_q\[0\]"),
    ("cu_seqlens_q decreasing", _set("cu_seqlens_q", _i32(0, 9, 8)), "non-decreasing"),
    ("seq_len < q_len", _set("seq_lens", _i32(20, 4)), r"seq_lens\[1\] = 4 < q_len 5"),
    ("block table too short", _set("seq_lens", _i32(33, 5)), "too short"),
    (
        "block id past the cache",
        _set("block_tables", torch.tensor([[2, 4], [3, -1]], dtype=torch.int32)),
        "num_blocks 4",
    ),
    (
        "negative block id within seq_len",
        _set("block_tables", torch.tensor([[2, 0], [-1, -1]], dtype=torch.int32)),
        "negative block id",
    ),
    ("kv_cache_shape", _set("kv_cache_shape", (4, 16, 2)), "kv_cache_shape"),
    ("kv_cache_shape zero", _set("kv_cache_shape", (4, 0, 2, 64)), "kv_cache_shape"),
    ("slot float", _set("slot_mapping", torch.zeros(8)), "slot_mapping must have dtype"),
    ("slot count", _set("slot_mapping", torch.arange(7)), r"cu_seqlens_q\[-1\] = 8 != .* 7"),
    (
        "slot not the block table's",
        _set("slot_mapping", torch.tensor([1, 2, 3, 48, 49, 50, 51, 53])),
        r"slot_mapping\[7\] = 53, but token 7 \(request 1, position 4\) lives in slot 52",
    ),
    (
        "slot in the wrong block",
        _set("slot_mapping", torch.tensor([33, 2, 3, 48, 49, 50, 51, 52])),
        r"slot_mapping\[0\] = 33",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "match"), [pytest.param(m, match, id=name) for name, m, match in BUILD_ERRORS]
)
def test_bad_metadata_is_rejected_when_built(mutate, match):
    args = _good()
    AttentionMetadata(**args)  # the unmutated arguments are fine
    mutate(args)
    with pytest.raises(ValueError, match=match):
        AttentionMetadata(**args)


def test_a_slot_written_twice_is_rejected():
    # Two requests whose tables share block 3 both write position 0: consistent with the tables,
    # but the second write would clobber the first.
    with pytest.raises(ValueError, match="twice"):
        AttentionMetadata(
            torch.tensor([[3], [3]], dtype=torch.int32),
            _i32(1, 1),
            _i32(0, 1, 2),
            (4, 16, 2, 64),
            slot_mapping=torch.tensor([48, 48]),
        )


def test_skipped_slots_and_padding_past_seq_len_are_accepted():
    args = _good()
    args["slot_mapping"] = torch.tensor([-1, 2, 3, -1, 49, 50, 51, 52], dtype=torch.int32)
    args["block_tables"] = torch.tensor([[2, 0, 99], [3, -7, -1]], dtype=torch.int32)
    meta = AttentionMetadata(**args)
    assert (meta.num_reqs, meta.num_tokens, meta.max_seq_len, meta.max_q_len) == (2, 8, 20, 5)
    assert (meta.block_size, meta.num_blocks) == (16, 4)
    plan = meta.gather_plan
    assert plan is not None and plan.store_rows is not None
    assert plan.store_rows.tolist() == [1, 2, 4, 5, 6, 7]


def test_metadata_is_frozen():
    meta = AttentionMetadata(**_good())
    with pytest.raises(AttributeError):
        meta.seq_lens = _i32(1, 1)  # type: ignore[misc]


def test_built_from_host_tensors_for_another_device():
    # The runner's CUDA path, with the "meta" device standing in for a GPU: the values are checked
    # on the host copies, the kernels' tensors moved once, and no reference plan is built there.
    args = _good()
    meta = AttentionMetadata(**args, device="meta")
    assert meta.device == torch.device("meta")
    assert all(
        t.device.type == "meta"
        for t in (meta.block_tables, meta.seq_lens, meta.cu_seqlens_q, meta.slot_mapping)
    )
    assert meta.seq_lens_host == (20, 5) and meta.cu_seqlens_q_host == (0, 3, 8)
    assert meta.gather_plan is None
    args["seq_lens"] = _i32(20, 4)
    with pytest.raises(ValueError, match="< q_len"):
        AttentionMetadata(**args, device="meta")


def test_device_tensors_with_their_host_copies_are_never_read_back():
    # The engine's staging path, "meta" standing in for a GPU: the tensors are already on the
    # device (their values cannot be read there) and the host copies carry the values.
    host = _good()
    names = ("block_tables", "seq_lens", "cu_seqlens_q", "slot_mapping")
    on_device = {n: host[n].to("meta") for n in names}
    host_tensors = tuple(host[n] for n in names)
    meta = AttentionMetadata(
        **on_device, kv_cache_shape=host["kv_cache_shape"], host_tensors=host_tensors
    )
    assert meta.device == torch.device("meta") and meta.host_tensors is None  # not kept
    assert meta.seq_lens_host == (20, 5) and meta.cu_seqlens_q_host == (0, 3, 8)
    bad = (host["block_tables"], host["seq_lens"][:1], host["cu_seqlens_q"], host["slot_mapping"])
    with pytest.raises(ValueError, match="host_tensors' seq_lens"):
        AttentionMetadata(**on_device, kv_cache_shape=host["kv_cache_shape"], host_tensors=bad)
    wrong = dict(host, seq_lens=_i32(20, 4))  # values checked on the host copies
    with pytest.raises(ValueError, match="< q_len"):
        AttentionMetadata(
            **on_device,
            kv_cache_shape=host["kv_cache_shape"],
            host_tensors=tuple(wrong[n] for n in names),
        )


def test_validate_false_skips_only_the_value_checks():
    args = _good()
    args["seq_lens"] = _i32(20, 4)  # a value error: accepted unvalidated
    meta = AttentionMetadata(**args, validate=False)
    assert meta.seq_lens_host == (20, 4)
    args["block_tables"] = args["block_tables"].long()  # a structural error: still rejected
    with pytest.raises(ValueError, match="int32"):
        AttentionMetadata(**args, validate=False)


# ------------------------------------------------------------------- per-layer checks


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_step_checks_its_tensors_against_the_metadata(paged_batch, impl):
    step = {"reference": reference.paged_attention_step, "triton": triton_paged_attention_step}
    attend = step[impl]
    batch = paged_batch([20, 5], [3, 5], block_size=16, group=2)
    meta = _metadata(batch)
    q, k, v, scale = batch.q, batch.k_cache, batch.v_cache, batch.scale
    with pytest.raises(ValueError, match="number of q tokens 7"):
        attend(q[:7], k, v, meta, scale)
    with pytest.raises(ValueError, match="kv_cache_shape"):
        attend(q, k[:-1], v[:-1], meta, scale)
    with pytest.raises(ValueError, match="q dtype"):
        attend(q.half(), k, v, meta, scale)
    with pytest.raises(ValueError, match="metadata must be an AttentionMetadata"):
        attend(q, k, v, batch.block_tables, scale)
    with pytest.raises(ValueError, match="scale"):
        attend(q, k, v, meta, -1.0)
    meta_elsewhere = _metadata(batch, device="meta")
    with pytest.raises(ValueError, match="the metadata on meta"):
        attend(q, k, v, meta_elsewhere, scale)


@pytest.mark.parametrize("impl", IMPLS)
def test_store_step_checks_its_tensors_against_the_metadata(paged_batch, impl):
    store = {"reference": reference.store_kv_step, "triton": triton_store_kv_step}[impl]
    batch = paged_batch([20, 5], [3, 5], block_size=16)
    k, v = batch.k_cache, batch.v_cache
    key = torch.randn(8, *k.shape[2:])
    with pytest.raises(ValueError, match="no slot_mapping"):
        store(key, key, k, v, _metadata(batch))
    meta = _metadata(batch, _slots_of(batch))
    with pytest.raises(ValueError, match="key has 7 tokens"):
        store(key[:7], key[:7], k, v, meta)
    with pytest.raises(ValueError, match="key dtype"):
        store(key.half(), key.half(), k, v, meta)
    with pytest.raises(ValueError, match="kv_cache_shape"):
        store(key, key, k[:, :8], v[:, :8], meta)


def test_values_are_checked_once_per_metadata_not_per_call(paged_batch, monkeypatch):
    calls = []
    check = metadata_module.check_metadata_values

    def counting(*args, **kwargs):
        calls.append(1)
        return check(*args, **kwargs)

    monkeypatch.setattr(metadata_module, "check_metadata_values", counting)
    batch = paged_batch([20, 5], [3, 5], block_size=16)
    meta = _metadata(batch, _slots_of(batch))
    key = torch.randn(8, *batch.k_cache.shape[2:])
    for _ in range(3):  # three "layers"
        kernels.store_kv_step(key, key, batch.k_cache, batch.v_cache, meta)
        kernels.paged_attention_step(batch.q, batch.k_cache, batch.v_cache, meta, batch.scale)
    assert len(calls) == 1
