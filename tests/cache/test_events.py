"""KV events: block hash chain, the Python subscriber API, the router-side index."""

from __future__ import annotations

import logging

import pytest
import xxhash

from radixkv.cache.events import (
    AllBlocksCleared,
    BlockHashIndex,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventStream,
    chain_hashes,
    hash_block,
    namespace_seed,
)


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


def test_subscribers_get_events_in_order_until_closed() -> None:
    stream = KVEventStream()
    assert not stream.active
    got_a: list[KVEvent] = []
    got_b: list[KVEvent] = []
    sub_a = stream.subscribe(got_a.append)
    with stream.subscribe(got_b.append) as sub_b:
        assert stream.active and sub_b.active
        stream.emit(BlockRemoved((1,)))
        stream.emit(AllBlocksCleared())
    assert not sub_b.active
    stream.emit(BlockRemoved((2,)))
    sub_a.close()
    sub_a.close()  # idempotent
    stream.emit(BlockRemoved((3,)))
    assert not stream.active
    assert got_a == [BlockRemoved((1,)), AllBlocksCleared(), BlockRemoved((2,))]
    assert got_b == [BlockRemoved((1,)), AllBlocksCleared()]


def test_a_failing_subscriber_is_logged_and_others_still_served(caplog) -> None:
    stream = KVEventStream()

    def broken(event: KVEvent) -> None:
        raise RuntimeError("router down")

    got: list[KVEvent] = []
    stream.subscribe(broken)
    stream.subscribe(got.append)
    with caplog.at_level(logging.ERROR, logger="radixkv.cache.events"):
        stream.emit(AllBlocksCleared())
    assert got == [AllBlocksCleared()]
    assert stream.num_callback_errors == 1
    assert "router down" in caplog.text


def test_subscribe_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError, match="callback must be callable"):
        KVEventStream().subscribe(42)  # type: ignore[arg-type]


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
