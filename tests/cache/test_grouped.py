"""The grouped cache (`radixkv.cache.grouped`) over the tree's group and one or two window groups,
against a simulated KV (`group_sim.GroupSim`): random workloads (shared stems, chunked prefill,
commits at chunk ends and prompt ends, small pools that evict) with every group's reads checked
slot by slot and every admission's hit checked to be the deepest point every group serves."""

from __future__ import annotations

import random

import pytest
from group_sim import GroupSim
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixkv.cache.group import GroupSpec
from radixkv.cache.kinds import build_cache
from radixkv.cache.window import WindowSpec


@settings(max_examples=20, deadline=None)
@example(seed=714, block_size=1, windows=(3,))  # a prompt committed whole, then its end again
@given(
    seed=st.integers(0, 2**32 - 1),
    block_size=st.sampled_from([1, 4, 16]),
    windows=st.sampled_from([(3,), (8,), (21,), (3, 8), (8, 21)]),
)
def test_every_read_finds_its_kv_and_every_hit_is_the_deepest_shared(seed, block_size, windows):
    rng = random.Random(seed)
    B = block_size
    specs = [GroupSpec(), *(WindowSpec(w) for w in windows)]
    pools = [300 // B + 8, *(3 * (w // B + 2) + 40 // B for w in windows)]
    cache = build_cache(specs, pools, B, kv_events=rng.random() < 0.5)
    sim = GroupSim(cache)
    stems = [[rng.randrange(30) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    for _ in range(20):
        tokens = rng.choice(stems) + [rng.randrange(30) for _ in range(rng.randrange(1, 25))]
        if rng.random() < 0.5:
            stems.append(tokens)
        num_prompt = rng.randrange(1, len(tokens) + 1)
        sim.serve(rng, tokens, num_prompt, chunk=rng.choice([1, 5, 64]))
        stats = cache.stats()
        assert stats.num_in_use_blocks == 0 and stats.num_locked_tables == 0
        for group in cache.groups[1:]:
            assert group.pool.num_free + group.num_evictable_blocks() == group.num_blocks
        cache.take_events()
    assert cache.open_tables == frozenset()


def test_a_reset_empties_every_group_and_is_refused_while_a_table_holds_a_lock() -> None:
    cache = build_cache([GroupSpec(), WindowSpec(4)], [32, 16], 4)
    tokens = list(range(1, 23))
    table = cache.admit(tokens, max_hit=0)
    assert table is not None and cache.extend(table, len(tokens))
    cache.commit(table, tokens)
    assert not cache.reset(), "a request still reads its path"
    cache.close(table)
    assert cache.groups[1].num_tails == 1 and cache.match(tokens).num_cached_tokens == 22
    assert cache.reset()
    assert cache.groups[1].num_tails == 0 and cache.match(tokens).num_cached_tokens == 0
    cache.check_integrity()


def test_integrity_catches_a_table_one_group_forgot() -> None:
    cache = build_cache([GroupSpec(), WindowSpec(4)], [32, 16], 4)
    table = cache.admit(list(range(1, 10)), max_hit=8)
    assert table is not None
    cache.groups[1].close(table.tables[1])  # behind the grouped cache's back
    with pytest.raises(AssertionError, match="open tables"):
        cache.check_integrity()
