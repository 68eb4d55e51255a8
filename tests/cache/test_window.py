"""The window group (`radixkv.cache.window`) and the grouped cache over it: window blocks follow
a running request's window, a hit resumes only where the window KV before it is kept, tails are
evicted least recently used first. The simulated test writes a "KV" per slot (the hash of the
prefix up to that token) and checks every read a query would do against it."""

from __future__ import annotations

import random

import pytest
from group_sim import GroupSim
from router_index import BlockHashIndex
from window_cache import window_cache

from radixkv import PackedTokens
from radixkv.cache.events import BlockStored
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.keys import chain_hashes, namespace_seed
from radixkv.cache.window import WindowGroup, first_live_index


@pytest.mark.parametrize(
    ("written", "window", "block_size", "first"),
    [(0, 8, 4, 0), (8, 8, 4, 0), (11, 8, 4, 1), (12, 8, 4, 1), (13, 8, 4, 1), (20, 8, 4, 3)],
)
def test_first_live_index(written: int, window: int, block_size: int, first: int) -> None:
    # the query at `written` reads keys (written - window, written]
    assert first_live_index(written, window, block_size) == first


def _qb(tokens: range | list[int]) -> bytes:
    return PackedTokens(tokens).tobytes()


def test_a_running_table_releases_what_falls_out_of_the_window() -> None:
    group = WindowGroup(16, 4, window=8)
    table = group.open(b"", 0, None)
    assert table is not None and group.extend(table, 20) and len(table.blocks) == 5
    assert group.pool.num_free == 11
    group.slide(table, 12)  # keys from position 5 on: block 0 goes
    assert table.blocks[0] is None and table.num_live_blocks == 4 and group.pool.num_free == 12
    group.slide(table, 20)  # keys from 13 on: blocks 1 and 2 go
    assert table.blocks[:3] == (None, None, None) and group.pool.num_free == 14
    group.check_integrity()
    group.close(table)
    assert group.pool.num_free == 16
    group.check_integrity()


def test_a_tail_serves_a_hit_with_a_copy_of_its_partial_block() -> None:
    group = WindowGroup(16, 4, window=8)
    tokens = _qb(range(1, 30))
    first = group.open(tokens, 0, None)
    assert first is not None and group.extend(first, 13)
    group.slide(first, 13)
    group.keep_tail(first, tokens, 13)  # keeps indices first_live_index(13) = 1 .. 3
    tail = first.blocks[1:4]
    group.close(first)
    assert group.pool.num_free == 13 and group.num_tails == 1
    assert group.hit(tokens, 20, None) == 13 and group.hit(tokens, 12, None) == 0
    assert group.hit(_qb([9, *range(2, 30)]), 20, None) == 0  # another prefix
    assert group.hit(tokens, 20, "tenant") == 0  # another namespace
    second = group.open(tokens, 13, None)
    assert second is not None and second.blocks[:3] == (None, *tail[:2])
    assert second.copy == (tail[2], second.blocks[3], 1)
    group.check_integrity()
    group.slide(second, 13)  # the copy ran: its source is no longer pinned
    group.check_integrity()
    group.close(second)
    group.check_integrity()


def test_tails_go_least_recently_used_first_and_the_hit_falls_back() -> None:
    group = WindowGroup(8, 4, window=4)
    tokens = _qb(range(1, 50))
    table = group.open(tokens, 0, None)
    assert table is not None
    for end in (10, 18, 26):  # three tails of 2 blocks each (indices 1-2, 3-4, 5-6)
        assert group.extend(table, end)
        group.slide(table, end)
        group.keep_tail(table, tokens, end)
    group.close(table)
    assert group.pool.num_free == 2 and group.num_evictable_blocks() == 6
    assert group.hit(tokens, 30, None) == 26 and group.hit(tokens, 25, None) == 18
    reader = group.open(tokens, 18, None)  # refreshes the tail at 18, copies its index 4
    assert reader is not None and group.pool.num_free == 1
    assert group.extend(reader, 25)  # 2 more blocks: the tail at 10 goes
    assert group.num_evicted_tails == 1 and group.hit(tokens, 12, None) == 0
    assert group.hit(tokens, 30, None) == 26
    group.check_integrity()
    assert not group.extend(reader, 44)  # 4 more: 1 free + the tail at 26's 2 are too few
    assert group.num_evicted_tails == 1, "a failed extend evicts nothing"
    group.close(reader)
    group.check_integrity()


