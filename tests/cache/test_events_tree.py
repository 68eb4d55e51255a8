"""KV events from a real cache: a router's index rebuilt from the drained events alone equals the
cache's set of full-block hashes whenever the queue is drained (splits, trims, evictions, locks,
namespaces, resets); explicit event sequences for the cases that matter.

The reference set is computed through the public API only: every cached path is a prefix of a
sequence once inserted, so the cached full blocks are, over all inserted sequences s, the full
blocks of `match(s)`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from router_index import BlockHashIndex

from radixkv.cache import BlockTable, PrefixCache
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from radixkv.cache.keys import chain_hashes, namespace_seed

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
) -> BlockTable | None:
    """One request the scheduler's way (admit with the prefill cap, commit what it wrote).
    Returns its table (the caller closes it), or None when the pool is too small."""
    written = [*prompt, *reply]
    table = cache.admit(written, max_hit=len(prompt) - 1, namespace=namespace)
    if table is None:
        return None
    cache.commit(table, written)
    inserted.add((namespace, tuple(written)))
    return table


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=14)  # small vocab: many splits
op_st = st.one_of(
    st.tuples(
        st.just("request"), st.sampled_from([None, "tenant-a"]), tokens_st, tokens_st, st.booleans()
    ),
    st.tuples(st.just("evict"), st.integers(1, 4)),
    st.tuples(st.just("release")),
    st.tuples(st.just("reset")),
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(6, 24),
    ops=st.lists(st.tuples(op_st, st.booleans()), max_size=30),
)
def test_index_from_drained_events_equals_cached_full_blocks(
    block_size: int, num_blocks: int, ops: list[tuple[tuple, bool]]
) -> None:
    """Each operation is followed by a drain or not (events wait in the queue until the next)."""
    cache = PrefixCache(num_blocks, block_size, kv_events=True)
    inserted: set[tuple[Namespace, tuple[int, ...]]] = set()
    held: list[BlockTable] = []
    index = BlockHashIndex()  # strict: an unknown parent or removal raises
    for op, drain in [*ops, (("drain",), True)]:
        if op[0] == "request":
            _, namespace, prompt, reply, hold = op
            table = run_request(cache, prompt, reply, namespace, inserted)
            if table is not None:
                if hold:
                    held.append(table)
                else:
                    cache.close(table)
        elif op[0] == "evict":
            cache.evict(op[1])
        elif op[0] == "release" and held:
            cache.close(held.pop(0))
        elif op[0] == "reset":
            assert cache.reset() == (not held)
        cache.check_integrity()
        if drain:
            for event in cache.take_events():
                index.apply(event)
            assert index.hashes == cached_full_block_hashes(cache, inserted)


def put(cache: PrefixCache, tokens: list[int], namespace: Namespace = None) -> None:
    table = run_request(cache, tokens, [], namespace, set())
    assert table is not None
    cache.close(table)


def test_full_blocks_are_announced_partial_tails_never() -> None:
    cache = PrefixCache(16, 4, kv_events=True)
    first = list(range(10, 20))  # 10 tokens: blocks 0, 1 full, block 2 partial
    put(cache, first)
    h = chain(first, 4)
    assert cache.take_events() == [BlockStored((h[0], h[1]), None, tuple(first[:8]), 4)]
    # A branch at position 6 (mid-block 1): split, no event; the branch's block 1 is new.
    branch = [*first[:6], 7, 7, 7, 7, 7, 7, 7]  # 13 tokens: blocks 1 and 2 are the branch's
    put(cache, branch)
    hb = chain(branch, 4)
    assert hb[0] == h[0] and hb[1] != h[1]
    assert cache.take_events() == [BlockStored((hb[1], hb[2]), h[0], tuple(branch[4:12]), 4)]
    cache.check_integrity()  # each node's hashes are its path's chain, split or not


def test_trims_and_removals_announce_exactly_the_blocks_that_leave() -> None:
    cache = PrefixCache(5, 4, kv_events=True)
    tokens = list(range(30, 44))  # 14 tokens: 3 full blocks and a partial one (2 tokens)
    put(cache, tokens)
    h = chain(tokens, 4)
    cache.take_events()
    assert cache.evict(1) == [3]  # the partial tail: nothing a router knows leaves
    assert cache.take_events() == []
    cache.evict(2)  # trimmed back to block 0
    assert cache.take_events() == [BlockRemoved((h[2], h[1]))]  # deepest first
    cache.evict(1)
    assert cache.take_events() == [BlockRemoved((h[0],))]
    assert cache.stats().num_cached_tokens == 0


def test_namespaces_seed_the_chain_and_reset_clears_all() -> None:
    cache = PrefixCache(16, 2, kv_events=True)
    tokens = [5, 6, 7, 8]
    put(cache, tokens)
    put(cache, tokens, namespace="tenant-a")
    shared, salted = chain(tokens, 2), chain(tokens, 2, "tenant-a")
    assert not set(shared) & set(salted)
    assert cache.take_events() == [
        BlockStored(tuple(shared), None, tuple(tokens), 2),
        # a first block: no parent on the wire, the namespace for vLLM's extra keys
        BlockStored(tuple(salted), None, tuple(tokens), 2, "tenant-a"),
    ]
    table = cache.admit(tokens, max_hit=4)
    assert not cache.reset()  # a locked table: nothing changes, nothing announced
    assert cache.take_events() == [] and cache.stats().num_cached_tokens == 8
    cache.close(table)
    assert cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.stats().num_cached_tokens == 0 and cache.stats().num_free_blocks == 16
    cache.check_integrity()
