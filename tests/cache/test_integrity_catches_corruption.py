"""`PrefixCache.check_integrity` catches each kind of broken state: a corruption of one field at a
time, made through the private state the check recomputes, must raise AssertionError."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from radixkv import PrefixCache

B = 4


def busy_cache() -> tuple[PrefixCache, object]:
    """Two paths that split inside a block, one of them locked, one private block, and an
    evictable leaf."""
    cache = PrefixCache(num_blocks=32, block_size=B)
    first = list(range(100, 114))  # 14 tokens
    second = [*first[:6], *range(200, 209)]  # diverges at 6, inside block 1
    for tokens in (first, second):
        r = cache.insert(tokens, cache.allocate(-(-len(tokens) // B)))
        cache.release(r.handle)
        cache.free(r.owned_block_ids)
    h = cache.acquire(cache.match(first, max_tokens=len(first) - 1))
    cache.allocate(1)  # stays private
    cache.check_integrity()
    return cache, h


def _leaf(cache: PrefixCache):  # an evictable leaf
    return next(iter(cache._tree.index))


def _split_child(cache: PrefixCache):
    return next(n for n, depth in cache._tree.iter_nodes() if depth == 2)


def _live_lock(cache: PrefixCache):
    return next(iter(cache._live.items()))


def _replace_lock(cache: PrefixCache, **changes: object) -> None:
    hid, lock = _live_lock(cache)
    cache._live[hid] = dataclasses.replace(lock, **changes)


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
    "lock's blocks": lambda c: _replace_lock(c, block_ids=(31,)),
    "lock's tokens past its prefix": lambda c: _replace_lock(c, num_tokens=40),
    "lock's namespace": lambda c: _replace_lock(c, namespace="elsewhere"),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_check_integrity_catches(corrupt: Callable[[PrefixCache], None]) -> None:
    cache, _handle = busy_cache()  # kept: a dropped live handle is reported as a leak
    corrupt(cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()
