"""Matching, insertion, splits and block ownership of the prefix cache (exact block ids)."""

from __future__ import annotations

import numpy as np
import pytest
from lifecycle import put

from radixkv import NodeView

SYSTEM = list(range(1000, 1037))  # 37 tokens: two full 16-token blocks and 5 slots of a third


def refs(cache, *block_ids: int) -> list[int]:
    return [cache._pool.ref_count(b) for b in block_ids]


def shape(cache) -> list[tuple[int, int | None, int, int, tuple[int, ...]]]:
    """(node_id, parent_id, start, end, block_ids) of every node, depth-first."""
    return [(v.node_id, v.parent_id, v.start, v.end, v.block_ids) for v in cache.nodes()]


def test_empty_cache_matches_nothing_and_locks_the_root(make_cache) -> None:
    cache = make_cache()
    m = cache.match([1, 2, 3])
    assert (m.num_query_tokens, m.num_cached_tokens, m.block_ids, m.num_partial_slots) == (
        3,
        0,
        (),
        0,
    )
    table = cache.admit([1, 2, 3], max_hit=3)
    assert table.num_cached_tokens == 0 and table.locked and table.blocks == (0,)
    assert next(cache.nodes()).lock_ref == 1
    cache.close(table)
    assert next(cache.nodes()).lock_ref == 0
    assert cache.match([]).num_cached_tokens == 0


