"""Scheduler behaviour step by step, with the fake model (see scheduler_harness.py).

Every `Harness.step` checks the token budget, max_num_seqs, the rows' tokens / positions / tables,
the reference KV simulation (reads see the right KV, no slot written twice or over a tree slot), and
`Scheduler.check_integrity()` (which includes `PrefixCache.check_integrity()`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.engine.config import EngineConfig
from radixkv.scheduler.output import BlockCopy, SchedulerOutput
from radixkv.scheduler.request import Request, RequestStatus
from radixkv.scheduler.scheduler import Scheduler

MakeHarness = Callable[..., Any]  # the `harness` fixture of conftest.py
Harness = Any


def blocks_of(req: Request) -> tuple[int, ...]:
    """The request's block table (() when it holds none)."""
    return req.table.tables[0].blocks if req.table is not None else ()


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---------------------------------------------------------------- budgets and chunking


def test_chunked_prefill_splits_and_only_last_chunk_samples(harness: MakeHarness) -> None:
    h = harness(block_size=4, chunked_prefill_size=8, max_num_batched_tokens=64)
    prompt = seq(100, 30)
    req = h.add("a", prompt, max_tokens=3)
    chunks = []
    for _ in range(4):
        (row,) = h.step().rows
        chunks.append((row.start_position, len(row.token_ids), row.sample))
        # Progressive insertion: the written prefix is in the tree right after each chunk.
        assert h.cache.match(prompt).num_cached_tokens == req.num_computed_tokens
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    h.run()
    assert [(r.rows[0].start_position, len(r.rows[0].token_ids)) for r in h.outputs[4:]] == [
        (30, 1),
        (31, 1),
    ]
    assert req.output_token_ids == h.reference(req) and req.finish_reason == "length"
    h.assert_no_leak()


def test_budget_and_max_num_seqs_respected_with_mixed_steps(harness: MakeHarness) -> None:
    h = harness(
        num_blocks=128, block_size=4, max_num_seqs=3, max_num_batched_tokens=10,
        chunked_prefill_size=6,
    )  # fmt: skip
    reqs = [h.add(f"r{i}", seq(10 * i, 5 + 4 * i), max_tokens=2 + i) for i in range(8)]
    h.run()
    assert all(r.output_token_ids == h.reference(r) for r in reqs)
    assert max(o.num_batched_tokens for o in h.outputs) == 10
    assert max(len(o.rows) for o in h.outputs) == 3
    mixed = [o for o in h.outputs if {r.sample and len(r.token_ids) == 1 for r in o.rows} == {
        True, False}]  # fmt: skip
    assert mixed, "no step mixed decode rows with prefill chunks"
    for o in h.outputs:  # decode rows are packed before prefill chunks
        kinds = [len(r.token_ids) > 1 for r in o.rows]
        assert kinds == sorted(kinds), o
    h.assert_no_leak()


def test_decodes_get_the_budget_before_prefill(harness: MakeHarness) -> None:
    h = harness(block_size=4, max_num_batched_tokens=5, chunked_prefill_size=8)
    a = h.add("a", seq(1, 5), max_tokens=10)
    h.step()  # a: whole prompt
    h.add("b", seq(50, 20), max_tokens=2)
    out = h.step()
    assert [(r.request_id, len(r.token_ids)) for r in out.rows] == [("a", 1), ("b", 4)]
    h.run()
    assert a.output_token_ids == h.reference(a)
    h.assert_no_leak()


def test_prefill_first_admits_before_decoding_and_decodes_when_nothing_fits(
    harness: MakeHarness,
) -> None:
    h = harness(num_blocks=6, block_size=4, max_num_batched_tokens=64, prefill_first=True)
    a = h.add("a", seq(1, 5), max_tokens=6, ignore_eos=True)
    h.step()  # a: whole prompt
    b = h.add("b", seq(50, 6), max_tokens=6, ignore_eos=True)
    out = h.step()  # b admitted: this step runs its prefill and no decode
    assert [(r.request_id, len(r.token_ids)) for r in out.rows] == [("b", 6)]
    out = h.step()  # nothing waits: both decode
    assert [(r.request_id, len(r.token_ids)) for r in out.rows] == [("a", 1), ("b", 1)]
    c = h.add("c", seq(90, 12), max_tokens=2, ignore_eos=True)  # 3 blocks: only 1 is free
    out = h.step()  # c does not fit: the running requests decode, the step is not empty
    assert [r.request_id for r in out.rows] == ["a", "b"]
    h.run()
    assert [r.output_token_ids for r in (a, b, c)] == [h.reference(r) for r in (a, b, c)]
    h.assert_no_leak()


