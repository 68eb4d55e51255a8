"""Caller mistakes raise TypeError/ValueError naming the problem, before anything changes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from radixkv import LockHandle, MatchResult, PrefixCache

CACHED = list(range(100, 120))  # 20 tokens, B = 4: blocks 0..4


@dataclass
class World:
    cache: Any  # CheckedCache
    other: PrefixCache
    handle: LockHandle  # live
    released: LockHandle
    foreign_handle: LockHandle
    private: list[int]
    tree_block: int
    free_block: int
    stale: MatchResult
    foreign_match: MatchResult


@pytest.fixture
def world(make_cache) -> World:
    cache = make_cache(16, 4)
    stale = cache.match(CACHED)
    r = cache.insert(CACHED, cache.allocate(5))  # blocks 0..4, locked by r.handle
    released = cache.acquire(cache.match(CACHED))
    cache.release(released)
    private = cache.allocate(2)  # 5, 6
    other = PrefixCache(16, 4)
    foreign_handle = other.acquire(other.match([1]))
    return World(
        cache=cache,
        other=other,
        handle=r.handle,
        released=released,
        foreign_handle=foreign_handle,
        private=private,
        tree_block=2,
        free_block=9,
        stale=stale,
        foreign_match=other.match([1]),
    )


def snapshot(cache: PrefixCache) -> tuple[Any, ...]:
    return (
        cache.stats(),
        list(cache.nodes()),
        [cache._pool.ref_count(b) for b in range(cache.num_blocks)],
        list(cache._pool._free),
        sorted(cache._private),
        sorted(cache._live),
        cache._clock,
        cache.version,
    )


Call = Callable[[World], object]
CASES: list[tuple[str, Call, type[Exception], str]] = [
    # match: token ids must be ints in [0, 2**32)
    ("match negative id", lambda w: w.cache.match([1, -1]), ValueError, r"tokens\[1\] = -1"),
    ("match huge id", lambda w: w.cache.match([2**32]), ValueError, r"tokens\[0\] = 4294967296"),
    ("match float id", lambda w: w.cache.match([1, 2.5]), TypeError, r"tokens\[1\] = 2.5 is not"),
    ("match str id", lambda w: w.cache.match([1, "a"]), TypeError, r"tokens\[1\] = 'a' is not"),
    ("match None id", lambda w: w.cache.match([None]), TypeError, r"tokens\[0\] = None"),
    ("match after a bool", lambda w: w.cache.match([True, 3, -3]), ValueError, r"\[2\] = -3"),
    ("match str tokens", lambda w: w.cache.match("abc"), TypeError, "sequence of ints"),
    ("match int tokens", lambda w: w.cache.match(5), TypeError, "sequence of ints"),
    ("match 2-D array", lambda w: w.cache.match(np.zeros((2, 2), int)), ValueError, "1-D"),
    ("match float array", lambda w: w.cache.match(np.ones(3)), TypeError, "dtype float64"),
    ("match negative array", lambda w: w.cache.match(np.array([3, -2])), ValueError, r"\[1\]"),
    # sets and dicts have no defined order (F10)
    ("match set tokens", lambda w: w.cache.match({1, 2}), TypeError, "got set"),
    ("match dict tokens", lambda w: w.cache.match({1: 2}), TypeError, "got dict"),
    ("match frozenset", lambda w: w.cache.match(frozenset([1])), TypeError, "got frozenset"),
    ("match bad namespace", lambda w: w.cache.match([1], namespace=3), TypeError, "namespace"),
    ("match max_tokens < 0", lambda w: w.cache.match([1], max_tokens=-1), ValueError, ">= 0"),
    ("match max_tokens float", lambda w: w.cache.match([1], max_tokens=1.5), TypeError, "int"),
    # acquire
    ("acquire non-match", lambda w: w.cache.acquire("m"), TypeError, "MatchResult"),
    ("acquire stale", lambda w: w.cache.acquire(w.stale), ValueError, "stale match"),
    ("acquire foreign", lambda w: w.cache.acquire(w.foreign_match), ValueError, "this cache"),
    ("acquire forged", lambda w: w.cache.acquire(MatchResult(1, 0, (), 0)), ValueError, "this"),
    (
        "acquire replaced fields",  # F9: a forged copy of a real match
        lambda w: w.cache.acquire(
            dataclasses.replace(w.cache.match(CACHED), num_cached_tokens=5, block_ids=(0, 1))
        ),
        ValueError,
        "edited",
    ),
    (
        "acquire replaced namespace",
        lambda w: w.cache.acquire(dataclasses.replace(w.cache.match(CACHED), namespace="t")),
        ValueError,
        "edited",
    ),
    # release
    ("release twice", lambda w: w.cache.release(w.released), ValueError, "not a live handle"),
    ("release foreign", lambda w: w.cache.release(w.foreign_handle), ValueError, "another cache"),
    ("release forged", lambda w: w.cache.release(LockHandle(1, 20)), ValueError, "not a live"),
    ("release None", lambda w: w.cache.release(None), TypeError, "LockHandle"),
    # allocate / evict / can_allocate sizes
    ("allocate < 0", lambda w: w.cache.allocate(-1), ValueError, "num_blocks must be >= 0"),
    ("allocate float", lambda w: w.cache.allocate(2.5), TypeError, "num_blocks must be an int"),
    ("allocate str", lambda w: w.cache.allocate("3"), TypeError, "num_blocks must be an int"),
    ("allocate bool", lambda w: w.cache.allocate(True), TypeError, "got bool"),
    ("evict < 0", lambda w: w.cache.evict(-2), ValueError, "num_blocks must be >= 0"),
    ("evict None", lambda w: w.cache.evict(None), TypeError, "num_blocks must be an int"),
    ("can_allocate < 0", lambda w: w.cache.can_allocate(-1), ValueError, ">= 0"),
    (
        "can_allocate reserve non-match",
        lambda w: w.cache.can_allocate(1, reserve="m"),
        TypeError,
        "match must be a MatchResult",
    ),
    (
        "can_allocate reserve stale",
        lambda w: w.cache.can_allocate(1, reserve=w.stale),
        ValueError,
        "stale match",
    ),
    (
        "can_allocate reserve foreign",
        lambda w: w.cache.can_allocate(1, reserve=w.foreign_match),
        ValueError,
        "this cache",
    ),
    (
        "can_allocate reserve forged",
        lambda w: w.cache.can_allocate(1, reserve=MatchResult(1, 0, (), 0)),
        ValueError,
        "this cache",
    ),
    # free: only private blocks, each once
    ("free tree block", lambda w: w.cache.free([w.tree_block]), ValueError, "not held privately"),
    ("free free block", lambda w: w.cache.free([w.free_block]), ValueError, "not held privately"),
    ("free mixed", lambda w: w.cache.free([w.private[0], 2]), ValueError, r"\[2\] are not held"),
    ("free out of range", lambda w: w.cache.free([16]), ValueError, r"\[0\] = 16 is out of range"),
    ("free negative", lambda w: w.cache.free([-1]), ValueError, "out of range"),
    ("free repeated", lambda w: w.cache.free([w.private[0]] * 2), ValueError, "repeated"),
    ("free float id", lambda w: w.cache.free([w.private[0], 1.5]), TypeError, r"\[1\] = 1.5"),
    ("free non-sequence", lambda w: w.cache.free(3), TypeError, "sequence of ints"),
    ("free set", lambda w: w.cache.free(set(w.private)), TypeError, "got set"),
    # insert
    (
        "insert too few ids",
        lambda w: w.cache.insert([*CACHED, 1], [0, 1, 2, 3, 4]),
        ValueError,
        r"has 5 entries; 21 tokens with block_size 4 need exactly ceil\(21/4\) = 6",
    ),
    (
        "insert too many ids",
        lambda w: w.cache.insert([1, 2], w.private),
        ValueError,
        "need exactly",
    ),
    (
        "insert id out of range",
        lambda w: w.cache.insert([*CACHED, 1], [0, 1, 2, 3, 4, 99]),
        ValueError,
        r"block_ids\[5\] = 99 is out of range \[0, 16\)",
    ),
    (
        "insert free block for new tokens",
        lambda w: w.cache.insert([*CACHED, 1], [0, 1, 2, 3, 4, w.free_block]),
        ValueError,
        r"block_ids\[5\] = 9 is not held privately",
    ),
    (
        "insert tree block at a new index",
        lambda w: w.cache.insert([*CACHED, 1], [0, 1, 2, 3, 4, 1]),
        ValueError,
        r"block_ids\[5\] = 1 is not held privately",
    ),
    (
        "insert tree block at the wrong covered index",
        lambda w: w.cache.insert(CACHED[:8], [1, 0]),
        ValueError,
        r"block_ids\[0\] = 1 is neither the cached block 0",
    ),
    (
        "insert foreign block at a covered index",
        lambda w: w.cache.insert([*CACHED, 7, 7], [0, w.free_block, 2, 3, 4, w.private[0]]),
        ValueError,
        r"block_ids\[1\] = 9 is neither the cached block 1",
    ),
    (
        "insert repeated private id among covered and new indices",
        lambda w: w.cache.insert([*CACHED[:4], 9, 9, 9, 9], [w.private[0], w.private[0]]),
        ValueError,
        "repeated",
    ),
    (
        "insert repeated private id",
        lambda w: w.cache.insert([5, 6, 7, 8, 9], [w.private[0]] * 2),
        ValueError,
        "repeated",
    ),
    (
        "insert bad token",
        lambda w: w.cache.insert([5, -6], [w.private[0]]),
        ValueError,
        r"tokens\[1\] = -6",
    ),
    (
        "insert non-int block id",
        lambda w: w.cache.insert([5, 6], ["x"]),
        TypeError,
        r"block_ids\[0\] = 'x' is not an int",
    ),
    ("insert set tokens", lambda w: w.cache.insert({5}, [w.private[0]]), TypeError, "got set"),
    ("insert dict ids", lambda w: w.cache.insert([5], {w.private[0]: 0}), TypeError, "got dict"),
    (
        "insert released handle",
        lambda w: w.cache.insert([5, 6], [w.private[0]], handle=w.released),
        ValueError,
        "not a live handle",
    ),
    (
        "insert foreign handle",
        lambda w: w.cache.insert([5, 6], [w.private[0]], handle=w.foreign_handle),
        ValueError,
        "not a live handle",
    ),
]


@pytest.mark.parametrize(("call", "exc", "msg"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_call_changes_nothing(world: World, call: Call, exc: type, msg: str) -> None:
    before = snapshot(world.cache.inner)
    with pytest.raises(exc, match=msg):
        call(world)
    world.cache.check_integrity()
    assert snapshot(world.cache.inner) == before


def test_valid_calls_still_work_after_rejections(world: World) -> None:
    for _, call, exc, _msg in CASES:
        with pytest.raises(exc):
            call(world)
    r = world.cache.insert([*CACHED, 1, 2], [0, 1, 2, 3, 4, world.private[0]], handle=world.handle)
    assert r.num_new_tokens == 2
    world.cache.release(r.handle)
    world.cache.free([world.private[1]])


@pytest.mark.parametrize(
    ("args", "exc", "msg"),
    [
        ((0, 16), ValueError, "num_blocks must be >= 1"),
        ((16, 0), ValueError, "block_size must be >= 1"),
        ((16, -4), ValueError, "block_size must be >= 1"),
        (("8", 16), TypeError, "num_blocks must be an int"),
        ((8, 2.0), TypeError, "block_size must be an int"),
    ],
)
def test_bad_cache_sizes(args: tuple[Any, Any], exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        PrefixCache(*args)
