"""The state group (`radixkv.cache.state`) beside the tree's group: where it resumes a prompt,
where it takes snapshots, which it drops, and its checks. The scheduler-level simulation of its
slots is `tests/scheduler/test_state_group_scheduler.py`."""

from __future__ import annotations

import random

import pytest

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.snapshots import SnapshotPolicy
from radixkv.cache.state import StateGroup, StateKind, StateSpec
from radixkv.cache.tokens import PackedTokens
from radixkv.engine.config import EngineConfig


def _cache(
    num_slots: int = 6, *, num_blocks: int = 64, block_size: int = 4, gap: int = 4
) -> tuple[GroupedCache, StateGroup]:
    tree = PrefixCache(num_blocks, block_size)
    group = StateGroup(
        num_slots, block_size, 1000, policy=SnapshotPolicy(min_gap_tokens=gap), tree=tree
    )
    return GroupedCache([tree, group]), group


def _serve(cache: GroupedCache, tokens: list[int], num_prompt: int, chunk: int = 64) -> int:
    """Run one request of prompt `tokens[:num_prompt]` and reply `tokens[num_prompt:]` as the
    scheduler does: prefill chunks cut where the cache says, each committed; decode rows of one
    token; slides one short of what the rows computed; the final commit of the written tokens
    (all but the last sampled one). Returns its hit."""
    assert num_prompt < len(tokens), "a reply of one token at least"
    table = cache.admit(tokens[:num_prompt], max_hit=num_prompt - 1, first_chunk=chunk)
    assert table is not None
    hit = pos = table.num_cached_tokens
    while pos < len(tokens) - 1:
        prefill = pos < num_prompt
        end = cache.chunk_end(table, pos, min(pos + chunk, num_prompt)) if prefill else pos + 1
        assert cache.extend(table, end)
        pos = end
        if prefill:
            cache.commit(table, tokens[:pos], prompt_end=pos == num_prompt)
        cache.slide(table, pos - 1)
        cache.take_copies()  # the next step runs them
        cache.check_integrity()
    cache.commit(table, tokens[: len(tokens) - 1])
    cache.close(table)
    cache.check_integrity()
    return hit


def test_a_hit_resumes_at_the_deepest_snapshot_whose_kv_the_tree_holds():
    cache, group = _cache()
    first = list(range(100, 140))
    assert _serve(cache, first, 30) == 0
    # the finished request's end: 39 tokens written (the last sampled one has no KV)
    assert group.snapshot_ends() == [(None, 39)]
    (snapshot_slot,) = group._by_slot
    again = first[:39] + [7, 8, 9]
    assert cache.match(again, max_tokens=41).num_cached_tokens == 39
    table = cache.admit(again, max_hit=41)
    assert table is not None and table.num_cached_tokens == 39
    state = table.tables[1]
    assert state.copy == (snapshot_slot, state.slot, 1) and state.slot != snapshot_slot
    assert group.stats().num_hits == 1 and group.stats().num_hit_tokens == 39
    cache.close(table)
    # a prompt that leaves the path before the snapshot finds none: it starts from 0
    other = first[:20] + [1, 2, 3]
    assert cache.tree.match(other, max_tokens=22).num_cached_tokens == 20
    assert cache.match(other, max_tokens=22).num_cached_tokens == 0
    cache.check_integrity()


def test_a_new_prompt_is_snapshotted_where_it_leaves_the_tree():
    cache, group = _cache(gap=8)
    doc = list(range(200, 236))  # a 36-token document
    _serve(cache, doc + [1, 2, 3, 4, 50, 51], 40)  # the first question: its end only
    assert group.snapshot_ends() == [(None, 41)]
    second = doc + [5, 6, 7, 8]
    table = cache.admit(second, max_hit=39, first_chunk=64)
    assert table is not None and table.num_cached_tokens == 0  # the tree has 36, no state there
    assert table.num_matched_tokens == 36
    # the chunk ends where the prompt leaves the tree; committed there, a copy is planned
    assert cache.chunk_end(table, 0, 40) == 36
    assert cache.extend(table, 36)
    cache.commit(table, second[:36])
    tree_copies, state_copies = cache.take_copies()
    assert tree_copies == [] and len(state_copies) == 1
    (src, dst, slots) = state_copies[0]
    assert (src, slots) == (table.tables[1].slot, 1) and group._by_slot[dst].end == 36
    cache.slide(table, 35)
    assert cache.chunk_end(table, 36, 40) == 40
    cache.close(table)
    third = doc + [9, 9]
    assert cache.match(third, max_tokens=37).num_cached_tokens == 36  # the junction serves it
    cache.check_integrity()


