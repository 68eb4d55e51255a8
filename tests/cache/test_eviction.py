"""Eviction: exact order (GDSF over tail tokens and recency, logical clock), locks, parents,
trimming, ties, shortfalls."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lifecycle import put

from radixkv.cache import PrefixCache
from radixkv.cache.eviction import EvictionIndex, gdsf_key, gdsf_priority
from radixkv.cache.tree import TreeNode


def touch(cache, tokens: list[int]) -> None:
    """A request that uses the cached prefix of `tokens` and finishes: refreshes its recency.
    (Its hit ends on a block boundary in these tests: it needs no copy-on-write block.)"""
    hit = cache.match(tokens).num_cached_tokens
    assert hit % cache.block_size == 0
    cache.close(cache.admit(tokens[:hit], max_hit=hit))


A = [10, 11, 12, 13, 14, 15, 16, 17]
B = [20, 21, 22, 23, 24, 25, 26, 27]
C = [30, 31, 32, 33, 34, 35, 36, 37]


def test_least_recently_used_first_tail_blocks_first(make_cache) -> None:
    cache = make_cache(16, 4)
    assert [put(cache, s) for s in (A, B, C)] == [(0, 1), (2, 3), (4, 5)]
    touch(cache, A)  # A is now the most recent
    assert cache.evict(2) == [3, 2]  # B, tail block first
    assert cache.evict(3) == [5, 4, 1]  # C whole, then A trimmed to its head block
    assert cache.match(A).num_cached_tokens == 4
    assert cache.match(B).num_cached_tokens == 0
    s = cache.stats()
    assert (s.num_evicted_blocks, s.num_evicted_tokens) == (5, 20)


def test_same_operations_give_the_same_evictions(make_cache) -> None:
    def run() -> list[int]:
        cache = make_cache(16, 4)
        for s in (A, B, C, [*A[:6], 99, 98], B[:3]):
            put(cache, s)
        touch(cache, C)
        return cache.evict(16)

    first = run()
    assert first == run()
    assert first == [7, 1, 0, 3, 2, 5, 4]


def test_locked_paths_are_never_evicted(make_cache) -> None:
    cache = make_cache(16, 4)
    for s in (A, B, C):
        put(cache, s)
    table = cache.admit(A, max_hit=8)
    assert cache.evict(100) == [3, 2, 5, 4]  # everything but A; fewer than asked
    assert cache.evict(1) == []
    assert cache.match(A).num_cached_tokens == 8
    assert (cache.stats().num_evictable_blocks, cache.stats().num_in_use_blocks) == (0, 2)
    cache.close(table)
    assert cache.stats().num_evictable_blocks == 2
    assert cache.evict(5) == [1, 0]
    assert cache.stats().num_free_blocks == 16 and cache.stats().num_nodes == 0


def test_a_lock_on_a_prefix_keeps_it_after_its_children_go(make_cache) -> None:
    cache = make_cache(16, 4)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [1, 2, 3, 4, 9, 9, 9, 9])  # splits at 4: prefix [0,4) with two children
    table = cache.admit([1, 2, 3, 4], max_hit=4)  # locks the prefix node only
    assert cache.evict(10) == [1, 3]  # both children go, the locked prefix stays
    assert cache.stats().num_nodes == 1
    cache.close(table)  # now an unlocked leaf: it joins the evictable set
    assert cache.evict(10) == [0]


@pytest.mark.parametrize(
    ("touch_prefix", "expected"),
    [
        (False, [1, 3, 0, 2]),  # the parent enters with its own (older) tick: before Q
        (True, [1, 3, 2, 0]),  # refreshed by a request that used only the prefix: after Q
    ],
)
def test_parent_joins_when_its_last_child_is_gone(make_cache, touch_prefix, expected) -> None:
    cache = make_cache(16, 4)
    P = [1, 2, 3, 4]
    assert put(cache, [*P, 5, 6, 7, 8]) == (0, 1)  # committed at tick 2
    assert put(cache, [*P, 9, 9, 9, 9]) == (0, 3)  # tick 4: block 2 duplicated block 0, freed
    assert put(cache, [50, 51, 52, 53]) == (2,)  # Q, tick 6 (reuses the freed block 2)
    if touch_prefix:
        touch(cache, [*P, 0])  # tick 7 on the prefix node only
    freed = [cache.evict(1) for _ in range(4)]
    assert freed == [[b] for b in expected]


def test_parent_is_not_evictable_while_it_has_a_child(make_cache) -> None:
    cache = make_cache(16, 4)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [1, 2, 3, 4, 9, 9, 9, 9])
    put(cache, [60, 61, 62, 63])  # newest leaf
    assert cache.evict(1) == [1]  # oldest child
    # the prefix (tick 4) is older than [60..63] (tick 6) but still has a child: the child goes next
    assert cache.evict(1) == [3]
    assert cache.evict(1) == [0]
    assert cache.evict(1) == [2]


def test_trimming_keeps_the_head_of_a_leaf(make_cache) -> None:
    cache = make_cache(16, 4)
    tokens = list(range(100, 114))  # 14 tokens: blocks 0..3, the last one partial
    assert put(cache, tokens) == (0, 1, 2, 3)
    assert cache.evict(1) == [3]
    m = cache.match(tokens)
    assert (m.num_cached_tokens, m.block_ids) == (12, (0, 1, 2))  # back to a block boundary
    assert cache.evict(2) == [2, 1]
    assert cache.match(tokens).num_cached_tokens == 4
    assert cache.stats().num_evicted_tokens == 10


def test_trimming_a_leaf_that_starts_mid_block(make_cache) -> None:
    cache = make_cache(16, 4)
    put(cache, [1, 2, 3, 4, 5, 6, 7])  # [0,7) blocks 0, 1
    put(cache, [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])  # splits at 6
    views = [(v.start, v.end, v.block_ids) for v in cache.nodes()]
    assert views == [(0, 0, ()), (0, 6, (0, 1)), (6, 7, (1,)), (6, 20, (3, 4, 5, 6))]
    # The LRU leaf [6,7) owns only the shared block 1: dropped whole, freeing nothing; eviction
    # goes on to the next leaf, [6,20), trimmed by one block to [6,16).
    assert cache.evict(1) == [6]
    views = [(v.start, v.end, v.block_ids) for v in cache.nodes()]
    assert views == [(0, 0, ()), (0, 6, (0, 1)), (6, 16, (3, 4, 5))]
    assert cache.evict(1) == [5]  # [6,12): its head block (index 1, mid-block start) stays
    m = cache.match([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9])
    assert (m.num_cached_tokens, m.block_ids) == (12, (0, 3, 4))


def test_ties_are_broken_by_node_id() -> None:
    index = EvictionIndex()
    nodes = [
        TreeNode(node_id=i, parent=None, start=0, end=1, tokens=b"", blocks=[]) for i in (7, 3, 5)
    ]
    for n in nodes:
        n.tick = 4
        index.add(n)
    older = TreeNode(node_id=9, parent=None, start=0, end=1, tokens=b"", blocks=[], tick=2)
    index.add(older)
    assert [n.node_id for n in index] == [9, 3, 5, 7]
    assert index.first() is older
    index.discard(older)
    assert index.first().node_id == 3 and older.evict_key is None


def fresh(num_blocks: int) -> list[int]:
    """Tokens cached nowhere that fill `num_blocks` blocks of 4."""
    return list(range(1000, 1000 + 4 * num_blocks))


def test_allocation_evicts_on_demand_and_only_what_it_needs(make_cache) -> None:
    cache = make_cache(8, 4)
    put(cache, A)  # blocks 0, 1
    put(cache, B)  # blocks 2, 3
    assert cache.stats().num_free_blocks == 4
    got = cache.admit(fresh(5), max_hit=None)  # one short: A (LRU) is trimmed by one block
    assert got.blocks == (1, 4, 5, 6, 7)
    assert cache.match(A).num_cached_tokens == 4
    before = (cache.stats(), list(cache.nodes()))
    assert cache.admit(fresh(4), max_hit=None) is None  # 0 free + 3 evictable < 4: no change
    assert not cache.grow(got, 4)
    assert (cache.stats(), list(cache.nodes())) == before
    assert cache.grow(got, 3)
    assert got.blocks[5:] == (2, 3, 0)  # evicted A [0], then B [3, 2]
    assert cache.stats().num_nodes == 0
    cache.close(got)
    assert cache.stats().num_free_blocks == 8


def test_admission_counts_what_locking_the_hit_pins(make_cache) -> None:
    cache = make_cache(8, 4)
    put(cache, A)  # blocks 0, 1
    put(cache, B)  # blocks 2, 3
    hit = A[:6]  # ends inside A's node: locking it pins both of A's blocks
    before = (cache.stats(), list(cache.nodes()), cache._clock)
    # 4 free + 4 evictable - 2 pinned = 6 blocks; the hit's partial block needs a copy.
    assert cache.admit([*hit, *fresh(6)[:23]], max_hit=6) is None  # 29 tokens: 8 - 1 hit + 1
    assert (cache.stats(), list(cache.nodes()), cache._clock) == before  # read-only
    table = cache.admit([*hit, *fresh(5)[:19]], max_hit=6)  # 25 tokens: 7 - 1 hit + 1 copy
    assert table is not None and table.num_cached_tokens == 6 and len(table.blocks) == 7
    assert cache.match(A).num_cached_tokens == 8  # B was evicted, not A
    # Already locked: the path pins nothing more.
    assert cache.stats().num_free_blocks + cache.stats().num_evictable_blocks == 0
    cache.close(table)
    # A miss pins nothing: 6 free + 2 evictable.
    assert cache.admit(fresh(9), max_hit=8) is None
    both = cache.admit(fresh(8), max_hit=8)
    assert both is not None and both.num_cached_tokens == 0
    cache.close(both)


def test_evict_zero_and_empty_cache(make_cache) -> None:
    cache = make_cache(8, 4)
    assert cache.evict(0) == []
    assert cache.evict(3) == []
    put(cache, A)
    assert cache.evict(0) == []
    assert cache.stats().num_evictable_blocks == 2


def test_gdsf_order_fewest_tokens_per_block_first_and_everything_ages(make_cache) -> None:
    """Priority = inflation at last use + tokens in the leaf's last block; the inflation rises to
    every victim's priority. Pool blocks are handed out in order, so ids name the leaves."""
    cache = make_cache(16, 4)
    p, q, r = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23]
    assert [put(cache, s) for s in (p, q, r)] == [(0, 1), (2, 3), (4,)]
    # Priorities (inflation 0): p 2 (2 tokens in its last block), q 4, r 3.
    assert cache.evict(1) == [1]  # p's partial tail: 2 tokens for a block; inflation -> 2
    assert cache.match(p).num_cached_tokens == 4  # p re-keyed: 0 + 4
    assert cache.evict(1) == [4]  # r (3) before the older full blocks of p and q (4)
    assert cache.evict(1) == [0]  # p and q tie at 4: the older (p) first; inflation -> 4
    s = [31, 32, 33, 34, 35]
    put(cache, s)  # used now: 4 + 1 = 5, above q's 4 although its tail holds one token
    assert cache.evict(2) == [3, 2]  # q, tail block first
    assert cache.match(s).num_cached_tokens == 5
    cache.evict(1)
    assert cache.match(s).num_cached_tokens == 4
    stats = cache.stats()
    assert (stats.num_evicted_blocks, stats.num_evicted_tokens) == (6, 2 + 3 + 4 + 8 + 1)


