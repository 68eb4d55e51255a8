"""The cache-issued BlockTable: one object per request holds its blocks, its private ones and
its lock (admit / grow / commit / close)."""

from __future__ import annotations

import pytest

from radixkv import PackedTokens, PrefixCache

PROMPT = PackedTokens(range(1, 12))  # 11 tokens, B = 4: 3 blocks


def test_admit_copies_a_partial_hit_and_close_returns_everything(make_cache) -> None:
    cache = make_cache(16, 4)
    first = cache.admit(PROMPT, max_hit=len(PROMPT) - 1)
    assert first is not None and first.num_cached_tokens == 0 and first.copy is None
    assert len(first.blocks) == 3 and first.private == set(first.blocks)
    cache.commit(first, PROMPT)
    assert first.private == set()  # the tree adopted every block
    cache.close(first)
    assert first.blocks == () and not first.locked
    s = cache.stats()
    assert s.num_in_use_blocks == 0 and s.num_locked_tables == 0 and s.num_private_blocks == 0

    second = cache.admit(PROMPT + [50, 51], max_hit=12)
    assert second is not None and second.num_cached_tokens == 11
    src, dst, slots = second.copy
    assert slots == 3 and src == cache.match(PROMPT).block_ids[-1] and second.blocks[2] == dst
    assert second.private == {dst, second.blocks[3]} and len(second.blocks) == 4
    assert cache.grow(second, 2) and len(second.blocks) == 6 and len(second.private) == 4
    assert not cache.grow(second, 100) and len(second.blocks) == 6  # nothing changed
    cache.close(second)
    assert cache.stats().num_in_use_blocks == 0


def test_admit_without_the_cache_locks_nothing(make_cache) -> None:
    cache = make_cache(4, 4)
    table = cache.admit(PROMPT, max_hit=None)
    assert table is not None and not table.locked and table.private == set(table.blocks)
    assert cache.admit(PROMPT, max_hit=None) is None  # 1 block left: nothing changed
    assert cache.stats().num_queries == 0
    cache.close(table)
    assert cache.stats().num_free_blocks == 4


def test_a_fault_while_admitting_leaves_no_lock(monkeypatch) -> None:
    cache = PrefixCache(16, 4)  # not the checking proxy: admit must call the patched _allocate
    first = cache.admit(PROMPT, max_hit=10)
    cache.commit(first, PROMPT)
    cache.close(first)

    def interrupted(num_blocks: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "_allocate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.admit(PROMPT + [50], max_hit=11)  # locks its hit, then allocation is interrupted
    s = cache.stats()
    assert s.num_locked_tables == 0 and s.num_in_use_blocks == 0 and s.num_private_blocks == 0
    cache.check_integrity()
