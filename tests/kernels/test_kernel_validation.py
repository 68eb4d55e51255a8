"""Launcher input validation: a ValueError naming the argument, from the reference and from Triton.

Validation runs before any kernel launch, so the Triton launchers are exercised on CPU tensors too
(their content checks run for CPU tensors; the "meta" device stands in for a foreign device).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from radixkv.kernels import check_attention_metadata, reference, use_backend
from radixkv.kernels.triton_copy_blocks import copy_blocks as triton_copy_blocks
from radixkv.kernels.triton_paged_attention import paged_attention as triton_paged_attention
from radixkv.kernels.triton_store_kv import store_kv as triton_store_kv

# The Triton launchers on CPU tensors need the interpreter (skipped on a GPU machine).
IMPLS = ["reference", pytest.param("triton", marks=pytest.mark.interpreter)]
ATTENTION = {"reference": reference.paged_attention, "triton": triton_paged_attention}
STORE = {"reference": reference.store_kv, "triton": triton_store_kv}
COPY = {"reference": reference.copy_blocks, "triton": triton_copy_blocks}


def _attention_args(paged_batch) -> dict:
    batch = paged_batch([20, 5], [3, 5], block_size=16, group=2)
    return {
        "q": batch.q,
        "k_cache": batch.k_cache,
        "v_cache": batch.v_cache,
        "block_tables": batch.block_tables,
        "seq_lens": batch.seq_lens,
        "cu_seqlens_q": batch.cu_seqlens_q,
        "scale": batch.scale,
    }


def _set(name: str, make: Callable[[dict], object]) -> Callable[[dict], None]:
    def mutate(args: dict) -> None:
        args[name] = make(args)

    return mutate


ATTENTION_ERRORS = [
    ("block_tables int64", _set("block_tables", lambda a: a["block_tables"].long()), "int32"),
    ("seq_lens int64", _set("seq_lens", lambda a: a["seq_lens"].long()), "seq_lens"),
    (
        "q heads not a multiple of kv heads",
        _set("q", lambda a: torch.randn(8, 3, 64)),
        "not a multiple",
    ),
    ("q dtype", _set("q", lambda a: a["q"].half()), "q dtype"),
    ("q head_dim", _set("q", lambda a: a["q"][..., :32]), "head_dim"),
    ("q 2-D", _set("q", lambda a: a["q"].flatten(1)), "q must be"),
    ("q strided head_dim", _set("q", lambda a: a["q"].transpose(1, 2)), "head_dim"),
    ("v_cache shape", _set("v_cache", lambda a: a["v_cache"][:-1]), "v_cache shape"),
    ("v_cache dtype", _set("v_cache", lambda a: a["v_cache"].double()), "v_cache dtype"),
    ("cache int dtype", _set("k_cache", lambda a: a["k_cache"].int()), "k_cache dtype"),
    (
        "seq_len < q_len",
        _set("seq_lens", lambda a: torch.tensor([20, 4], dtype=torch.int32)),
        r"seq_lens\[1\] = 4 < q_len 5",
    ),
    (
        "block table too short",
        _set("seq_lens", lambda a: torch.tensor([49, 5], dtype=torch.int32)),
        "too short",
    ),
    (
        "block id past the cache",
        _set("block_tables", lambda a: a["block_tables"].masked_fill(a["block_tables"] >= 0, 999)),
        "num_blocks",
    ),
    (
        "negative block id within seq_len",
        _set("block_tables", lambda a: a["block_tables"].clamp(max=-1)),
        "negative block id",
    ),
    (
        "cu_seqlens_q length",
        _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][:-1]),
        "num_reqs \\+ 1",
    ),
    (
        "cu_seqlens_q total",
        _set("cu_seqlens_q", lambda a: torch.tensor([0, 3, 7], dtype=torch.int32)),
        r"cu_seqlens_q\[-1\]",
    ),
    (
        "cu_seqlens_q decreasing",
        _set("cu_seqlens_q", lambda a: torch.tensor([0, 9, 8], dtype=torch.int32)),
        "non-decreasing",
    ),
    ("seq_lens count", _set("seq_lens", lambda a: a["seq_lens"][:1]), "seq_lens has 1"),
    ("scale", _set("scale", lambda a: 0.0), "scale"),
    ("device", _set("block_tables", lambda a: a["block_tables"].to("meta")), "block_tables is on"),
    ("not a tensor", _set("seq_lens", lambda a: [20, 5]), "seq_lens must be a torch.Tensor"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("mutate", "match"),
    [pytest.param(m, match, id=name) for name, m, match in ATTENTION_ERRORS],
)
def test_paged_attention_rejects(paged_batch, impl, mutate, match):
    args = _attention_args(paged_batch)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        ATTENTION[impl](**args)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("out", "match"),
    [
        (torch.empty(8, 4, 32), "out shape"),
        (torch.empty(8, 4, 64, dtype=torch.float16), "out dtype"),
        (torch.empty(8, 64, 4).transpose(1, 2), "out must have unit stride"),
    ],
)
def test_paged_attention_rejects_out(paged_batch, impl, out, match):
    with pytest.raises(ValueError, match=match):
        ATTENTION[impl](**_attention_args(paged_batch), out=out)


def test_triton_rejects_bad_num_kv_splits(paged_batch):
    with pytest.raises(ValueError, match="num_kv_splits"):
        triton_paged_attention(**_attention_args(paged_batch), num_kv_splits=0)


def test_check_attention_metadata_accepts_padding_past_seq_len():
    # Entries past a request's last block are never read: any value is fine there.
    tables = torch.tensor([[3, -1, 99], [1, 2, -7]], dtype=torch.int32)
    check_attention_metadata(
        tables,
        torch.tensor([16, 17], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        block_size=16,
        num_blocks=4,
        num_q_tokens=2,
    )


def _store_args() -> dict:
    cache = torch.zeros(4, 16, 2, 64)
    return {
        "key": torch.randn(5, 2, 64),
        "value": torch.randn(5, 2, 64),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "slot_mapping": torch.tensor([0, 1, 2, -1, 63]),
    }


STORE_ERRORS = [
    ("slot float", _set("slot_mapping", lambda a: a["slot_mapping"].float()), "slot_mapping"),
    ("slot count", _set("slot_mapping", lambda a: a["slot_mapping"][:4]), "4 entries for 5"),
    ("slot past cache", _set("slot_mapping", lambda a: torch.tensor([0, 1, 2, 3, 64])), "64"),
    ("slot twice", _set("slot_mapping", lambda a: torch.tensor([0, 1, 2, 2, -1])), "twice"),
    ("key dtype", _set("key", lambda a: a["key"].half()), "key dtype"),
    ("key heads", _set("key", lambda a: torch.randn(5, 3, 64)), "num_kv_heads=2"),
    ("value shape", _set("value", lambda a: a["value"][:4]), "value shape"),
    ("stacked cache", _set("k_cache", lambda a: a["k_cache"][None]), "k_cache must have 4"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("mutate", "match"), [pytest.param(m, match, id=name) for name, m, match in STORE_ERRORS]
)
def test_store_kv_rejects(impl, mutate, match):
    args = _store_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        STORE[impl](**args)


def _copy_args() -> dict:
    cache = torch.zeros(2, 6, 16, 2, 64)
    return {
        "k_cache": cache,
        "v_cache": cache.clone(),
        "src": torch.tensor([0, 1]),
        "dst": torch.tensor([2, 3]),
        "num_slots": torch.tensor([5, 16]),
    }


COPY_ERRORS = [
    ("lengths", _set("dst", lambda a: torch.tensor([2])), "same length"),
    ("num_slots > block_size", _set("num_slots", lambda a: torch.tensor([5, 17])), "num_slots"),
    ("dst twice", _set("dst", lambda a: torch.tensor([2, 2])), "dst holds the same block"),
    ("dst is a src", _set("dst", lambda a: torch.tensor([1, 3])), "also a src"),
    ("block id", _set("src", lambda a: torch.tensor([0, 6])), "src holds a block id"),
    ("float ids", _set("src", lambda a: a["src"].float()), "src must have dtype"),
    ("3-D cache", _set("k_cache", lambda a: a["k_cache"][0, 0]), "k_cache must have 4 or 5"),
    ("v_cache shape", _set("v_cache", lambda a: a["v_cache"][0]), "v_cache shape"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("mutate", "match"), [pytest.param(m, match, id=name) for name, m, match in COPY_ERRORS]
)
def test_copy_blocks_rejects(impl, mutate, match):
    args = _copy_args()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        COPY[impl](**args)


def test_use_backend_rejects_unknown_name():
    with pytest.raises(ValueError, match="backend must be one of"), use_backend("cuda"):  # type: ignore[arg-type]
        pass