def test_gdsf_key_ties_on_tick_then_node_id() -> None:
    key = gdsf_key(4)
    nodes = [
        TreeNode(node_id=i, parent=None, start=0, end=end, tokens=b"", blocks=[], tick=tick)
        for i, end, tick in ((7, 8, 5), (3, 8, 5), (5, 7, 1), (9, 8, 1))
    ]
    assert [gdsf_priority(n, 4) for n in nodes] == [4, 4, 3, 4]
    index = EvictionIndex(key)
    for n in nodes:
        index.add(n)
    assert [n.node_id for n in index] == [5, 9, 3, 7]
    nodes[0].gdsf_base = 1  # a later use: it is re-added with the inflation of that moment
    index.discard(nodes[0])
    index.add(nodes[0])
    assert [n.node_id for n in index] == [5, 9, 3, 7]
    index.discard(nodes[1])
    nodes[1].gdsf_base = 2
    index.add(nodes[1])
    assert [n.node_id for n in index] == [5, 9, 7, 3]


def test_an_unknown_eviction_order_is_refused() -> None:
    with pytest.raises(ValueError, match=r"eviction must be one of \['gdsf', 'lru'\], got 'fifo'"):
        PrefixCache(4, 2, eviction="fifo")


def test_lru_order_on_request() -> None:
    """The same leaves as the GDSF test above, in plain least-recently-used order."""
    cache = PrefixCache(16, 4, eviction="lru")
    p, q, r = [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23]
    assert [put(cache, s) for s in (p, q, r)] == [(0, 1), (2, 3), (4,)]
    assert cache.evict(3) == [1, 0, 3]  # p whole (tail first), then q's tail block
    cache.check_integrity()