def test_prefill_first_finishes_a_chunked_prompt_before_admitting_the_next(
    harness: MakeHarness,
) -> None:
    # Prompts longer than a chunk, the budget two chunks: each step first continues the prompts
    # already running, so their first tokens come in arrival order instead of all at the end.
    h = harness(
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
        chunked_prefill_size=8,
        prefill_first=True,
    )
    reqs = [
        h.add(name, seq(40 * i, 10), max_tokens=2, ignore_eos=True) for i, name in enumerate("abcd")
    ]
    steps = [[(r.request_id, len(r.token_ids)) for r in h.step().rows] for _ in range(3)]
    assert steps == [
        [("a", 8), ("b", 8)],
        [("a", 2), ("b", 2), ("c", 8), ("d", 4)],
        [("a", 1), ("b", 1), ("c", 2), ("d", 6)],  # nothing waits: decodes first again
    ]
    h.run()
    assert [r.output_token_ids for r in reqs] == [h.reference(r) for r in reqs]
    h.assert_no_leak()


# ---------------------------------------------------------------- admission and policies


@pytest.mark.parametrize(("policy", "first"), [("fcfs", "cold"), ("lpm", "hot")])
def test_lpm_admits_longest_cached_prefix_first(
    harness: MakeHarness, policy: str, first: str
) -> None:
    h = harness(block_size=4, max_num_seqs=1, policy=policy)
    shared = seq(1, 20)
    h.add("warm", shared, max_tokens=1)
    h.run()
    cold = h.add("cold", seq(200, 20), max_tokens=2)
    hot = h.add("hot", [*shared[:16], 90, 91, 92], max_tokens=2)
    stats = h.cache.stats()
    (row,) = h.step().rows
    assert row.request_id == first
    h.run()
    assert hot.num_cached_tokens == 16 and cold.num_cached_tokens == 0
    # Scoring the queue (by read-only matches) counted no query: only the admissions did.
    assert h.cache.stats().num_queries - stats.num_queries == 2
    h.assert_no_leak()


def test_admission_waits_under_block_pressure(harness: MakeHarness) -> None:
    h = harness(num_blocks=10, block_size=4)
    a = h.add("a", seq(1, 24), max_tokens=8)  # 6 blocks now, 8 at the end
    b = h.add("b", seq(100, 20), max_tokens=2)  # 5 blocks: not while a runs
    waited = 0
    while not a.is_finished:
        out = h.step()
        assert all(r.request_id == "a" for r in out.rows) and not out.preempted_ids
        assert b.status is RequestStatus.WAITING and h.scheduler.num_waiting == 1
        waited += 1
    assert waited == 8
    out = h.step()  # a's blocks are cached (evictable): b gets in by evicting them
    assert [r.request_id for r in out.rows] == ["b"]
    h.run()
    assert b.output_token_ids == h.reference(b)
    assert h.cache.stats().num_evicted_blocks > 0
    h.assert_no_leak()


def _cache_state(cache: PrefixCache) -> tuple[Any, ...]:
    return (cache.stats(), cache._clock, list(cache.nodes()))


def test_waiting_request_leaves_the_cache_untouched(harness: MakeHarness, monkeypatch) -> None:
    """A request that does not fit waits without touching the cache: no query counted, no recency
    refreshed, no node changed. It shares cached blocks, so free + evictable blocks alone (which
    count them as evictable) say it fits; locking its match would pin them, which `admit`
    accounts for before anything is locked."""
    h = harness(num_blocks=10, block_size=4, policy="fcfs")
    h.add("warm", seq(1, 12), max_tokens=1)
    h.run()  # 3 blocks cached
    a = h.add("a", seq(100, 20), max_tokens=8)
    h.step()  # a: its whole prompt in 5 blocks; 2 free
    b = h.add("b", [*seq(1, 12), *seq(200, 16)], max_tokens=2)  # warm's 3 blocks + 4 new
    sched = h.scheduler
    try_admit = sched._try_admit
    failures = []

    def watched(req: Request, *args: Any, **kwargs: Any) -> Any:
        before = _cache_state(h.cache.tree)
        stats = h.cache.stats()  # what a fit check blind to the pinned blocks would answer:
        over_promised = stats.num_free_blocks + stats.num_evictable_blocks >= 4
        row = try_admit(req, *args, **kwargs)
        if row is None:
            assert _cache_state(h.cache.tree) == before, f"{req.request_id} touched the cache"
            failures.append(over_promised)
        return row

    monkeypatch.setattr(sched, "_try_admit", watched)
    quiet_steps = 0
    while b.status is RequestStatus.WAITING:
        before, num_blocks = _cache_state(h.cache.tree), len(blocks_of(a))
        h.step()
        if len(blocks_of(a)) == num_blocks and not a.is_finished:
            quiet_steps += 1  # a decoded within its blocks: nothing but b's attempt happened
            assert _cache_state(h.cache.tree) == before
    assert True in failures, "the scenario must catch the over-promise of free + evictable"
    assert quiet_steps >= 2
    h.run()
    assert b.num_cached_tokens == 12 and b.output_token_ids == h.reference(b)
    # One query per admission (warm, a, b): the failed attempts counted none.
    assert h.cache.stats().num_queries == 3
    h.assert_no_leak()