def test_stats_split_the_pool_into_in_use_tail_and_free_blocks() -> None:
    group = WindowGroup(8, 4, window=4)
    tokens = _qb(range(1, 50))
    table = group.open(tokens, 0, None)
    assert table is not None
    for end in (10, 18):  # tails of indices 1-2, then 3-4, which the table still lists
        assert group.extend(table, end)
        group.slide(table, end)
        group.keep_tail(table, tokens, end)
    split = ("num_in_use_blocks", "num_tail_blocks", "num_free_blocks", "num_tails")

    def figures() -> tuple[int, ...]:
        stats = group.stats()
        assert (stats.window, stats.num_blocks, stats.num_host_blocks) == (4, 8, 0)
        return tuple(getattr(stats, name) for name in split)

    assert figures() == (2, 2, 4, 2)
    group.close(table)
    assert figures() == (0, 4, 4, 2)
    assert group.evict(1) and figures() == (0, 2, 6, 1)
    assert group.stats().num_evicted_tails == 1
    group.check_integrity()


def test_speculative_and_superseded_tails_go_before_proven_ones() -> None:
    group = WindowGroup(16, 4, window=4)
    chat, doc = _qb(range(1, 30)), _qb(range(100, 130))
    table = group.open(chat, 0, None)
    assert table is not None
    for end in (10, 18):  # the tail at 18 supersedes the one at 10: a chat's next turn
        assert group.extend(table, end)
        group.slide(table, end)
        group.keep_tail(table, chat, end)
    group.close(table)
    table = group.open(doc, 0, None)
    assert table is not None and group.extend(table, 10)
    group.keep_tail(table, doc, 10, branch=True)  # where the tree's paths branch: proven
    group.keep_tail(table, doc, 6)  # a speculative tail on the same path, kept at a chunk's end
    group.close(table)
    ends = [len(prefix) // 4 for _, prefix in group.tail_prefixes()]
    assert ends == [10, 18, 6, 10], "superseded, speculative, then proven"
    group.check_integrity()
    assert len(group.evict(1)) == 2  # the tail at 10 goes, with its blocks of indices 1, 2
    assert group.hit(chat, 17, None) == 0 and group.hit(chat, 20, None) == 18
    assert group.hit(doc, 20, None) == 10
    group.check_integrity()


def test_admit_resumes_at_the_deepest_kept_window_and_returns_none_untouched() -> None:
    cache = window_cache(num_blocks=32, num_window_blocks=5, block_size=4, window=8)
    prompt = PackedTokens(range(1, 22))
    first = cache.admit(prompt, max_hit=20, first_chunk=12)
    assert first is not None and first.num_cached_tokens == 0
    cache.slide(first, 12)
    cache.commit(first, prompt[:12])  # a chunk's end
    assert cache.extend(first, 21)
    cache.slide(first, 21)
    cache.commit(first, prompt)
    cache.close(first)
    cache.check_integrity()
    longer = prompt + [90, 91]
    assert cache.tree.match(longer).num_cached_tokens == 21
    assert cache.match(longer).num_cached_tokens == 21
    assert cache.match(longer, max_tokens=20).num_cached_tokens == 12
    before = cache.tree.stats()
    much_longer = prompt + list(range(90, 130))  # the same hit, 40 tokens past it
    assert cache.admit(much_longer, max_hit=22, first_chunk=60) is None  # 13 window blocks
    assert cache.tree.stats() == before and cache.groups[1].num_tails == 2
    resumed = cache.admit(longer, max_hit=22)
    assert resumed is not None and resumed.num_cached_tokens == 21
    assert resumed.tables[1].copy is not None and resumed.tables[0].copy is not None
    cache.check_integrity()
    cache.close(resumed)
    cache.check_integrity()


def test_the_window_before_a_branch_point_is_kept_for_the_next_request() -> None:
    cache = window_cache(num_blocks=64, num_window_blocks=32, block_size=4, window=8)
    doc = list(range(1, 40))

    def serve(question: list[int]) -> int:
        tokens = doc + question
        table = cache.admit(tokens, max_hit=len(tokens) - 1, first_chunk=0)
        assert table is not None
        hit = table.num_cached_tokens
        for pos, end in ((hit, 30), (30, len(tokens))):  # two chunks, the branch inside the 2nd
            pos, end = max(pos, hit), max(end, hit)
            assert cache.extend(table, end)
            cache.slide(table, pos)
        cache.slide(table, len(tokens))
        cache.commit(table, tokens)
        cache.close(table)
        cache.check_integrity()
        return hit

    assert serve([90, 91, 92]) == 0
    assert serve([80, 81]) == 0  # the full tree has the document, its window KV is gone
    assert serve([70, 71, 72, 73]) == len(doc)  # kept by the second request at its branch


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_query_reads_the_kv_it_needs_under_eviction(block_size: int, seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([3, 8, 21])
    cache = window_cache(
        num_blocks=400 // block_size + 8,
        num_window_blocks=3 * (window // block_size + 2) + 40 // block_size,
        block_size=block_size,
        window=window,
    )
    sim = GroupSim(cache)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    hits = 0
    for _ in range(40):
        tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.5:
            stems.append(tokens)
        num_prompt = rng.randrange(1, len(tokens) + 1)
        hit = sim.serve(rng, tokens, num_prompt, chunk=rng.choice([1, 5, 64]))
        hits += max(hit, 0)
        assert cache.tree.stats().num_in_use_blocks == 0
        assert cache.groups[1].pool.num_free + cache.groups[1].num_evictable_blocks() == (
            cache.groups[1].pool.num_blocks
        )
    assert hits > 0
    assert cache.groups[1].num_evicted_tails > 0


def _tail_hashes(cache: GroupedCache) -> set[int]:
    """The chained hashes of the full blocks the tails keep, recomputed from their prefixes."""
    B, W = cache.block_size, cache.groups[1].window
    hashes: set[int] = set()
    for namespace, prefix in cache.groups[1].tail_prefixes():
        end = len(prefix) // 4
        seed = None if namespace is None else namespace_seed(namespace)
        chain = chain_hashes(seed, prefix[: 4 * (end // B * B)], B)
        hashes.update(chain[first_live_index(end, W, B) :])
    return hashes


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_events_name_each_groups_blocks_under_eviction(block_size: int, seed: int) -> None:
    """A router's index, fed the one queue, holds the tree's full blocks as group 0 and the
    tails' full blocks as group 1 (each key once however many tails keep it), after every
    request, while both pools evict."""
    rng = random.Random(seed)
    window = rng.choice([3, 8])
    cache = window_cache(
        num_blocks=200 // block_size + 8,
        num_window_blocks=3 * (window // block_size + 2) + 40 // block_size,
        block_size=block_size,
        window=window,
        kv_events=True,
    )
    sim, index = GroupSim(cache), BlockHashIndex()
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    served: list[list[int]] = []
    for _ in range(30):
        tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.5:
            stems.append(tokens)
        sim.serve(rng, tokens, rng.randrange(1, len(tokens) + 1), chunk=rng.choice([1, 5, 64]))
        served.append(tokens)
        events = cache.tree.take_events()
        for event in events:
            index.apply(event)  # strict: a key stored twice in its group or removed unknown raises
        window_events = [e for e in events if getattr(e, "group_idx", 0)]
        assert all(e.group_idx == 1 for e in window_events)
        assert all(e.sliding_window == window for e in window_events if isinstance(e, BlockStored))
        assert index.window_hashes == _tail_hashes(cache)
        for prompt in served:
            held = cache.tree.match(prompt).num_cached_tokens // block_size
            assert index.longest_prefix_blocks(prompt, block_size) == held
    assert cache.groups[1].num_evicted_tails > 0 and index.window_hashes
    assert cache.tree.stats().num_evicted_blocks > 0


def test_a_window_run_chains_from_the_full_block_before_it() -> None:
    cache = window_cache(
        num_blocks=32, num_window_blocks=16, block_size=4, window=8, kv_events=True
    )
    tokens = list(range(1, 22))
    table = cache.admit(tokens, max_hit=0, namespace="tenant")
    assert table is not None
    cache.commit(table, tokens)  # a tail at 21 keeps window indices 3, 4 and 5 (5 partial)
    cache.close(table)
    full, window = cache.tree.take_events()
    seed = namespace_seed("tenant")
    chain = chain_hashes(seed, b"".join(t.to_bytes(4, "little") for t in tokens[:20]), 4)
    assert isinstance(full, BlockStored) and full.block_hashes == tuple(chain)
    assert full.group_idx == 0 and full.sliding_window is None and full.namespace == "tenant"
    assert window == BlockStored(
        tuple(chain[3:5]), chain[2], tuple(tokens[12:20]), 4, None, None, 1, 8
    )
    cache.check_integrity()


def _group_with_a_tail_and_a_table() -> tuple[WindowGroup, object]:
    group = WindowGroup(16, 4, window=8)
    tokens = _qb(range(1, 30))
    table = group.open(tokens, 0, None)
    assert table is not None and group.extend(table, 13)
    group.keep_tail(table, tokens, 13)
    group.check_integrity()
    return group, table


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda g, t: g.pool.add_owner(t.blocks[1]),  # an owner nobody records
        lambda g, t: g._tail_refs.update([t.blocks[0]]),  # a tail reference without a tail
        lambda g, t: g._proven.update(g._speculative),  # a tail in both segments
        lambda g, t: g._ends.add(None, 7),  # an end without a tail
        lambda g, t: setattr(t, "blocks", (t.blocks[0], None, *t.blocks[2:])),  # a hole
    ],
)
def test_check_integrity_catches_corruption(corrupt) -> None:
    group, table = _group_with_a_tail_and_a_table()
    corrupt(group, table)
    with pytest.raises(AssertionError):
        group.check_integrity()
