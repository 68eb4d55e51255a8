"""The cache's door (`match`, `admit`, the token ids `commit` reads, `evict`, the constructor):
caller mistakes raise TypeError/ValueError naming the problem, before anything changes. Inside
the contract, misuse of a table is an assert."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from radixkv import BlockTable, PrefixCache

CACHED = list(range(100, 120))  # 20 tokens, B = 4: blocks 0..4


@dataclass
class World:
    cache: Any  # CheckedCache
    table: BlockTable  # open, locking CACHED
    closed: BlockTable
    unlocked: BlockTable  # open, admitted without the cache


@pytest.fixture
def world(make_cache) -> World:
    cache = make_cache(16, 4)
    table = cache.admit(CACHED, max_hit=0)
    cache.commit(table, CACHED)  # blocks 0..4, locked by `table`
    closed = cache.admit(CACHED, max_hit=19)
    cache.close(closed)
    unlocked = cache.admit([1, 2], max_hit=None)
    return World(cache=cache, table=table, closed=closed, unlocked=unlocked)


def snapshot(cache: PrefixCache) -> tuple[Any, ...]:
    return (
        cache.stats(),
        list(cache.nodes()),
        [cache._pool.ref_count(b) for b in range(cache.num_blocks)],
        list(cache._pool._free),
        sorted(cache._private),
        sorted((t.blocks, t.node is None) for t in cache._open),
        cache._clock,
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
    # admit: the same checks, and the hit cap
    ("admit negative id", lambda w: w.cache.admit([5, -6], max_hit=1), ValueError, r"\[1\] = -6"),
    ("admit float id", lambda w: w.cache.admit([5, 6.0], max_hit=1), TypeError, r"\[1\] = 6.0"),
    ("admit set tokens", lambda w: w.cache.admit({5}, max_hit=0), TypeError, "got set"),
    ("admit str tokens", lambda w: w.cache.admit("ab", max_hit=None), TypeError, "sequence"),
    (
        "admit bad namespace",
        lambda w: w.cache.admit([1], max_hit=0, namespace=b"t"),
        TypeError,
        "namespace must be a str or None, got bytes",
    ),
    ("admit max_hit < 0", lambda w: w.cache.admit([1], max_hit=-1), ValueError, "max_hit"),
    ("admit max_hit str", lambda w: w.cache.admit([1], max_hit="1"), TypeError, "max_hit"),
    ("admit max_hit bool", lambda w: w.cache.admit([1], max_hit=True), TypeError, "got bool"),
    # commit reads token ids as the door does: a bad one changes nothing
    (
        "commit bad token",
        lambda w: w.cache.commit(w.table, [*CACHED, -6]),
        ValueError,
        r"tokens\[20\] = -6",
    ),
    ("commit set tokens", lambda w: w.cache.commit(w.table, {5}), TypeError, "got set"),
    # evict
    ("evict < 0", lambda w: w.cache.evict(-2), ValueError, "num_blocks must be >= 0"),
    ("evict None", lambda w: w.cache.evict(None), TypeError, "num_blocks must be an int"),
    ("evict float", lambda w: w.cache.evict(2.5), TypeError, "num_blocks must be an int"),
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
    assert world.cache.grow(world.table, 1)
    world.cache.commit(world.table, [*CACHED, 1, 2])
    assert world.cache.stats().num_inserted_tokens == 22
    world.cache.close(world.table)
    world.cache.close(world.unlocked)
    assert world.cache.stats().num_in_use_blocks == 0


MISUSES: list[tuple[str, Call]] = [
    ("close twice", lambda w: w.cache.inner.close(w.closed)),
    ("close another cache's table", lambda w: PrefixCache(16, 4).close(w.table)),
    ("commit an unlocked table", lambda w: w.cache.inner.commit(w.unlocked, [1, 2])),
    ("commit past the table", lambda w: w.cache.inner.commit(w.table, [*CACHED, 1])),
    ("grow a closed table", lambda w: w.cache.inner.grow(w.closed, 1)),
    ("grow by a negative count", lambda w: w.cache.inner.grow(w.table, -1)),
]


@pytest.mark.parametrize("call", [m[1] for m in MISUSES], ids=[m[0] for m in MISUSES])
def test_misusing_a_table_is_an_assert(world: World, call: Call) -> None:
    with pytest.raises(AssertionError):
        call(world)


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
