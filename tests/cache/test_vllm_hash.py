"""vLLM's sha256_cbor block-hash chain (radixkv/cache/vllm_hash.py) against the algorithm as vLLM
runs it: `hashlib.sha256(cbor2.dumps(x, canonical=True))` (vllm/utils/hashing.py), chained as
`hash_block_tokens` chains it, seeded as `init_none_hash` seeds it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lifecycle import put
from vllm_kv_events import vllm_chain

from radixkv.cache import PrefixCache, vllm_hash
from radixkv.cache.events import BlockStored
from radixkv.cache.keys import BlockKey, chain_keys, make_block_hasher

cbor2 = pytest.importorskip("cbor2")


def vllm_sha256_cbor(value: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def sha256_keys(
    seed: str, token_ids: list[int], block_size: int, salt: str | None = None, after=None
) -> list[BlockKey]:
    """The cache's keys of whole blocks under vLLM's chain (the one chain builder, `chain_keys`)."""
    tokens_le = np.asarray(token_ids, dtype="<u4").tobytes()
    hasher = make_block_hasher("sha256_cbor", seed)
    return chain_keys(salt, tokens_le, block_size, after=after, hasher=hasher)


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
    keys = sha256_keys(seed, whole, block_size, salt)
    assert [key.block_hash for key in keys] == vllm_chain(seed, whole, block_size, salt)


def test_a_chain_continues_from_its_parent_digest() -> None:
    tokens = list(range(100, 164))
    whole = sha256_keys("0", tokens, 16)
    assert sha256_keys("0", tokens[32:], 16, after=whole[1]) == whole[2:]
    assert whole[0].link != sha256_keys("1", tokens[:16], 16)[0].link


def test_pinned_values() -> None:
    # PYTHONHASHSEED=0, block size 4, tokens 1..8; computed once with cbor2 6.2 and hashlib as
    # vllm_chain does, so a change in either side's encoding shows here
    root = vllm_hash.none_hash("0")
    assert root.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    keys = sha256_keys("0", [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert [key.block_hash for key in keys] == [2164874634404590027, 17270480062156288726]


@pytest.mark.parametrize("bad", [-1, 1.5, True, {"a": 1}])
def test_cbor_refuses_what_the_chain_never_holds(bad: object) -> None:
    with pytest.raises(TypeError):
        vllm_hash.cbor(bad)


def test_default_seed_is_vllms() -> None:
    # vLLM 0.33 seeds sha256_cbor with "vllm-none-hash" when PYTHONHASHSEED is unset
    assert vllm_hash.DEFAULT_SEED == "vllm-none-hash"
    hasher = make_block_hasher("sha256_cbor")
    assert hasher.none_hash == vllm_sha256_cbor("vllm-none-hash")


@given(
    seed=st.sampled_from([None, "0", "42"]),
    block_size=st.sampled_from([1, 4, 16]),
    prompts=st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=40), min_size=1, max_size=4),
    salt=st.none() | st.text(min_size=1, max_size=12),
)
def test_a_caches_events_carry_vllms_hashes(
    seed: str | None, block_size: int, prompts: list[list[int]], salt: str | None
) -> None:
    """A cache recording with the sha256_cbor hasher announces, for every inserted sequence,
    the hashes vLLM computes for it: the events' chains rebuilt per path equal vllm_chain."""
    # 4 prompts of <= 40 tokens fit in 160 blocks of 1: nothing is evicted
    cache = PrefixCache(160, block_size, kv_events=make_block_hasher("sha256_cbor", seed))
    announced: dict[int, tuple[int, ...]] = {}  # wire hash -> the path's token ids up to it
    for tokens in prompts:
        table = cache.admit(tokens, max_hit=len(tokens), namespace=salt)
        assert table is not None
        cache.commit(table, tokens)
        cache.close(table)
        cache.check_integrity()
        for event in cache.take_events():
            assert isinstance(event, BlockStored)
            path = () if event.parent_block_hash is None else announced[event.parent_block_hash]
            assert event.namespace == (salt if event.parent_block_hash is None else None)
            for i, h in enumerate(event.block_hashes):
                path += event.token_ids[i * block_size : (i + 1) * block_size]
                announced[h] = path
        whole = tokens[: len(tokens) // block_size * block_size]
        expected = vllm_chain(seed or "vllm-none-hash", whole, block_size, salt)
        for i, h in enumerate(expected):
            assert announced[h] == tuple(whole[: (i + 1) * block_size])


def test_block_hash_names_are_checked() -> None:
    with pytest.raises(ValueError, match="block_hash must be one of"):
        make_block_hasher("sha1")
    with pytest.raises(ValueError, match="applies to block_hash='sha256_cbor' only"):
        make_block_hasher("xxh64", "0")


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_the_host_tiers_events_carry_vllms_hashes_too(salt: str | None) -> None:
    """Every tier names a block by the node's one key chain: a block demoted to the host is
    announced there ("CPU") under the hash vLLM computes, and a lookup finds it by that key."""
    B = 4
    cache = PrefixCache(4, B, host_blocks=8, kv_events=make_block_hasher("sha256_cbor"))
    a, b = list(range(16)), list(range(100, 116))
    for tokens in (a, b):  # b's blocks evict a's: demoted to the host
        put(cache, tokens, salt)
        cache.check_integrity()
    events = cache.take_events()
    on_host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    on_host_hashes = [h for e in on_host for h in e.block_hashes]
    assert on_host_hashes == vllm_chain("vllm-none-hash", a, B, salt)
    match = cache.match(a, max_tokens=len(a) - 1, namespace=salt)
    assert (match.num_cached_tokens, match.num_host_blocks) == (15, 4)