# ---------------------------------------------------------------- sharing and copy-on-write


def test_cow_of_partial_matched_block(harness: MakeHarness) -> None:
    h = harness(num_blocks=64, block_size=16)
    shared = seq(1, 37)
    h.add("warm", [*shared, 500, 501, 502], max_tokens=1)
    h.run()
    src = h.cache.match(shared).block_ids[2]
    req = h.add("b", shared + [600] * 10, max_tokens=4)
    out = h.step()
    (row,) = out.rows
    assert row.start_position == 37 and req.num_cached_tokens == 37
    assert out.plan(0).copies == (
        BlockCopy(src_block=src, dst_block=row.block_tables[0][2], num_slots=5),
    )
    assert (
        row.block_tables[0][2] != src
        and row.block_tables[0][:2] == h.cache.match(shared).block_ids[:2]
    )
    h.run()
    assert req.output_token_ids == h.reference(req)
    h.assert_no_leak()


def test_rows_take_the_table_as_it_is_and_it_stays_as_scheduled(harness: MakeHarness) -> None:
    """A row's block table is the request's table itself (no copy per step) when it covers all of
    it, and it cannot change under the step: the cache replaces a table whole (grow, commit), so
    an output keeps the blocks its step wrote while the request moves on."""
    h = harness(num_blocks=64, block_size=4, chunked_prefill_size=8)
    tables: dict[str, tuple[int, ...]] = {}

    def record() -> None:  # after the forward, before update_from_output
        tables.update((r.request_id, blocks_of(r)) for r in h.scheduler.running_requests)

    req = h.add("a", seq(1, 6), max_tokens=6)
    rows = []
    for _ in range(5):  # the prefill, then decodes at positions 6 .. 9 (a new block at 8)
        (row,) = h.step(in_flight=record).rows
        assert row.block_tables[0] is tables["a"]
        rows.append((row, tuple(row.block_tables[0])))
    assert [len(snapshot) for _, snapshot in rows] == [2, 2, 2, 3, 3]
    assert all(row.block_tables[0] == snapshot for row, snapshot in rows)
    assert blocks_of(req) is not rows[0][0].block_tables[0]  # committed and grown since
    # Two requests compute [8, 16) of one prompt in the same step; the update swaps the second's
    # duplicates for the first's blocks, and its row still names the blocks it wrote.
    prompt = seq(100, 40)
    r1 = h.add("r1", prompt, max_tokens=3)
    h.step()
    r2 = h.add("r2", prompt, max_tokens=3)
    out = h.step(in_flight=record)
    row2 = next(r for r in out.rows if r.request_id == "r2")
    assert row2.block_tables[0] == tables["r2"][:4]
    assert blocks_of(r2)[2:4] == blocks_of(r1)[2:4] != row2.block_tables[0][2:4]
    h.run()
    h.assert_no_leak()


def test_concurrent_request_shares_after_first_chunk(harness: MakeHarness) -> None:
    h = harness(num_blocks=64, block_size=4, chunked_prefill_size=8)
    prompt = seq(1, 40)
    r1 = h.add("r1", prompt, max_tokens=3)
    h.step()  # r1 writes and inserts [0, 8)
    r2 = h.add("r2", prompt, max_tokens=3)
    out = h.step()
    row2 = next(r for r in out.rows if r.request_id == "r2")
    assert row2.start_position == 8 and r2.num_cached_tokens == 8
    assert row2.block_tables[0][:2] == tuple(blocks_of(r1)[:2])
    # Both computed [8, 16); r1 inserted first, r2's duplicates were freed for r1's blocks.
    assert blocks_of(r2)[:4] == blocks_of(r1)[:4]
    h.run()
    assert r1.output_token_ids == r2.output_token_ids == h.reference(r1)
    h.assert_no_leak()