# ----------------------------------------------------------------------------------------------
# Reference model of the GDSF order, checked against the tree on random workloads


class GdsfModel:
    """The GDSF eviction order restated eagerly over public node snapshots (`PrefixCache.nodes()`):
    the inflation at every tick the clock handed out, and an `evict(k)` that picks, trims and
    removes leaves from a copy of the snapshot. It shares no state with the tree's lazy bases,
    keys or index, so it checks them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.inflation = 0
        self.clock = 0
        self.inflation_at = {0: 0}  # tick -> the inflation when that tick was stamped

    def tick(self) -> None:
        """An admit or a commit: one tick, stamped at the current inflation."""
        self.clock += 1
        self.inflation_at[self.clock] = self.inflation

    def evict(self, cache, k: int) -> tuple[list[int], list[tuple[int, int, tuple[int, ...]]]]:
        """(block ids freed in order, the remaining nodes as (start, end, blocks)) that
        `cache.evict(k)` must produce."""
        B = self.block_size
        views = {v.node_id: v for v in cache.nodes()}
        nodes = {
            i: {
                "start": v.start,
                "end": v.end,
                "blocks": list(v.block_ids),
                "parent": v.parent_id,
                "tick": v.last_access,
                "locked": v.lock_ref > 0,
                "children": sum(w.parent_id == i for w in views.values()),
            }
            for i, v in views.items()
            if v.parent_id is not None
        }
        for n in nodes.values():
            parent = nodes.get(n["parent"])
            # A leaf starting mid-block shares its head block when its parent (not a root)
            # owns that same block as its last one; it owns that block only if no ancestor does.
            mid_block = n["start"] % B != 0 and parent is not None
            n["shared"] = mid_block and parent["blocks"][-1] == n["blocks"][0]
            above = parent
            n["owned_above"] = False
            while mid_block and above is not None and not n["owned_above"]:
                n["owned_above"] = n["blocks"][0] in above["blocks"]
                above = nodes.get(above["parent"])

        def priority(i: int) -> int:
            n = nodes[i]
            last_block_start = (n["end"] - 1) // B * B
            lost = n["end"] - max(last_block_start, 0 if n["shared"] else n["start"])
            return self.inflation_at[n["tick"]] + lost

        freed: list[int] = []
        while len(freed) < k:
            leaves = [i for i, n in nodes.items() if not n["locked"] and not n["children"]]
            if not leaves:
                break
            victim = min(leaves, key=lambda i: (priority(i), nodes[i]["tick"], i))
            self.inflation = max(self.inflation, priority(victim))
            n = nodes[victim]
            need = k - len(freed)
            own = n["blocks"][1:] if n["owned_above"] else n["blocks"]
            if len(own) > need:  # trimmed back to a block boundary
                freed += reversed(n["blocks"][-need:])
                del n["blocks"][-need:]
                n["end"] = (n["start"] // B + len(n["blocks"])) * B
            else:
                freed += reversed(own)
                del nodes[victim]
                if n["parent"] in nodes:
                    nodes[n["parent"]]["children"] -= 1
        remaining = sorted((n["start"], n["end"], tuple(n["blocks"])) for n in nodes.values())
        return freed, remaining


def node_segments(cache) -> list[tuple[int, int, tuple[int, ...]]]:
    return sorted((v.start, v.end, v.block_ids) for v in cache.nodes() if v.parent_id is not None)


# The fixtures are factories: every example builds its own cache.
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    block_size=st.sampled_from([2, 4, 8]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["serve", "serve", "serve", "touch", "evict"]),
            st.integers(0, 63),  # which earlier sequence (or none) to continue / touch
            st.integers(0, 60),  # where to cut it (past its end: all of it, a chat turn)
            st.integers(1, 12),  # new prompt tokens
            st.integers(0, 12),  # reply tokens / blocks to evict
        ),
        min_size=80,
        max_size=120,
    ),
)
def test_gdsf_matches_a_reference_model(make_cache, serve, block_size, ops) -> None:
    """Random chat-like and branching requests (continuing an earlier sequence whole or cut
    anywhere, so splits, mid-block branches, copies and superseded tails happen), touches and
    explicit evictions: every eviction frees exactly the blocks, in the order, and leaves exactly
    the segments that the reference model predicts. A request is preceded by an eviction of what
    it may need, so every eviction goes through the model."""
    max_tokens = 48
    cache = make_cache(2 * (max_tokens // block_size + 1), block_size)
    model = GdsfModel(block_size)
    sequences: list[list[int]] = []
    fresh_tokens = iter(range(1000, 10**6))
    for kind, which, cut, new, extra in ops:
        base = sequences[which % len(sequences)] if sequences else []
        hit = cache.match(base[: max(cut, 1)]).num_cached_tokens
        if kind in ("serve", "evict", "touch"):
            want = extra if kind == "evict" else 0
            if kind == "serve":
                head = base[: min(cut, max_tokens - new - extra)]
                prompt = [*head, *(next(fresh_tokens) for _ in range(new))]
                written = prompt + [next(fresh_tokens) for _ in range(extra)]
                want = -(-len(written) // block_size) + 1 - cache.stats().num_free_blocks
            elif kind == "touch":  # the copy-on-write block of a partial hit
                want = (hit % block_size != 0) - cache.stats().num_free_blocks
            freed, segments = model.evict(cache, max(0, want))
            assert cache.evict(max(0, want)) == freed
            assert node_segments(cache) == segments
        if kind == "serve":
            serve(cache, prompt, written[len(prompt) :])
            model.tick()  # admit
            model.tick()  # commit
            sequences.append(written)
        elif kind == "touch" and base:
            hit = cache.match(base[: max(cut, 1)]).num_cached_tokens  # after the eviction
            cache.close(cache.admit(base[:hit], max_hit=hit))
            model.tick()


def test_gdsf_a_leaf_sharing_its_block_with_a_grandparent_costs_its_own_tokens(make_cache) -> None:
    """Only a block shared with the PARENT brings the parent's tokens into a leaf's cost. Here the
    leaf [7,8) co-owns block X with its grandparent [0,6) (a request wrote on into X, the tail of
    its own earlier insert, after another request's copy Y of X became the parent [6,7)): token 6
    of the path lies in Y, which the parent frees on its own, so the leaf costs its one token."""
    cache = make_cache(16, 4)
    model = GdsfModel(4)
    head = [10, 11, 12, 13, 14, 15]
    (q,) = put(cache, [40, 41])  # a leaf whose last block holds 2 tokens: priority 2
    model.tick()  # admit
    model.tick()  # commit
    own = cache.admit([*head, 20, 30], max_hit=0)  # R
    model.tick()
    x0, x = own.blocks
    cache.commit(own, head)  # R: [0,6), X its partial tail, which it writes on into
    model.tick()
    other = cache.admit([*head, 20], max_hit=6)  # another request, hit 6
    model.tick()
    y = other.copy[1]  # its copy of X
    cache.commit(other, [*head, 20])  # parent [6,7) owns Y
    model.tick()
    cache.close(other)
    cache.commit(own, [*head, 20, 30])  # R wrote 20, 30 into X
    model.tick()
    cache.close(own)
    assert node_segments(cache) == [(0, 2, (q,)), (0, 6, (x0, x)), (6, 7, (y,)), (7, 8, (x,))]
    # The leaf (1) goes before q (2), freeing nothing; then its parent (1) frees Y.
    freed, remaining = model.evict(cache, 1)
    assert cache.evict(1) == freed == [y]
    assert node_segments(cache) == remaining
