"""PackedTokens: validated once, read as is by every cache call, a well-behaved Sequence[int]."""

from __future__ import annotations

import numpy as np
import pytest

from radixkv import PackedTokens
from radixkv.cache.tokens import pack_tokens

IDS = [5, 0, 2**32 - 1, 300, 7]


@pytest.mark.parametrize(
    "source",
    [IDS, tuple(IDS), np.array(IDS, dtype=np.uint32), np.array(IDS, dtype=np.int64), range(3)],
    ids=["list", "tuple", "uint32", "int64", "range"],
)
def test_packs_like_pack_tokens(source) -> None:
    packed = PackedTokens(source)
    assert packed.tobytes() == pack_tokens(source)
    assert packed.tolist() == list(source) == list(packed)
    assert pack_tokens(packed) is packed.tobytes()  # read as is: no validation, no copy


def test_sequence_behaviour() -> None:
    p = PackedTokens(IDS)
    assert len(p) == 5 and p[0] == 5 and p[-1] == 7 and p[2] == 2**32 - 1
    assert p[1:3] == PackedTokens(IDS[1:3]) and isinstance(p[1:3], PackedTokens)
    assert p[::-2] == PackedTokens(IDS[::-2]) and p[4:1] == PackedTokens([])
    assert 300 in p and p.index(300) == 3 and p.count(7) == 1
    assert p + [1, 2] == PackedTokens([*IDS, 1, 2]) == [*IDS[:2]] + PackedTokens(IDS[2:]) + [1, 2]
    assert p + PackedTokens([1]) == PackedTokens([*IDS, 1])
    assert hash(p) == hash(PackedTokens(tuple(IDS))) and p != IDS  # like a tuple, not a list
    assert repr(PackedTokens(range(10))) == "PackedTokens([0, 1, 2, 3, 4, 5, 6, 7, ...], len=10)"
    assert not PackedTokens() and len(PackedTokens()) == 0 and list(PackedTokens()) == []
    with pytest.raises(IndexError, match="out of range"):
        p[5]


@pytest.mark.parametrize(
    ("make", "exc", "msg"),
    [
        (lambda: PackedTokens([1, -1]), ValueError, r"tokens\[1\] = -1 is not a token id"),
        (lambda: PackedTokens([2**32]), ValueError, r"tokens\[0\] = 4294967296"),
        (lambda: PackedTokens([1, 2.0]), TypeError, r"tokens\[1\] = 2.0 is not an int"),
        (lambda: PackedTokens("ab"), TypeError, "sequence of ints"),
        (lambda: PackedTokens(np.array([3, -3], dtype=np.int32)), ValueError, r"tokens\[1\]"),
        (lambda: PackedTokens([1]) + [None], TypeError, r"other\[0\] = None"),
        (lambda: [-1] + PackedTokens([1]), ValueError, r"other\[0\] = -1"),
    ],
)
def test_bad_ids_are_named(make, exc: type, msg: str) -> None:
    with pytest.raises(exc, match=msg):
        make()


def _lifecycle(cache, prompt, written) -> tuple:
    """match (prefill cap), admit, grow, commit, close; what came out."""
    m = cache.match(prompt, max_tokens=len(prompt) - 1)
    table = cache.admit(prompt, max_hit=len(prompt) - 1)
    cache.grow(table, -(-len(written) // cache.block_size) - len(table.blocks))
    cache.commit(table, written)
    blocks = table.blocks
    cache.close(table)
    return m, blocks, cache.stats()


def test_cache_calls_take_packed_tokens(make_cache) -> None:
    """Same results with lists and with PackedTokens (the prompt is a PackedTokens, written =
    prompt + reply)."""
    results = []
    for wrap in (list, PackedTokens):
        cache = make_cache(64, 4)
        prompt = wrap(range(100, 130))
        first = _lifecycle(cache, prompt, prompt + [1, 2, 3])
        prompt2 = prompt + [1, 2, 9, 9]
        second = _lifecycle(cache, prompt2, prompt2 + [4])
        results.append((first, second, cache.match(prompt + [1, 2, 3])))
    assert results[0] == results[1]
    (_, (m, _, stats), _) = results[1]
    assert m.num_cached_tokens == 32 and stats.num_inserted_tokens == 33 + 3


def test_sets_and_dicts_are_rejected_their_order_is_undefined() -> None:
    for bad in ({1, 2}, {1: 2}, frozenset([3])):
        with pytest.raises(TypeError, match="sequence of ints"):
            PackedTokens(bad)
        with pytest.raises(TypeError, match="sequence of ints"):
            PackedTokens([1]) + bad