def test_37_shared_tokens_all_hit_with_16_token_blocks(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    first = serve(cache, [*SYSTEM, 1, 2, 3, 4], [7, 8])
    assert first.match.num_cached_tokens == 0
    assert first.block_ids == (0, 1, 2)

    m = cache.match([*SYSTEM, 5, 6, 7], max_tokens=39)
    assert m.num_cached_tokens == 37  # not 32: matching is token-granular
    assert m.block_ids == (0, 1, 2)
    assert m.last_block_partial and m.num_partial_slots == 5 and m.num_full_blocks == 2

    second = serve(cache, [*SYSTEM, 5, 6, 7])
    assert second.match.num_cached_tokens == 37
    assert second.table == (0, 1, 3)  # block 3 = the copy-on-write of block 2's 5 valid slots
    s = cache.stats()
    assert (s.num_queries, s.num_query_tokens, s.num_hit_tokens, s.num_computed_tokens) == (
        2,
        81,
        37,
        44,
    )
    assert s.hit_rate == pytest.approx(37 / 81)


def test_match_cap_and_prefill_cap(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    serve(cache, list(range(40)), [99])  # 41 tokens cached
    assert cache.match(list(range(40))).num_cached_tokens == 40
    assert cache.match(list(range(40)), max_tokens=39).num_cached_tokens == 39
    assert cache.match(list(range(40)), max_tokens=100).num_cached_tokens == 40
    m = cache.match(list(range(40)), max_tokens=0)
    assert (m.num_cached_tokens, m.block_ids) == (0, ())
    assert cache.match([*range(40), 99, 5]).num_cached_tokens == 41


def test_split_mid_block_co_owns_the_split_block(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    serve(cache, [*SYSTEM, 1, 2, 3, 4], [7, 8])  # node 1: [0,43) blocks 0,1,2
    serve(cache, [*SYSTEM, 5, 6, 7])  # diverges at 37, inside block 2
    assert shape(cache) == [
        (0, None, 0, 0, ()),
        (2, 0, 0, 37, (0, 1, 2)),  # new prefix node
        (1, 2, 37, 43, (2,)),  # the original node is the suffix; shares block 2
        (3, 2, 37, 40, (3,)),  # the new branch owns its own copy of index 2
    ]
    assert refs(cache, 0, 1, 2, 3) == [1, 1, 2, 1]
    # For a shared index the deepest node's block wins: each branch reads its own copy.
    assert cache.match([*SYSTEM, 5, 6, 7]).block_ids == (0, 1, 3)
    assert cache.match([*SYSTEM, 1, 2, 3, 4, 7, 8]).block_ids == (0, 1, 2)
    assert cache.match([*SYSTEM, 9]).block_ids == (0, 1, 2)


def test_split_at_block_boundary_shares_nothing(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    head = list(range(500, 532))  # exactly two blocks
    serve(cache, [*head, 1, 2, 3])
    second = serve(cache, [*head, 9, 9, 9])
    assert second.match.num_cached_tokens == 32 and not second.match.last_block_partial
    assert shape(cache) == [
        (0, None, 0, 0, ()),
        (2, 0, 0, 32, (0, 1)),
        (1, 2, 32, 35, (2,)),
        (3, 2, 32, 35, (3,)),
    ]
    assert refs(cache, 0, 1, 2, 3) == [1, 1, 1, 1]


def test_co_owned_block_is_freed_only_when_both_owners_are_gone(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    serve(cache, [*SYSTEM, 1, 2, 3, 4], [7, 8])
    serve(cache, [*SYSTEM, 5, 6, 7])
    # Eviction order (GDSF): the new branch [37,40) holds 3 tokens of its last block, the old
    # suffix [37,43) 6: the branch goes first and frees its own block 3; block 2 keeps 2 owners.
    assert cache.evict(1) == [3]
    assert refs(cache, 2) == [2]
    # The old suffix owns only the shared block 2: dropping it frees nothing; the prefix, now its
    # last owner and a leaf, is trimmed back to a block boundary.
    assert cache.evict(1) == [2]
    assert shape(cache) == [(0, None, 0, 0, ()), (2, 0, 0, 32, (0, 1))]
    assert cache.stats().num_evicted_tokens == 3 + 6 + 5


def test_concurrent_duplicates_are_freed_and_the_partial_tail_kept(make_cache) -> None:
    cache = make_cache(64, 16)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8 slots
    t1 = cache.admit(prompt, max_hit=39)
    t2 = cache.admit(prompt, max_hit=39)  # nothing cached yet: computes it all
    assert (t1.blocks, t2.blocks) == ((0, 1, 2), (3, 4, 5))
    cache.commit(t1, prompt)
    assert (cache.stats().num_inserted_tokens, t1.blocks, t1.private) == (40, (0, 1, 2), set())
    cache.commit(t2, prompt)
    s = cache.stats()
    assert s.num_inserted_tokens == 40  # nothing new
    assert s.num_duplicate_blocks_freed == 2  # blocks 3 and 4 duplicated full cached blocks
    assert t2.blocks == (0, 1, 5)  # the partial tail stays the caller's: it writes on there
    assert t2.private == {5}
    assert refs(cache, 3, 4) == [0, 0]
    assert s.num_locked_tables == 2
    cache.close(t1)
    cache.close(t2)
    assert cache.stats().num_in_use_blocks == 0


def test_full_duplicate_blocks_are_all_freed(make_cache) -> None:
    cache = make_cache(64, 16)
    prompt = list(range(100, 132))
    assert put(cache, prompt) == (0, 1)
    t2 = cache.admit(prompt, max_hit=0)
    cache.commit(t2, prompt)
    assert (t2.blocks, t2.private, cache.stats().num_duplicate_blocks_freed) == ((0, 1), set(), 2)
    cache.close(t2)
    assert cache.stats().num_free_blocks == 62


def test_writing_on_into_own_partial_tail_co_owns_it(make_cache) -> None:
    cache = make_cache(64, 16)
    tokens = list(range(200, 240))
    table = cache.admit(tokens, max_hit=0)  # blocks 0, 1, 2
    cache.commit(table, tokens[:25])  # leaf [0,25) owns blocks 0, 1
    assert table.private == {2}  # keeps writing into block 1 (slots 9..15), then 2
    cache.commit(table, tokens)
    assert table.blocks == (0, 1, 2) and table.private == set()
    assert shape(cache) == [(0, None, 0, 0, ()), (1, 0, 0, 25, (0, 1)), (2, 1, 25, 40, (1, 2))]
    assert refs(cache, 0, 1, 2) == [1, 2, 1]
    cache.close(table)
    assert cache.stats().num_evictable_blocks == 3
    assert cache.evict(1) == [2]  # the leaf is trimmed to its head; block 1 still has two owners
    assert cache.evict(1) == [1]  # leaf [25,32) dropped (block 1 -> 1 owner), then trimmed [16,25)


def test_own_earlier_tail_is_kept_when_another_request_extended_the_path(make_cache) -> None:
    cache = make_cache(64, 16)
    tokens = list(range(300, 340))
    r = cache.admit(tokens[:30], max_hit=0)  # request R: blocks 0, 1
    cache.commit(r, tokens[:25])  # leaf [0,25)
    s = cache.admit(tokens, max_hit=39)  # request S: same tokens, hits 25
    assert s.blocks == (0, 2, 3) and s.copy == (1, 2, 9)  # CoW of block 1 -> 2; 3 for [32,40)
    cache.commit(s, tokens)
    assert s.blocks == (0, 2, 3)
    # R wrote positions 25..29 into its own block 1; the tree's deepest copy of index 1 is S's 2.
    cache.commit(r, tokens[:30])
    stats = cache.stats()
    assert stats.num_inserted_tokens == 25 + 15  # R's second commit added nothing
    assert r.blocks == (0, 1)  # R keeps its own tail block, which it keeps writing into
    assert r.private == set() and stats.num_duplicate_blocks_freed == 0
    cache.close(r)
    cache.close(s)


def test_admit_refreshes_the_whole_path_and_locks_it(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    serve(cache, [*SYSTEM, 1, 2, 3, 4], [7, 8])
    serve(cache, [*SYSTEM, 5, 6, 7])
    table = cache.admit([*SYSTEM, 5, 6], max_hit=39)  # hits 39: the CoW copy of block 3 is new
    views = {v.node_id: v for v in cache.nodes()}
    assert [views[i].lock_ref for i in (0, 2, 1, 3)] == [1, 1, 0, 1]
    assert views[3].last_access == views[2].last_access == views[0].last_access == 5
    assert views[1].last_access == 3
    # blocks 0, 1, 2 (prefix) and 3 (locked branch), and the private copy
    assert cache.stats().num_in_use_blocks == 5
    assert cache.stats().num_evictable_blocks == 0  # the old suffix owns only the shared block 2
    cache.close(table)
    assert cache.stats().num_evictable_blocks == 4


def test_nodes_snapshot(make_cache, serve) -> None:
    cache = make_cache(64, 4)
    serve(cache, [5, 6, 7, 8, 9, 10])
    serve(cache, [5, 6, 7, 1, 2])
    views = list(cache.nodes())
    assert all(isinstance(v, NodeView) for v in views)
    assert views == [
        NodeView(0, None, 0, 0, 0, (), 0, 4, ()),
        NodeView(2, 0, 1, 0, 3, (0,), 0, 4, (5, 6, 7)),
        NodeView(3, 2, 2, 3, 5, (2, 3), 0, 4, (1, 2)),  # first token 1 < 8: listed first
        NodeView(1, 2, 2, 3, 6, (0, 1), 0, 3, (8, 9, 10)),  # shares block 0 with its parent
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 256])
def test_round_trip_for_every_block_size(make_cache, serve, block_size: int) -> None:
    cache = make_cache(num_blocks=4096 // block_size + 16, block_size=block_size)
    base = list(range(7, 7 + 300))
    a = serve(cache, base + [1] * 40, [2, 3])
    b = serve(cache, base + [4] * 10)
    c = serve(cache, base[:150] + [5] * 70, [6])
    assert a.match.num_cached_tokens == 0
    assert b.match.num_cached_tokens == 300
    assert c.match.num_cached_tokens == 150
    assert cache.match(base + [1] * 40 + [2, 3, 9]).num_cached_tokens == 342
    m = cache.match(base + [4] * 10 + [0])
    assert m.num_cached_tokens == 310
    assert len(m.block_ids) == -(-310 // block_size)
    assert m.num_partial_slots == 310 % block_size
    cached = cache.stats().num_cached_tokens
    assert cached == 342 + 10 + 71
    freed = cache.evict(cache.num_blocks)
    assert (
        len(freed)
        == len(set(freed))
        == cache.num_blocks - cache.stats().num_free_blocks + len(freed)
    )
    assert cache.stats().num_free_blocks == cache.num_blocks
    assert cache.stats().num_nodes == 0 and cache.stats().num_evicted_tokens == cached


def test_numpy_tokens_match_like_lists(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    serve(cache, list(range(1, 50)))
    for dtype in (np.int64, np.int32, np.uint16):
        m = cache.match(np.arange(1, 60, dtype=dtype))
        assert m.num_cached_tokens == 49 and m.block_ids == (0, 1, 2, 3)


@pytest.mark.parametrize("length", [1, 2, 5, 63, 64, 65, 200, 1500])
def test_first_mismatch_is_found_at_every_position_and_byte(length: int) -> None:
    from radixkv.cache.tokens import common_prefix_len, pack_tokens

    rng = np.random.default_rng(length)
    base = rng.integers(0, 2**32, length, dtype=np.uint64).tolist()
    positions = sorted({0, length - 1, length // 2, *rng.integers(0, length, 5).tolist()})
    for j in positions:
        for flip in (1, 1 << 8, 1 << 16, 1 << 31):  # a difference in each byte of the token
            other = list(base)
            other[j] ^= flip
            q = pack_tokens([7, 7, *other])  # the query run starts at token 2
            query_run = memoryview(q).cast("I")[2 : 2 + length]  # how the tree reads a node
            assert common_prefix_len(query_run, memoryview(pack_tokens(base)).cast("I")) == j


def test_long_prompts_match_token_exactly(make_cache) -> None:
    cache = make_cache(512, 16)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50_000, 3000).tolist()
    put(cache, base)  # 188 blocks
    for cut in (1, 15, 16, 17, 1000, 2047, 2999):
        query = [*base[:cut], base[cut] + 1, *base[cut + 1 :]]
        m = cache.match(query)
        assert m.num_cached_tokens == cut and len(m.block_ids) == -(-cut // 16)


@pytest.mark.parametrize("dtype", ["=i4", "=u4", "=i8", "=u8", ">i4", "=i2", "=u1"])
def test_token_arrays_pack_like_lists(dtype: str) -> None:
    from radixkv.cache.tokens import pack_tokens

    info = np.iinfo(np.dtype(dtype))
    top = min(int(info.max), 2**32 - 1)
    ids = [0, 1, 127, 128, 255, top // 2, top]
    tokens = np.array(ids, dtype=dtype)
    assert pack_tokens(tokens) == pack_tokens(ids)
    assert pack_tokens(tokens[::-2]) == pack_tokens(ids[::-2])  # a strided view


@pytest.mark.parametrize("dtype", ["=i4", ">i4", "=i8"])
@pytest.mark.parametrize("where", [0, 1, 2, 3, 4, 999])
def test_negative_token_in_an_array_is_named(dtype: str, where: int) -> None:
    from radixkv.cache.tokens import pack_tokens

    tokens = np.arange(1000, dtype=dtype)
    tokens[where] = -(2**31) if where % 2 else -1  # every sign-bit pattern, any position
    with pytest.raises(ValueError, match=rf"tokens\[{where}\] = -\d+ is not a token id"):
        pack_tokens(tokens)


# ------------------------------------------- superseded partial tails (chat continuation)


def test_continuation_supersedes_the_parents_partial_tail(make_cache, serve) -> None:
    """A turn that continues the previous one copies its partial tail; the parent then co-owns
    that copy and the old tail block, which no path could read any more, is freed."""
    cache = make_cache(64, 16)
    tokens = list(range(500, 550))
    assert serve(cache, tokens[:30]).block_ids == (0, 1)  # leaf [0,30): 14 slots of 1
    turn = serve(cache, tokens)
    assert turn.match.num_cached_tokens == 30 and turn.table == (0, 2, 3, 4)  # 2 = CoW of 1
    assert turn.block_ids == (0, 2, 3, 4)
    assert shape(cache) == [(0, None, 0, 0, ()), (1, 0, 0, 30, (0, 2)), (2, 1, 30, 50, (2, 3, 4))]
    assert refs(cache, 0, 1, 2, 3, 4) == [1, 0, 2, 1, 1]
    assert cache.stats().num_superseded_tails_freed == 1
    assert cache.stats().num_duplicate_blocks_freed == 0
    # A hit ending inside the parent's tail reads the copy's leading slots (same KV as block 1).
    assert cache.match(tokens[:28]).block_ids == (0, 2)
    assert cache.stats().num_evictable_blocks == 4 and cache.stats().num_free_blocks == 60
    assert cache.evict(1) == [4]
    assert cache.evict(3) == [3, 2, 0]  # leaf's rest (2 stays: the parent owns it), then parent


def test_tail_is_kept_when_the_parent_has_another_child(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    a = list(range(500, 540))
    serve(cache, a[:30])
    serve(cache, a)  # first continuation: the parent [0,30) takes its copy 2, block 1 is freed
    branch = serve(cache, [*a[:30], *range(900, 910)])  # a second child of [0,30)
    assert branch.match.num_cached_tokens == 30 and branch.table == (0, 1, 4)  # 1: CoW of 2
    assert shape(cache) == [
        (0, None, 0, 0, ()),
        (1, 0, 0, 30, (0, 2)),
        (2, 1, 30, 40, (2, 3)),
        (3, 1, 30, 40, (1, 4)),
    ]
    assert refs(cache, 1, 2) == [1, 2]  # the parent keeps 2 (its first child reads it)
    assert cache.stats().num_superseded_tails_freed == 1


def test_tail_is_kept_while_another_lock_reads_the_parent(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    tokens = list(range(500, 550))
    serve(cache, tokens[:30])
    reader = cache.admit(tokens[:16], max_hit=16)  # another request holds the parent's path
    turn = serve(cache, tokens)
    assert turn.table == (0, 2, 3, 4)
    assert shape(cache) == [(0, None, 0, 0, ()), (1, 0, 0, 30, (0, 1)), (2, 1, 30, 50, (2, 3, 4))]
    assert refs(cache, 1, 2) == [1, 1]
    assert cache.stats().num_superseded_tails_freed == 0
    cache.close(reader)


def test_tail_is_kept_when_an_ancestor_shares_it(make_cache, serve) -> None:
    cache = make_cache(64, 16)
    tokens = list(range(500, 550))
    table = cache.admit(tokens[:25], max_hit=0)  # blocks 0, 1
    cache.commit(table, tokens[:20])  # [0,20)
    cache.commit(table, tokens[:25])  # wrote on in block 1
    cache.close(table)
    assert shape(cache) == [(0, None, 0, 0, ()), (1, 0, 0, 20, (0, 1)), (2, 1, 20, 25, (1,))]
    turn = serve(cache, tokens)  # hits 25 = the end of [20,25), whose only block 1 [0,20) owns
    assert turn.table == (0, 2, 3, 4)
    assert refs(cache, 1, 2) == [2, 1]
    assert cache.stats().num_superseded_tails_freed == 0
