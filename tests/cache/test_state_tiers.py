"""The state group's lower tiers (`radixkv.cache.state_tiers`): snapshots under the KV blocks'
chained keys, demoted when evicted for room, found past the device's snapshots and loaded
straight into the running slot of the request that resumes there, announced as the state
group's (vLLM's kind "mamba"). The engine runs the moves: `tests/engine/test_hybrid_tiers.py`."""

from __future__ import annotations

import dataclasses

import pytest

from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.group import GroupSpec
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.keys import KeyChain, chain_keys
from radixkv.cache.kinds import build_cache
from radixkv.cache.moves import Load, Offload
from radixkv.cache.state import StateGroup, StateSpec
from radixkv.cache.state_tiers import SNAPSHOT_KIND, prefix_snapshot_key
from radixkv.cache.tokens import PackedTokens
from radixkv.engine.config import EngineConfig

B = 4


def _cache(
    num_slots: int = 2, num_host: int = 8, *, compact: bool = False
) -> tuple[GroupedCache, StateGroup]:
    """Compact: two running slots and the rest for snapshots of 400 bytes."""
    seqs = 2 if compact else 1
    config = EngineConfig(block_size=B, snapshot_min_gap_tokens=4, max_num_seqs=seqs)
    spec = StateSpec(slot_bytes=1000, snapshot_bytes=400 if compact else None)
    cache = build_cache(
        [GroupSpec(), spec],
        [64, num_slots],
        B,
        kv_events=True,
        host_blocks=[16, num_host],
        config=config,
    )
    return cache, cache.groups[1]


def _serve(cache: GroupedCache, tokens: list[int], num_prompt: int) -> tuple[int, object]:
    """One request, prefilled in one row, then one decode row per reply token; returns its hit
    and its state table as admitted."""
    table = cache.admit(tokens[:num_prompt], max_hit=num_prompt - 1)
    assert table is not None
    hit, state = table.num_cached_tokens, table.tables[1]
    pos = hit
    while pos < len(tokens) - 1:
        end = num_prompt if pos < num_prompt else pos + 1
        assert cache.extend(table, end)
        pos = end
        if end == num_prompt:
            cache.commit(table, tokens[:pos], prompt_end=True)
        cache.slide(table, pos - 1)
        cache.take_copies()
        cache.check_integrity()
    cache.commit(table, tokens[: len(tokens) - 1])
    cache.close(table)
    cache.check_integrity()
    return hit, state


def test_a_snapshot_at_a_block_boundary_has_the_kv_blocks_key_and_one_past_it_a_tail():
    chain = KeyChain(B)
    tokens = list(range(10, 24))
    qb = PackedTokens(tokens).tobytes()
    blocks = chain.chain(None, PackedTokens(tokens[:12]).tobytes())
    assert prefix_snapshot_key(chain, None, qb, 8) == blocks[1]
    tail = prefix_snapshot_key(chain, None, qb, 11)  # tokens 8..10 after block 1
    assert tail.parent_hash == blocks[1].block_hash and len(tail.tokens) == 3 * 4
    assert tail == chain_keys(None, PackedTokens(tokens[8:11]).tobytes(), 3, after=blocks[1])[0]
    assert prefix_snapshot_key(chain, None, qb, 3).parent_hash is None
    # another tenant's equal prefix: another key
    assert prefix_snapshot_key(chain, "t1", qb, 11).block_hash != tail.block_hash


