"""KV events: block hash chain, the recorded queue the owner drains, the router-side index."""

from __future__ import annotations

import pytest
import xxhash
from router_index import BlockHashIndex

from radixkv import PrefixCache
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from radixkv.cache.keys import chain_hashes, hash_block, namespace_seed


def le(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def test_chain_is_xxh64_over_parent_hash_and_tokens() -> None:
    h0 = xxhash.xxh64_intdigest(le([1, 2]))
    h1 = xxhash.xxh64_intdigest(h0.to_bytes(8, "little") + le([3, 4]))
    assert chain_hashes(None, le([1, 2, 3, 4]), 2) == [h0, h1]
    assert hash_block(h0, le([3, 4])) == h1
    assert chain_hashes(h0, le([3, 4]), 2) == [h1]  # resuming a chain from a parent


def test_namespaces_seed_different_chains() -> None:
    plain = chain_hashes(None, le([1, 2]), 2)
    a = chain_hashes(namespace_seed("a"), le([1, 2]), 2)
    b = chain_hashes(namespace_seed("b"), le([1, 2]), 2)
    assert len({plain[0], a[0], b[0]}) == 3


def test_the_hash_function_is_pluggable_in_one_place() -> None:
    def tagged(parent: int | None, tokens_le: bytes) -> int:
        return hash((parent, tokens_le)) % 2**64

    assert chain_hashes(None, le([1, 2, 3, 4]), 2, tagged) == [
        tagged(None, le([1, 2])),
        tagged(tagged(None, le([1, 2])), le([3, 4])),
    ]


def put(cache: PrefixCache, tokens: list[int]) -> None:
    table = cache.admit(tokens, max_hit=0)
    cache.commit(table, tokens)
    cache.close(table)


def test_events_are_taken_in_order_and_the_queue_is_emptied() -> None:
    cache = PrefixCache(4, 2, kv_events=True)
    assert cache.take_events() == []
    put(cache, [1, 2, 3, 4])
    h = chain_hashes(None, le([1, 2, 3, 4]), 2)
    cache.evict(1)
    assert cache.reset()
    assert cache.take_events() == [
        BlockStored(tuple(h), None, (1, 2, 3, 4), 2),
        BlockRemoved((h[1],)),
        AllBlocksCleared(),
    ]
    assert cache.take_events() == []


def test_a_cache_built_without_events_records_and_hashes_nothing() -> None:
    cache = PrefixCache(8, 2)
    put(cache, [1, 2, 3, 4, 5])
    cache.evict(1)
    cache.reset()
    assert cache._events is None and cache._tree.keys is None
    assert cache.take_events() == []
    put(cache, [1, 2, 3, 4, 5])
    assert all(node.block_keys is None for node, _ in cache._tree.iter_nodes())
    cache.check_integrity()


def test_index_follows_stores_removals_and_clears() -> None:
    B = 2
    h = chain_hashes(None, le([1, 2, 3, 4, 5, 6]), B)
    index = BlockHashIndex()
    index.apply(BlockStored((h[0], h[1]), None, (1, 2, 3, 4), B))
    index.apply(BlockStored((h[2],), h[1], (5, 6), B))
    assert index.hashes == set(h)
    assert index.parents == {h[0]: None, h[1]: h[0], h[2]: h[1]}
    assert index.longest_prefix_blocks([1, 2, 3, 4, 5, 6, 7], B) == 3
    assert index.longest_prefix_blocks([1, 2, 9, 9], B) == 1
    index.apply(BlockRemoved((h[2], h[1])))
    assert index.hashes == {h[0]}
    index.apply(AllBlocksCleared())
    assert len(index) == 0


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (BlockStored((5,), 99, (1, 2), 2), "unknown parent hash 99"),
        (BlockStored((5,), None, (1, 2, 3), 2), "3 token ids for 1 blocks of 2"),
        (BlockRemoved((77,)), r"unknown block hashes \[77\]"),
    ],
)
def test_index_is_strict(event: KVEvent, message: str) -> None:
    index = BlockHashIndex()
    with pytest.raises(ValueError, match=message):
        index.apply(event)
    assert len(index) == 0


def test_index_rejects_a_hash_stored_twice() -> None:
    index = BlockHashIndex()
    index.apply(BlockStored((5,), None, (1, 2), 2))
    with pytest.raises(ValueError, match="block hash 5 stored twice"):
        index.apply(BlockStored((5,), None, (1, 2), 2))
