"""vLLM's sha256_cbor block-hash chain (radixkv/cache/vllm_hash.py) against the algorithm as vLLM
runs it: `hashlib.sha256(cbor2.dumps(x, canonical=True))` (vllm/utils/hashing.py), chained as
`hash_block_tokens` chains it, seeded as `init_none_hash` seeds it."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache import vllm_hash

cbor2 = pytest.importorskip("cbor2")


def vllm_sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def vllm_chain(seed: str, token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """vLLM's block hashes of a request, as its KV events carry them (int form)."""
    none_hash = vllm_sha256_cbor(seed)
    parent, hashes = None, []
    for i in range(len(token_ids) // block_size):
        extra = (salt,) if i == 0 and salt else None
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = vllm_sha256_cbor((parent or none_hash, block, extra))
        hashes.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return hashes


values = st.recursive(
    st.none()
    | st.binary(max_size=300)
    | st.text(max_size=300)
    | st.integers(min_value=0, max_value=2**64 - 1),
    lambda inner: st.lists(inner, max_size=30) | st.tuples(inner, inner),
    max_leaves=40,
)


@given(values)
def test_cbor_is_cbor2_canonical(value: object) -> None:
    assert vllm_hash.cbor(value) == cbor2.dumps(value, canonical=True)


@given(
    seed=st.sampled_from(["0", "42", "12345", "séed"]),
    block_size=st.sampled_from([1, 4, 16]),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    salt=st.none() | st.text(min_size=1, max_size=12),
)
def test_chain_is_vllms(seed: str, block_size: int, token_ids: list[int], salt: str | None) -> None:
    whole = token_ids[: len(token_ids) // block_size * block_size]
    first_extra = (salt,) if salt else None
    digests = vllm_hash.chain(vllm_hash.none_hash(seed), whole, block_size, first_extra=first_extra)
    assert [vllm_hash.wire_hash(d) for d in digests] == vllm_chain(seed, whole, block_size, salt)


def test_a_chain_continues_from_its_parent_digest() -> None:
    tokens = list(range(100, 164))
    root = vllm_hash.none_hash("0")
    whole = vllm_hash.chain(root, tokens, 16)
    assert vllm_hash.chain(whole[1], tokens[32:], 16) == whole[2:]
    assert whole[0] != vllm_hash.chain(vllm_hash.none_hash("1"), tokens[:16], 16)[0]


def test_pinned_values() -> None:
    # PYTHONHASHSEED=0, block size 4, tokens 1..8; computed once with cbor2 6.2 and hashlib as
    # vllm_chain does, so a change in either side's encoding shows here
    root = vllm_hash.none_hash("0")
    assert root.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    digests = vllm_hash.chain(root, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert [vllm_hash.wire_hash(d) for d in digests] == [2164874634404590027, 17270480062156288726]


@pytest.mark.parametrize("bad", [-1, 1.5, True, {"a": 1}])
def test_cbor_refuses_what_the_chain_never_holds(bad: object) -> None:
    with pytest.raises(TypeError):
        vllm_hash.cbor(bad)
