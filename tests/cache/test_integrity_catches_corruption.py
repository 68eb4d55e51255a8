"""`PrefixCache.check_integrity` catches each kind of broken state: a corruption of one field at a
time, made through the private state the check recomputes, must raise AssertionError."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from lifecycle import put

from radixkv import PrefixCache

B = 4


def busy_cache(kv_events: bool = False) -> PrefixCache:
    """Two paths that split inside a block, one of them locked by an open table that holds a
    private block, a second open table without a lock, and an evictable leaf."""
    cache = PrefixCache(num_blocks=32, block_size=B, kv_events=kv_events)
    first = list(range(100, 114))  # 14 tokens
    second = [*first[:6], *range(200, 209)]  # diverges at 6, inside block 1
    for tokens in (first, second):
        put(cache, tokens)
    locked = cache.admit([*first, 7], max_hit=len(first) - 1)  # hit 13: 3 tree blocks + 1 copy
    unlocked = cache.admit([1, 2], max_hit=None)  # one private block
    assert locked is not None and locked.copy is not None and unlocked is not None
    cache.check_integrity()
    return cache


def _leaf(cache: PrefixCache):  # an evictable leaf
    return next(iter(cache._tree.index))


def _split_child(cache: PrefixCache):
    return next(n for n, depth in cache._tree.iter_nodes() if depth == 2)


def _table(cache: PrefixCache, locked: bool = True):
    return next(t for t in cache._open if t.locked == locked)


def _swap_first_block(cache: PrefixCache, block: int) -> None:
    table = _table(cache)
    table.blocks = (block, *table.blocks[1:])


def _move_private_first(cache: PrefixCache) -> None:
    """The unlocked table's private block replaces the locked table's first (tree) block."""
    locked, unlocked = _table(cache), _table(cache, locked=False)
    locked.blocks = (unlocked.blocks[0], *locked.blocks[1:])
    unlocked.blocks = ()


CORRUPTIONS: dict[str, Callable[[PrefixCache], None]] = {
    "lock_ref": lambda c: setattr(_leaf(c), "lock_ref", 1),
    "num_nodes": lambda c: setattr(c._tree, "num_nodes", c._tree.num_nodes + 1),
    "num_cached_tokens": lambda c: setattr(
        c._tree, "num_cached_tokens", c._tree.num_cached_tokens + 1
    ),
    "num_evictable_blocks": lambda c: setattr(
        c._tree, "num_evictable_blocks", c._tree.num_evictable_blocks - 1
    ),
    "block out of range": lambda c: _leaf(c).blocks.__setitem__(-1, 999),
    "segment start": lambda c: setattr(_split_child(c), "start", _split_child(c).start + 1),
    "tick ahead of the clock": lambda c: setattr(_leaf(c), "tick", c._clock + 5),
    "leaf missing from the index": lambda c: c._tree.index.discard(_leaf(c)),
    "head_shared": lambda c: setattr(_split_child(c), "head_shared", False),
    "private block owned by the tree": lambda c: c._private.add(_leaf(c).blocks[0]),
    "pool ref count": lambda c: c._pool.add_owner(_leaf(c).blocks[0]),
    "table's tree block off its path": lambda c: _swap_first_block(c, _leaf(c).blocks[-1]),
    "table's namespace": lambda c: setattr(_table(c), "namespace", "elsewhere"),
    "private block in no open table": lambda c: c._open.remove(_table(c, locked=False)),
    "private block in two tables": lambda c: setattr(
        _table(c, locked=False), "blocks", _table(c).blocks[-1:]
    ),
    "tree block in a table without a lock": lambda c: setattr(
        _table(c, locked=False), "blocks", (_leaf(c).blocks[0], *_table(c, locked=False).blocks)
    ),
    "table locks another node": lambda c: setattr(_table(c), "node", _leaf(c)),
    "private block before a tree block": _move_private_first,
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_check_integrity_catches(corrupt: Callable[[PrefixCache], None]) -> None:
    cache = busy_cache()
    corrupt(cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()


EVENT_CORRUPTIONS: dict[str, Callable[[PrefixCache], None]] = {
    "a stale block hash": lambda c: _split_child(c).block_keys.__setitem__(0, 5),
    "a node left unhashed": lambda c: setattr(_split_child(c), "block_keys", None),
}


@pytest.mark.parametrize("corrupt", EVENT_CORRUPTIONS.values(), ids=EVENT_CORRUPTIONS.keys())
def test_check_integrity_catches_wrong_block_hashes(corrupt) -> None:
    cache = busy_cache(kv_events=True)
    corrupt(cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_cache_without_events_holds_no_hashes() -> None:
    cache = busy_cache()
    _split_child(cache).block_keys = []
    with pytest.raises(AssertionError, match="nothing is hashed"):
        cache.check_integrity()


def test_check_integrity_catches_stale_block_keys() -> None:
    """A node keeping the keys of blocks that no longer end in it (what a split that did not
    cut its list, or a trim that kept its tail, would leave)."""
    cache = busy_cache(kv_events=True)
    child = _split_child(cache)
    keys = cache._keys
    assert keys is not None and keys.node_keys(child)
    cache.check_integrity()  # kept keys that are right pass
    child.block_keys = [*keys.node_keys(child.parent), *keys.node_keys(child)]
    with pytest.raises(AssertionError, match="stale block keys"):
        cache.check_integrity()