def test_same_prompt_same_step_keeps_private_tails(harness: MakeHarness) -> None:
    """Two identical 37-token prompts prefilled in one step: the second insert finds the first's
    blocks; it shares the full ones but keeps its own partial tail, where it writes position 37.
    (In-batch deferral off: with it, r2 would wait a step and hit r1's prefix instead.)"""
    h = harness(num_blocks=64, block_size=16, chunked_prefill_size=64, defer_shared_prefix_tokens=0)
    r1 = h.add("r1", seq(1, 37), max_tokens=6)
    r2 = h.add("r2", seq(1, 37), max_tokens=6)
    h.step()
    assert blocks_of(r2)[:2] == blocks_of(r1)[:2]  # r2's duplicates were freed
    assert blocks_of(r2)[2] != blocks_of(r1)[2] and r2.table.tables[0].private == {blocks_of(r2)[2]}
    assert h.cache.stats().num_duplicate_blocks_freed == 2
    out = h.step()  # both decode position 37, each in its own block (checked by the sim)
    assert not out.plan(0).copies
    h.run()
    assert r1.output_token_ids == r2.output_token_ids == h.reference(r1)
    h.assert_no_leak()


# ---------------------------------------------------------------- preemption


def _pressured_run(harness: MakeHarness, num_blocks: int) -> tuple[Harness, list[Request]]:
    """Three 10-token prompts decoding side by side; at position 16 (their 5th block) 14 blocks
    are short by one, so the most recently admitted one is preempted."""
    h = harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64)
    reqs = [
        h.add(f"r{i}", [i + 1, *seq(40 * i + 100, 9)], max_tokens=m)
        for i, m in enumerate((9, 14, 14))
    ]
    h.run()
    return h, reqs


def test_preemption_by_recompute_restarts_with_cache_hits(harness: MakeHarness) -> None:
    h, reqs = _pressured_run(harness, num_blocks=14)
    preempted = [(i, rid) for i, o in enumerate(h.outputs) for rid in o.preempted_ids]
    assert preempted == [(7, "r2")], "the most recently admitted request is the victim"
    victim = reqs[2]
    assert victim.num_preemptions == 1 and victim.num_cached_tokens == 0
    # It had written 16 tokens; they were inserted before its blocks were dropped, so its restart
    # (two steps later, once r0 finished) computes one token only.
    restart = next(r for r in h.outputs[8:] for r in r.rows if r.request_id == "r2")
    assert (restart.start_position, len(restart.token_ids), restart.sample) == (16, 1, True)
    relaxed, relaxed_reqs = _pressured_run(harness, num_blocks=64)
    assert not any(o.preempted_ids for o in relaxed.outputs)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in relaxed_reqs]
    assert all(r.output_token_ids == h.reference(r) for r in reqs)
    h.assert_no_leak()


def test_preemption_under_heavy_pressure_still_completes(harness: MakeHarness) -> None:
    """Victims whose cached tokens get evicted while they wait restart with smaller hits."""
    h = harness(num_blocks=14, block_size=4)
    reqs = [h.add(f"r{i}", [i + 1, *seq(40 * i + 100, 9)], max_tokens=14) for i in range(3)]
    h.run()
    assert sum(r.num_preemptions for r in reqs) >= 1
    assert all(r.output_token_ids == h.reference(r) for r in reqs)
    h.assert_no_leak()


def test_lone_request_using_the_whole_cache_completes(harness: MakeHarness) -> None:
    """Exactly num_blocks worth of KV after a partial hit: the copy-on-write source (the warm
    prompt's partial block, split at the hit's end so the warm suffix still co-owns it) stays
    locked beside the request's own copy, so at position 12 the request is one block short with
    nothing to evict. It preempts itself; readmitted with its hit it still does not fit, so, alone
    in an idle cache, it is readmitted without its hit."""
    h = harness(num_blocks=4, block_size=4)
    h.add("warm", seq(1, 7), max_tokens=1)  # 7 tokens: the hit of 6 ends inside its node
    h.run()
    req = h.add("big", [*seq(1, 6), 77, 78], max_tokens=9)  # 16 KV tokens = the whole cache
    h.run()
    assert [o.preempted_ids for o in h.outputs if o.preempted_ids] == [("big",)]
    assert req.num_cached_tokens == 6
    starts = [r.start_position for o in h.outputs for r in o.rows if r.request_id == "big"]
    assert starts[0] == 6 and 0 in starts  # readmitted without its hit
    assert req.output_token_ids == h.reference(req)
    h.assert_no_leak()