def test_a_leaving_request_keeps_its_slot_as_the_snapshot_and_a_stale_commit_keeps_none():
    cache, group = _cache(gap=2)
    tokens = list(range(10, 30))
    table = cache.admit(tokens, max_hit=19)
    slot = table.tables[1].slot
    assert cache.extend(table, 20)
    cache.commit(table, tokens, prompt_end=True)
    cache.slide(table, 19)
    cache.close(table)
    assert group.snapshot_ends() == [(None, 20)] and group._by_slot[slot].end == 20
    assert cache.take_copies() == ([], []), "no copy at all"
    # an overlapped step's stop: a later row moved the state past the final commit
    tokens2 = list(range(40, 61))
    table = cache.admit(tokens2[:20], max_hit=19)
    assert cache.extend(table, 20)
    cache.commit(table, tokens2[:20], prompt_end=True)
    cache.slide(table, 19)
    assert cache.extend(table, 21)  # the row computing token 20 (the stop, not yet read)
    cache.slide(table, 20)
    cache.commit(table, tokens2[:20])  # the final commit: one short of the state
    cache.close(table)
    assert group.snapshot_ends() == [(None, 20)] and slot in group._by_slot
    cache.check_integrity()


def test_running_requests_take_slots_from_snapshots_orphans_first():
    cache, group = _cache(num_slots=3, num_blocks=12, gap=2)
    tree = cache.tree
    _serve(cache, list(range(100, 116)), 12)
    _serve(cache, list(range(300, 316)), 12)
    assert group.snapshot_ends() == [(None, 15), (None, 15)]
    tree.evict(tree.stats().num_evictable_blocks)  # every block: both snapshots orphaned
    kept = list(range(500, 516))
    _serve(cache, kept, 12)
    # two running requests need two slots beside the third snapshot: the orphans go first
    tables = [cache.admit(list(range(k, k + 4)), max_hit=3) for k in (600, 700)]
    assert None not in tables
    assert group.stats().num_evicted == 2
    (snap,) = group._snapshots.values()
    assert snap.prefix == PackedTokens(kept[:15]).tobytes()
    tables.append(cache.admit(list(range(800, 804)), max_hit=3))  # evicts the last one
    assert tables[-1] is not None and group.num_snapshots == 0
    assert cache.admit(list(range(900, 904)), max_hit=3) is None, "every slot runs"
    for table in tables:
        cache.close(table)
    cache.check_integrity()


def test_a_pinned_snapshot_is_never_evicted_and_a_refused_admission_changes_nothing():
    cache, group = _cache(num_slots=2, gap=2)
    tokens = list(range(100, 120))
    _serve(cache, tokens, 16)  # one snapshot, at 19
    resume = cache.admit(tokens[:19] + [1], max_hit=19)  # pins it, takes the other slot
    assert resume is not None and resume.num_cached_tokens == 19
    before = repr(group.stats()), cache.tree.stats()
    assert cache.admit(list(range(400, 410)), max_hit=9) is None, "no slot: the only one pinned"
    assert (repr(group.stats()), cache.tree.stats()) == before
    cache.slide(resume, 19)  # its copy ran: the snapshot may go now
    other = cache.admit(list(range(400, 410)), max_hit=9)
    assert other is not None and group.num_snapshots == 0
    for table in (resume, other):
        cache.close(table)
    cache.check_integrity()