def test_an_evicted_snapshot_goes_to_the_host_and_a_later_turn_loads_it_into_its_slot():
    cache, group = _cache()
    convs = [list(range(100 * k, 100 * k + 14)) for k in (1, 2, 3)]
    _serve(cache, convs[0], 10)
    cache.take_moves()
    (first_slot,) = group._by_slot
    _serve(cache, convs[1], 10)
    assert all(not m for m in cache.take_moves())  # a free slot: nothing evicted
    _serve(cache, convs[2], 10)  # no free slot: the first conversation's end is evicted
    moves = cache.take_moves()
    assert moves[1] == [Offload((first_slot,), (moves[1][0].host[0],))]
    assert group.snapshot_ends() == [(None, 13), (None, 13)] and group.tiers.num_indexed == 1
    # its next turn resumes at its end, from the host: loaded into the running slot, no copy
    turn = convs[0][:13] + [7, 8, 9]
    assert cache.match(turn, max_tokens=15).num_cached_tokens == 13
    table = cache.admit(turn, max_hit=15)
    assert table is not None and table.num_cached_tokens == 13
    state = table.tables[1]
    assert state.copy is None and state.state_end == 13
    (load,) = [m for m in cache.take_moves()[1] if isinstance(m, Load)]
    assert load.device == (state.slot,)
    stats = group.stats()
    assert (stats.num_hits, stats.num_lower_hits, stats.num_hit_tokens) == (1, 1, 13)
    assert stats.num_offloaded_blocks >= 1 and stats.num_loaded_blocks == 1
    cache.check_integrity()
    cache.close(table)
    cache.check_integrity()


def test_a_host_snapshot_past_where_a_prompt_leaves_the_tree_is_not_served():
    cache, group = _cache()
    for k in (1, 2, 3):
        _serve(cache, list(range(100 * k, 100 * k + 14)), 10)
    cache.take_moves()
    assert group.tiers.num_indexed == 1
    early = list(range(100, 111)) + [7, 8, 9]  # leaves the first conversation at 11 < 13
    assert cache.tree.match(early, max_tokens=13).num_cached_tokens == 11
    assert cache.match(early, max_tokens=13).num_cached_tokens == 0
    other_tenant = list(range(100, 113)) + [7, 8, 9]
    assert cache.match(other_tenant, max_tokens=15, namespace="t1").num_cached_tokens == 0
    assert cache.match(other_tenant, max_tokens=15).num_cached_tokens == 13
    cache.check_integrity()


def test_the_hit_a_load_reads_is_pinned_while_the_admission_evicts_into_a_full_host():
    """One host slot, holding the snapshot the next turn resumes from: the admission's eviction
    would demote another snapshot there, but the pinned one stays and is loaded."""
    cache, group = _cache(num_slots=2, num_host=1)
    convs = [list(range(100 * k, 100 * k + 14)) for k in (1, 2, 3)]
    for conv in convs:
        _serve(cache, conv, 10)
    cache.take_moves()
    (held,) = group.tiers.entries.values()
    table = cache.admit(convs[0][:13] + [7, 8], max_hit=14)
    assert table is not None and table.num_cached_tokens == 13
    (load,) = [m for m in cache.take_moves()[1] if isinstance(m, Load)]
    assert load.host == (held.block,)
    cache.check_integrity()
    cache.close(table)
    cache.check_integrity()


def test_snapshot_events_name_the_state_group_and_its_kind_on_every_tier():
    cache, group = _cache()
    convs = [list(range(100 * k, 100 * k + 14)) for k in (1, 2, 3)]
    for conv in convs:
        _serve(cache, conv, 10)
    events = [e for e in cache.take_events() if getattr(e, "group_idx", 0) == 1]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {(e.medium, e.kind) for e in stored} == {(None, SNAPSHOT_KIND), ("CPU", SNAPSHOT_KIND)}
    first = prefix_snapshot_key(group._keys, None, PackedTokens(convs[0]).tobytes(), 13)
    device = [e for e in stored if e.medium is None]
    assert device[0].block_hashes == (first.block_hash,)
    assert device[0].token_ids == (convs[0][12],)  # the tail after block 2: one token
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.medium) for e in removed] == [((first.block_hash,), None)]
    held = {e.block_hashes[0] for e in stored if e.medium == "CPU"}
    assert held == set(group.tiers.entries) == {first.block_hash}
    cache.check_integrity()