# ---------------------------------------------------------------- aborts and rejection


def test_abort_waiting_request(harness: MakeHarness) -> None:
    h = harness(max_num_seqs=1)
    a = h.add("a", seq(1, 6), max_tokens=3)
    b = h.add("b", seq(20, 6), max_tokens=3)
    h.step()
    assert h.scheduler.abort("b") and b.status is RequestStatus.FINISHED_ABORTED
    assert b.finish_reason == "abort" and h.scheduler.num_waiting == 0
    assert not h.scheduler.abort("b") and not h.scheduler.abort("nope")
    out = h.step()
    assert out.finished_ids == ("b",)
    h.run()
    assert a.output_token_ids == h.reference(a)
    h.assert_no_leak()


@pytest.mark.parametrize("in_flight", [False, True])
def test_abort_running_request_frees_everything(harness: MakeHarness, in_flight: bool) -> None:
    h = harness(num_blocks=32, block_size=4, chunked_prefill_size=8)
    h.add("warm", seq(1, 10), max_tokens=1)
    h.run()
    prompt = [*seq(1, 10), *seq(50, 20)]
    req = h.add("a", prompt, max_tokens=5)  # 10 cached (CoW of 2 slots), then chunks of 8
    h.step()
    assert req.num_computed_tokens == 18
    if in_flight:  # aborted between schedule() and update_from_output()
        out = h.scheduler.schedule()
        assert h.scheduler.abort("a")
        assert h.scheduler.update_from_output(out, {}) == []
    else:
        assert h.scheduler.abort("a")
    assert req.table is None  # no blocks, no lock, nothing private
    assert req.finish_reason == "abort" and h.scheduler.num_running == 0
    h.assert_no_leak()
    # What was inserted before the abort stays cached; nothing after it was inserted.
    assert h.cache.match(prompt).num_cached_tokens == 18
    assert h.step().finished_ids == ("a",)


def test_rejects_requests_that_can_never_run(harness: MakeHarness) -> None:
    h = harness(num_blocks=4, block_size=4, max_model_len=20)
    sched = h.scheduler
    with pytest.raises(ValueError, match="whole cache has 4"):
        h.add("big", seq(1, 10), max_tokens=8)  # 17 KV tokens > 16 slots
    # What the engine's door refuses (LLM tests check it there) is a broken precondition here.
    with pytest.raises(AssertionError, match="1 to 19 tokens"):
        h.add("long", seq(1, 20))  # no room for a generated token
    with pytest.raises(AssertionError, match="1 to 19 tokens"):
        h.add("empty", [])
    ok = h.add("ok", seq(1, 10), max_tokens=7)  # 16 KV tokens: exactly the cache
    with pytest.raises(AssertionError, match="already queued"):
        h.add("ok", seq(1, 3))
    assert sched.num_waiting == 1
    h.run()
    assert ok.output_token_ids == h.reference(ok) and len(ok.output_token_ids) == 7
    h.assert_no_leak()


def test_max_model_len_caps_generation_and_admission_bound(harness: MakeHarness) -> None:
    h = harness(num_blocks=3, block_size=4, max_model_len=12)
    req = h.add("r", seq(1, 10), max_tokens=100)  # capped at 12 tokens -> 11 KV -> 3 blocks
    h.run()
    assert len(req.output_token_ids) == 2 and req.finish_reason == "length"
    h.assert_no_leak()


def test_stop_token_finishes_early(harness: MakeHarness) -> None:
    h = harness()
    probe = Request("p", seq(1, 5), 5)
    expected = h.reference(probe)
    req = h.add("r", seq(1, 5), max_tokens=5, eos=(expected[2],))
    ign = h.add("i", seq(1, 5), max_tokens=5, eos=(expected[2],), ignore_eos=True)
    h.run()
    assert req.output_token_ids == expected[:3] and req.finish_reason == "stop"
    assert ign.output_token_ids == expected and ign.finish_reason == "length"
    h.assert_no_leak()


