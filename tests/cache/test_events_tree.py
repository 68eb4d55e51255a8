"""KV events from a real cache: a router's index rebuilt from the events alone equals the cache's
set of full-block hashes after every operation (splits, trims, evictions, locks, namespaces,
resets, late subscribers); explicit event sequences for the cases that matter.

The reference set is computed through the public API only: every cached path is a prefix of a
sequence once inserted, so the cached full blocks are, over all inserted sequences s, the full
blocks of `match(s)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache import PrefixCache
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockHashIndex,
    BlockRemoved,
    BlockStored,
    KVEvent,
    chain_hashes,
    namespace_seed,
)

Namespace = str | None


def le(tokens: Sequence[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def chain(tokens: Sequence[int], block_size: int, namespace: Namespace = None) -> list[int]:
    seed = None if namespace is None else namespace_seed(namespace)
    n = len(tokens) // block_size * block_size
    return chain_hashes(seed, le(tokens[:n]), block_size)


def cached_full_block_hashes(
    cache: PrefixCache, inserted: set[tuple[Namespace, tuple[int, ...]]]
) -> set[int]:
    hashes: set[int] = set()
    for namespace, tokens in inserted:
        m = cache.match(tokens, namespace=namespace).num_cached_tokens
        hashes.update(chain(tokens[:m], cache.block_size, namespace))
    return hashes


def run_request(
    cache: PrefixCache,
    prompt: Sequence[int],
    reply: Sequence[int],
    namespace: Namespace,
    inserted: set[tuple[Namespace, tuple[int, ...]]],
):
    """One request the scheduler's way (match with the prefill cap, lock, copy-on-write of a
    partial block, allocate, insert). Returns its handle (the caller releases it), or None when
    the pool is too small (everything undone)."""
    B = cache.block_size
    written = [*prompt, *reply]
    match = cache.match(prompt, max_tokens=len(prompt) - 1, namespace=namespace)
    handle = cache.acquire(match)
    table = list(match.block_ids)
    need = -(-len(written) // B) - len(table) + match.last_block_partial
    new = cache.allocate(need)
    if new is None:
        cache.release(handle)
        return None
    if match.last_block_partial:
        table[-1] = new.pop(0)  # copy-on-write: the shared block is never written
    table += new
    result = cache.insert(written, table, handle=handle)
    cache.free(result.owned_block_ids)
    inserted.add((namespace, tuple(written)))
    return result.handle


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # small vocab: many splits
op_st = st.one_of(
    st.tuples(
        st.just("request"), st.sampled_from([None, "tenant-a"]), tokens_st, tokens_st, st.booleans()
    ),
    st.tuples(st.just("evict"), st.integers(1, 4)),
    st.tuples(st.just("release")),
    st.tuples(st.just("reset")),
    st.tuples(st.just("subscribe")),
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 24),
    ops=st.lists(op_st, max_size=30),
    subscribe_first=st.booleans(),
)
def test_index_from_events_equals_cached_full_blocks_after_every_operation(
    block_size: int, num_blocks: int, ops: list[tuple], subscribe_first: bool
) -> None:
    cache = PrefixCache(num_blocks, block_size)
    inserted: set[tuple[Namespace, tuple[int, ...]]] = set()
    held = []
    indexes: list[BlockHashIndex] = []

    def subscribe() -> None:
        index = BlockHashIndex()  # strict: an unknown parent or removal raises
        cache.events.subscribe(index.apply)
        indexes.append(index)

    if subscribe_first:
        subscribe()
    for op in ops:
        if op[0] == "request":
            _, namespace, prompt, reply, hold = op
            handle = run_request(cache, prompt, reply, namespace, inserted)
            if handle is not None:
                if hold:
                    held.append(handle)
                else:
                    cache.release(handle)
        elif op[0] == "evict":
            cache.evict(op[1])
        elif op[0] == "release" and held:
            cache.release(held.pop(0))
        elif op[0] == "reset":
            assert cache.reset() == (not held)
        elif op[0] == "subscribe":
            subscribe()
        cache.check_integrity()
        expected = cached_full_block_hashes(cache, inserted)
        for index in indexes:
            assert index.hashes == expected
        assert cache.events.num_callback_errors == 0  # the strict index never objected


def recorded(cache: PrefixCache) -> list[KVEvent]:
    events: list[KVEvent] = []
    cache.events.subscribe(events.append)
    return events


def put(cache: PrefixCache, tokens: list[int], namespace: Namespace = None) -> None:
    handle = run_request(cache, tokens, [], namespace, set())
    assert handle is not None
    cache.release(handle)


def test_full_blocks_are_announced_partial_tails_never() -> None:
    cache = PrefixCache(16, 4)
    events = recorded(cache)
    first = list(range(10, 20))  # 10 tokens: blocks 0, 1 full, block 2 partial
    put(cache, first)
    h = chain(first, 4)
    assert events == [BlockStored((h[0], h[1]), None, tuple(first[:8]), 4)]
    # A branch at position 6 (mid-block 1): split, no event; the branch's block 1 is new.
    branch = [*first[:6], 7, 7, 7, 7, 7, 7, 7]  # 13 tokens: blocks 1 and 2 are the branch's
    put(cache, branch)
    hb = chain(branch, 4)
    assert hb[0] == h[0] and hb[1] != h[1]
    assert events[1:] == [BlockStored((hb[1], hb[2]), h[0], tuple(branch[4:12]), 4)]
    cache.check_integrity()  # each node's hashes are its path's chain, split or not


def test_trims_and_removals_announce_exactly_the_blocks_that_leave() -> None:
    cache = PrefixCache(5, 4)
    events = recorded(cache)
    tokens = list(range(30, 44))  # 14 tokens: 3 full blocks and a partial one (2 tokens)
    put(cache, tokens)
    h = chain(tokens, 4)
    del events[:]
    assert cache.evict(1) == [3]  # the partial tail: nothing a router knows leaves
    assert events == []
    cache.evict(2)  # trimmed back to block 0
    assert events == [BlockRemoved((h[2], h[1]))]  # deepest first
    cache.evict(1)
    assert events[1:] == [BlockRemoved((h[0],))]
    assert cache.num_cached_tokens == 0


def test_namespaces_seed_the_chain_and_reset_clears_all() -> None:
    cache = PrefixCache(16, 2)
    events = recorded(cache)
    tokens = [5, 6, 7, 8]
    put(cache, tokens)
    put(cache, tokens, namespace="tenant-a")
    shared, salted = chain(tokens, 2), chain(tokens, 2, "tenant-a")
    assert not set(shared) & set(salted)
    assert events == [
        BlockStored(tuple(shared), None, tuple(tokens), 2),
        BlockStored(tuple(salted), None, tuple(tokens), 2),  # a first block: no parent on the wire
    ]
    handle = cache.acquire(cache.match(tokens))
    assert not cache.reset()  # a live handle: nothing changes, nothing announced
    assert len(events) == 2 and cache.num_cached_tokens == 8
    cache.release(handle)
    assert cache.reset()
    assert events[2:] == [AllBlocksCleared()]
    assert cache.num_cached_tokens == 0 and cache.num_free_blocks == 16
    cache.check_integrity()


def test_a_late_subscriber_first_gets_the_content_parents_first() -> None:
    cache = PrefixCache(32, 2)
    put(cache, [1, 2, 3, 4, 5])
    put(cache, [1, 2, 3, 9, 9, 9])  # splits [1..5] at 3 (mid-block 1)
    put(cache, [1, 2, 3], namespace="tenant-a")
    index = BlockHashIndex()  # strict: a child before its parent would raise
    cache.events.subscribe(index.apply)
    expected = set(chain([1, 2, 3, 4, 5], 2) + chain([1, 2, 3, 9, 9, 9], 2))
    assert index.hashes == expected | set(chain([1, 2, 3], 2, "tenant-a"))


def test_a_subscriber_interrupted_in_its_snapshot_is_not_subscribed() -> None:
    """The snapshot hashes nodes as it goes: a stream left active after an interrupted one would
    hold unhashed nodes and announce their children under a wrong parent hash."""
    cache = PrefixCache(32, 2)
    for tokens in ([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4, 9, 9]):
        put(cache, tokens)
    got: list[KVEvent] = []

    def interrupted(event: KVEvent) -> None:
        got.append(event)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.events.subscribe(interrupted)
    assert len(got) == 1 and not cache.events.active
    cache.check_integrity()
    put(cache, [5, 6, 7, 8, 1, 1])
    assert len(got) == 1  # no longer called
    index = BlockHashIndex()
    cache.events.subscribe(index.apply)
    put(cache, [1, 2, 3, 4, 9, 9, 7, 7])
    inserted = [[1, 2, 3, 4, 9, 9, 7, 7], [5, 6, 7, 8, 1, 1]]
    assert index.hashes == {h for tokens in inserted for h in chain(tokens, 2)}
    cache.check_integrity()