def test_integrity_catches_an_unindexed_host_snapshot_and_a_stale_key():
    cache, group = _cache()
    for k in (1, 2, 3):
        _serve(cache, list(range(100 * k, 100 * k + 14)), 10)
    cache.check_integrity()
    tiers = group.tiers
    saved = {p: dict(t) for p, t in tiers._tails.items()}
    tiers._tails.clear()
    with pytest.raises(AssertionError, match="not indexed"):
        cache.check_integrity()
    tiers._tails.update(saved)
    cache.check_integrity()
    snap = next(iter(group._by_slot.values()))
    good = group._lower_key(snap)
    snap.lower_key = dataclasses.replace(good, block_hash=good.block_hash ^ 1)
    with pytest.raises(AssertionError, match="stale lower-tier key"):
        cache.check_integrity()
    snap.lower_key = good
    cache.check_integrity()


def test_a_compact_hit_from_the_host_loads_into_a_running_slot_no_planned_copy_reads():
    """Compact snapshots: a leaving request's slot is freed at once, its snapshot's copy out of it
    planned for the next step; a load is a move, run before that step's copies, so a hit from the
    host waits for another running slot, or for the copy to be handed out."""
    cache, group = _cache(num_slots=3, compact=True)  # running slots 0, 1; snapshot slot 2
    convs = [list(range(100 * k, 100 * k + 14)) for k in (1, 2, 3)]
    _serve(cache, convs[0], 10)
    assert group.snapshot_ends() == [(None, 13)] and group._by_slot.keys() == {2}
    fresh = cache.admit(convs[2][:10], max_hit=9)  # from a zero state: the copy's slot will do
    assert fresh is not None and fresh.tables[1].slot == 0
    cache.take_copies()
    cache.check_integrity()
    _, leaving = _serve(cache, convs[1], 10)  # evicts the first snapshot to the host
    assert leaving.slot == 1 and group.tiers.num_indexed == 1
    assert [type(m) for m in cache.take_moves()[1]] == [Offload]
    turn = convs[0][:13] + [7, 8, 9]
    assert cache.match(turn, max_tokens=15).num_cached_tokens == 13
    assert cache.admit(turn, max_hit=15) is None  # slot 1, the one free, is read by a copy
    cache.check_integrity()
    (copy,) = cache.take_copies()[1]
    assert copy[0] == 1 and copy[1] == 2
    table = cache.admit(turn, max_hit=15)
    assert table is not None and table.num_cached_tokens == 13
    state = table.tables[1]
    assert state.slot == 1 and state.copy is None
    (load,) = [m for m in cache.take_moves()[1] if isinstance(m, Load)]
    assert load.device == (1,)
    stats = group.stats()
    assert stats.snapshot_bytes == 400 and stats.num_lower_hits == 1
    assert stats.num_host_blocks == 8  # counted in snapshots, whatever their size
    cache.check_integrity()
    cache.close(table)
    cache.close(fresh)
    cache.check_integrity()


def test_a_compact_hit_from_the_host_passes_over_the_free_slot_a_copy_reads():
    cache, group = _cache(num_slots=3, compact=True)
    convs = [list(range(100 * k, 100 * k + 14)) for k in (1, 2)]
    _serve(cache, convs[0], 10)
    cache.take_copies()
    _, leaving = _serve(cache, convs[1], 10)  # evicts the first snapshot to the host
    assert leaving.slot == 0 and group.pool.allocate(1) == [0]  # on top of the free list
    group.pool.release([0])
    cache.take_moves()
    table = cache.admit(convs[0][:13] + [7, 8, 9], max_hit=15)
    assert table is not None and table.num_cached_tokens == 13
    assert table.tables[1].slot == 1
    (load,) = [m for m in cache.take_moves()[1] if isinstance(m, Load)]
    assert load.device == (1,)
    cache.check_integrity()
    assert cache.take_copies()[1] == [(0, 2, 1)]  # still reads what the leaving request left
    cache.close(table)
    cache.check_integrity()
    assert group.pool.allocate(1) == [1]  # the free list's order kept
    group.pool.release([1])
    cache.check_integrity()