# ---------------------------------------------------------------- cache off, misuse


def test_cache_off_gives_the_same_outputs(harness: MakeHarness) -> None:
    outputs = {}
    for enable in (True, False):
        h = harness(num_blocks=20, block_size=4, chunked_prefill_size=6, enable_prefix_cache=enable)
        base = seq(1, 13)
        reqs = [h.add(f"r{i}", [*base[: 5 + 2 * i], 300 + i], max_tokens=6) for i in range(5)]
        h.run()
        outputs[enable] = [r.output_token_ids for r in reqs]
        assert all(r.output_token_ids == h.reference(r) for r in reqs)
        if not enable:
            assert all(r.num_cached_tokens == 0 for r in reqs)
            assert h.cache.stats().num_free_blocks == 20 and h.cache.stats().num_nodes <= 1
        h.assert_no_leak()
    assert outputs[True] == outputs[False]


def test_misuse_of_the_step_protocol_is_an_assert() -> None:
    # The engine is the scheduler's one caller: it samples exactly the rows that ask for it.
    cache = GroupedCache([PrefixCache(num_blocks=8, block_size=4)])
    sched = Scheduler(cache, EngineConfig(max_model_len=64))
    sched.add_request(Request("a", [1, 2, 3], 4))
    out = sched.schedule()
    with pytest.raises(AssertionError, match="before record_launched"):
        sched.schedule()
    with pytest.raises(AssertionError):
        sched.update_from_output(out, {})  # a sampled row's token missing
    with pytest.raises(AssertionError):
        sched.update_from_output(out, {"a": 4, "b": 5})  # a token for no row
    with pytest.raises(AssertionError, match="not the last schedule"):
        sched.update_from_output(SchedulerOutput(rows=out.rows), {"a": 4})
    assert sched.update_from_output(out, {"a": 4}) == []
    sched.check_integrity()


def test_cache_salts_isolate_requests(harness: MakeHarness) -> None:
    h = harness(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))
    a = h.add("a", prompt, max_tokens=2)
    h.run()
    salted = [
        Request("b", prompt, 2, cache_salt="t1"),
        Request("c", prompt, 2, cache_salt="t1"),
        Request("d", prompt, 2),
    ]
    h.run(arrivals={0: salted[:1], 3: salted[1:]})
    b, c, d = salted
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0  # another namespace: no hit
    assert c.num_cached_tokens == d.num_cached_tokens == len(prompt) - 1  # same namespace: hit
    for req in (a, *salted):
        assert req.output_token_ids == h.reference(req)
    h.assert_no_leak()


def test_a_jump_is_computed_as_one_row_and_cached_like_any_token(harness: MakeHarness) -> None:
    """After a jump the request's next row computes all its new tokens at once; the simulated
    KV checks every slot it reads, and the request finishes with the jumped tokens."""
    h = harness(num_blocks=32, block_size=4)
    req = h.add("r", list(range(1, 11)), max_tokens=12)
    h.step()  # the prefill: one token sampled
    assert req.num_tokens_to_compute == 1
    h.scheduler.jump("r", len(req.output_token_ids), [501, 502, 503, 504, 505])
    out = h.step()
    (row,) = out.rows
    assert len(row.token_ids) == 6 and row.sample  # the sampled token and the jumped ones
    h.run()
    assert h.finished["r"].output_token_ids[1:6] == [501, 502, 503, 504, 505]
    h.assert_no_leak()


def test_a_held_request_waits_for_its_placeholder(harness: MakeHarness) -> None:
    """Overlapped: a held request is not scheduled while its placeholder is unread; once that
    is filled it runs again (and its hold is gone)."""
    h = harness(num_blocks=32, block_size=4)
    a = h.add("a", list(range(1, 11)), max_tokens=6)
    b = h.add("b", list(range(20, 31)), max_tokens=6)
    h.scheduler.hold("a")
    h.step_overlapped()  # prefill of both: a placeholder each
    out = h.step_overlapped()  # a is held: only b computes its placeholder; a's is filled
    assert [r.request_id for r in out.rows] == ["b"]
    assert not a.held and a.num_pending == 0 and b.num_pending == 1
    out = h.step_overlapped()
    assert sorted(r.request_id for r in out.rows) == ["a", "b"]
    while h.scheduler.has_unfinished() or h.launched is not None:
        h.step_overlapped()
    assert h.finished["a"].output_token_ids == h.reference(a)
    h.assert_no_leak()