def test_superseded_snapshots_go_before_others():
    cache, group = _cache(num_slots=4, gap=2)
    turn1 = list(range(100, 110))
    _serve(cache, turn1, 8)  # a snapshot at 9
    turn2 = turn1[:9] + list(range(200, 210))
    assert _serve(cache, turn2, 15) == 9  # resumes there, leaves one at 18: 9 is superseded
    _serve(cache, list(range(500, 510)), 8)  # an unrelated snapshot, at 9 too
    first = group._by_slot[group.ledger.victims()[0]]
    assert first.prefix == PackedTokens(turn1[:9]).tobytes(), "the superseded one goes first"
    cache.check_integrity()


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda g: g._ends.add(None, 5),  # an end without a snapshot
        lambda g: g.pool.release([next(iter(g._by_slot))]),  # a snapshot's slot freed
        lambda g: g.ledger.drop(next(iter(g._by_slot))),  # a snapshot the ledger lost
        lambda g: setattr(next(iter(g._by_slot.values())), "prefix", b"\x01\x00\x00\x00"),
    ],
)
def test_check_integrity_catches_corruption(corrupt):
    cache, group = _cache(gap=2)
    _serve(cache, list(range(100, 120)), 16)
    group.check_integrity()
    corrupt(group)
    with pytest.raises(AssertionError):
        group.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_hits_are_the_deepest_snapshot_against_a_reference(seed):
    """Random requests over shared stems: each admission resumes at the deepest snapshot (by
    the reference: every snapshot's exact prefix) on the prompt within the tree's match, and
    the group's books hold after every request."""
    rng = random.Random(seed)
    B = rng.choice([1, 4, 16])
    slots, gap = rng.choice([2, 4, 8]), rng.choice([1, 3, 8])
    cache, group = _cache(num_slots=slots, num_blocks=300 // B + 8, block_size=B, gap=gap)
    stems = [[rng.randrange(3, 50) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    for _ in range(25):
        tokens = rng.choice(stems) + [rng.randrange(3, 50) for _ in range(rng.randrange(2, 25))]
        num_prompt = rng.randrange(2, len(tokens))
        prompt = tokens[:num_prompt]
        m = cache.tree.match(prompt, max_tokens=num_prompt - 1).num_cached_tokens
        packed = PackedTokens(prompt).tobytes()
        snaps = group._snapshots.values()
        want = max((s.end for s in snaps if packed.startswith(s.prefix) and s.end <= m), default=0)
        hit = _serve(cache, tokens, num_prompt, chunk=rng.choice([3, 8, 64]))
        assert hit == want, (hit, want, m)
        stats = group.stats()
        assert stats.num_free_slots + stats.num_snapshots == stats.num_slots


def test_the_kind_sizes_its_pool_from_the_settings():
    kind, spec = StateKind(), StateSpec(slot_bytes=1000)
    config = EngineConfig(max_num_seqs=4, num_blocks=10)
    assert kind.plan_blocks(spec, config, 1000, None) == 12  # 2 snapshots per running request
    assert kind.plan_blocks(spec, EngineConfig(max_num_seqs=4, num_snapshots=5), 1000, None) == 9
    share = EngineConfig(max_num_seqs=4, snapshot_share=0.25)
    assert kind.plan_blocks(spec, share, 1000, 100_000) == 4 + 25
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        kind.plan_blocks(spec, share, 1000, 3000)


def test_compact_snapshots_keep_a_pool_of_their_own():
    """Compact snapshots: slots [0, 2) run requests, [2, 5) hold snapshots; a leaving request's
    end is a copy into a snapshot slot (its running slot freed at once), a full snapshot pool
    evicts for it, and a running slot never comes from a snapshot."""
    tree = PrefixCache(64, 4)
    policy = SnapshotPolicy(min_gap_tokens=2)
    group = StateGroup(5, 4, 1000, policy=policy, tree=tree, num_running=2, snapshot_bytes=300)
    cache = GroupedCache([tree, group])
    assert group.ledger.capacity == 3 and group.stats().snapshot_bytes == 300
    ends = []
    for k in range(4):  # four one-chunk requests, nothing shared
        tokens = list(range(100 * k + 1, 100 * k + 13))
        table = cache.admit(tokens[:10], max_hit=9)
        slot = table.tables[1].slot
        assert slot < 2
        assert cache.extend(table, 10)
        cache.commit(table, tokens[:10], prompt_end=True)
        cache.slide(table, 9)
        cache.commit(table, tokens[:10])
        cache.close(table)
        (copy,) = cache.take_copies()[1]
        assert copy[0] == slot and copy[1] >= 2 and copy[2] == 1
        assert group.pool.num_free == 2  # the running slot is free again
        ends.append(10)
        cache.check_integrity()
    stats = group.stats()
    assert stats.num_snapshots == 3 and stats.num_evicted == 1
    assert stats.num_snapshot_bytes == 3 * 300 and stats.num_free_slots == 2
    # two running requests fill the running pool: a third does not fit, snapshots or not
    tables = [cache.admit(list(range(500 + 10 * i, 505 + 10 * i)), max_hit=4) for i in range(2)]
    assert all(t is not None for t in tables)
    probe_tokens = list(range(700, 705))
    assert cache.admit(probe_tokens, max_hit=4) is None
    assert group.num_snapshots == 3
    for t in tables:
        cache.close(t)
    cache.check_integrity()
