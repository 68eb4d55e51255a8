"""The scheduler over a state group beside the tree's, with the fake model: every row of a
recurrent layer finds exactly its prefix's state in its slot, and every snapshot holds the
state of its prefix.

The harness (`scheduler_harness.py`) checks the full group (`KVSim`) and the outputs against the
reference; `StateSim` plays the recurrent layers' slots: each slot holds the state after some
request's first `end` tokens, copies move it in the plan's order, a row starting past 0 must find
the state of exactly the tokens before it in its slot (a leak between requests, a copy run out of
order or a snapshot taken at the wrong point shows up), and after every step each snapshot whose
copy has run holds the state of its prefix.
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import MAX_MODEL_LEN, Harness, KVSim, fake_token

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.snapshots import SnapshotPolicy
from radixkv.cache.state import StateGroup
from radixkv.cache.tokens import PackedTokens
from radixkv.engine.config import EngineConfig
from radixkv.scheduler.output import SchedulerOutput
from radixkv.scheduler.request import Request
from radixkv.scheduler.scheduler import Scheduler


class StateSim:
    """slot -> (request, end): the slot holds the state after the request's first `end` tokens
    (read lazily: an overlapped step's placeholder is filled by the time anything reads it)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.group: StateGroup = scheduler.cache.groups[1]
        self.slots: dict[int, tuple[Request, int]] = {}
        self.num_resumed_rows = 0

    def tokens(self, slot: int) -> tuple[int, ...]:
        req, end = self.slots[slot]
        return tuple(req.all_token_ids[:end])

    def step(self, out: SchedulerOutput) -> None:
        for c in out.plan(1).copies:
            assert c.num_slots == 1 and c.src_block in self.slots, c
            self.slots[c.dst_block] = self.slots[c.src_block]
        used: set[int] = set()
        for row in out.rows:
            req = self.scheduler.get_request(row.request_id)
            assert req is not None, row
            (slot,) = row.block_tables[1]
            assert slot not in used, f"two rows of one step in slot {slot}"
            used.add(slot)
            start = row.start_position
            if start:
                assert self.tokens(slot) == tuple(req.all_token_ids[:start]), f"{row}: state"
                self.num_resumed_rows += row.start_position == req.num_cached_tokens
            self.slots[slot] = (req, start + len(row.token_ids))

    def check_snapshots(self) -> None:
        pending = {dst for (_, dst, _), _ in self.group._copies}
        for snap in self.group._by_slot.values():
            if snap.slot not in pending:
                want = tuple(PackedTokens.frombytes(snap.prefix))
                assert self.tokens(snap.slot) == want, f"snapshot at {snap.end} holds another state"


def make(
    num_blocks: int = 64,
    num_slots: int = 6,
    *,
    block_size: int = 4,
    min_gap: int = 3,
    num_running: int | None = None,
    **config: object,
) -> tuple[Harness, StateSim]:
    """`num_running`: compact snapshots, that many running slots and `num_slots` snapshots'."""
    tree = PrefixCache(num_blocks, block_size)
    policy = SnapshotPolicy(min_gap_tokens=min_gap)
    if num_running is None:
        state = StateGroup(num_slots, block_size, 100, policy=policy, tree=tree)
    else:
        total = num_slots + num_running
        state = StateGroup(
            total,
            block_size,
            100,
            policy=policy,
            tree=tree,
            num_running=num_running,
            snapshot_bytes=40,
        )
    settings = {"max_model_len": MAX_MODEL_LEN, "block_size": block_size, **config}
    scheduler = Scheduler(GroupedCache([tree, state]), EngineConfig(**settings))  # type: ignore[arg-type]
    h = Harness(scheduler, KVSim(tree))
    return h, StateSim(scheduler)


def _drive(h: Harness, sim: StateSim, *, overlapped: bool, arrivals: dict[int, list]) -> None:
    sched = h.scheduler
    last: list[SchedulerOutput] = []
    schedule = sched.schedule

    def recorded() -> SchedulerOutput:
        last[:] = [schedule()]
        return last[0]

    sched.schedule = recorded  # type: ignore[method-assign]
    step = h.step_overlapped if overlapped else h.step
    for i in range(2000):
        for prompt, max_tokens, rid in arrivals.pop(i, ()):
            h.add(rid, prompt, max_tokens=max_tokens)
        if not sched.has_unfinished() and not arrivals and h.launched is None:
            return
        step(in_flight=lambda: sim.step(last[0]))
        sim.check_snapshots()
        sim.group.check_integrity()
    raise AssertionError("not done")


def _chat_arrivals(rng: random.Random, num: int, max_tokens: int = 8) -> dict[int, list]:
    """Requests over a few stems, some repeating an earlier prompt plus more (a next turn)."""
    stems = [[rng.randrange(3, 900) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    arrivals: dict[int, list] = {}
    prompts: list[list[int]] = []
    for i in range(num):
        base = rng.choice(prompts) if prompts and rng.random() < 0.4 else rng.choice(stems)
        prompt = base + [rng.randrange(3, 900) for _ in range(rng.randrange(1, 12))]
        prompts.append(prompt)
        arrivals.setdefault(rng.randrange(0, 3 * num), []).append(
            (prompt, rng.randrange(1, max_tokens), f"r{i}")
        )
    return arrivals


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("overlapped", [False, True])
@pytest.mark.parametrize(
    ("seed", "block_size", "num_blocks", "num_slots", "chunk", "max_tokens"),
    [
        (0, 4, 64, 8, 5, 8),
        (1, 1, 400, 5, 7, 8),
        (2, 4, 14, 4, 3, 18),  # tiny KV pool: eviction and preemption by recompute
        (3, 16, 24, 3, 16, 8),  # tiny slot pool: snapshots evicted for running requests
    ],
)
def test_every_state_read_finds_its_prefix(
    overlapped, compact, seed, block_size, num_blocks, num_slots, chunk, max_tokens
):
    """Compact: the running slots apart, `num_slots` more for snapshots, every snapshot a copy
    (a leaving request's too, out of a slot freed before the copy runs)."""
    rng = random.Random(seed)
    seqs = min(3, num_slots)
    h, sim = make(
        num_blocks,
        num_slots,
        block_size=block_size,
        num_running=seqs if compact else None,
        max_num_seqs=seqs,
        max_num_batched_tokens=12,
        chunked_prefill_size=chunk,
    )
    arrivals = _chat_arrivals(rng, 14, max_tokens)
    wanted = {rid: p for reqs in arrivals.values() for p, _, rid in reqs}
    _drive(h, sim, overlapped=overlapped, arrivals=arrivals)
    assert sorted(h.finished) == sorted(wanted)
    for rid, req in h.finished.items():
        assert req.output_token_ids == h.reference(req), rid
    stats = sim.group.stats()
    assert stats.num_running_slots == 0 and stats.num_taken > 0
    assert stats.num_hits > 0 and sim.num_resumed_rows > 0
    assert stats.num_free_slots + stats.num_snapshots == num_slots + (seqs if compact else 0)
    assert (h.scheduler.num_preemptions > 0) == (num_blocks < 16)
    h.assert_no_leak()


def test_a_step_that_fails_before_its_copies_loses_their_snapshots():
    """A step is scheduled with snapshot copies in its plan and fails before its forward: the
    snapshots those copies were to fill are dropped, so no later request resumes from a slot
    that never got its state; the engine goes on."""
    rng = random.Random(5)
    h, sim = make(64, 8, max_num_seqs=3, max_num_batched_tokens=12, chunked_prefill_size=4)
    sched, group = h.scheduler, sim.group
    arrivals = _chat_arrivals(rng, 10)
    failed = 0
    for i in range(500):
        for prompt, max_tokens, rid in arrivals.pop(i, ()):
            h.add(rid, prompt, max_tokens=max_tokens)
        if not sched.has_unfinished() and not arrivals:
            break
        out = sched.schedule()
        targets = {c.dst_block for c in out.plan(1).copies} & set(group._by_slot)
        if targets and not failed:
            before = group.num_snapshots
            assert [r.request_id for r in sched.fail_step()], "the step's requests fail"
            failed += 1
            assert group.num_snapshots <= before - len(targets)
            assert not targets & set(group._by_slot), "a snapshot whose copy never ran"
            sched.check_integrity()
            continue
        _record(h, sim, out)
        sched.check_integrity()
    assert failed == 1 and not sched.has_unfinished()
    for rid, req in h.finished.items():
        assert req.output_token_ids == h.reference(req), rid
    assert group.stats().num_hits > 0


def test_a_step_without_rows_leaves_the_snapshot_copies_for_the_next_that_runs():
    """A prompt leaves the tree's path at 15: its chunk ends there and the copy of its state is
    planned. It is aborted before the next step, which has no rows and so runs nothing: the copy
    waits for the next step that runs (before its forward; nothing wrote its source since), and
    the prompt after it resumes from a snapshot that holds its prefix's state."""
    h, sim = make(64, 6, chunked_prefill_size=64)
    sched, group = h.scheduler, sim.group
    h.add("a", list(range(10, 30)), max_tokens=2)
    while sched.has_unfinished():
        _step(h, sim)
    h.add("b", [*range(10, 25), 900, 901, 902], max_tokens=2)
    out = _step(h, sim)
    assert [len(r.token_ids) for r in out.rows] == [15] and group._copies, "ends at the junction"
    assert sched.abort("b")
    empty = sched.schedule()
    assert empty.is_empty and not empty.plan(1).copies and group._copies
    h.add("c", [*range(10, 25), 7, 7], max_tokens=2)
    out = _step(h, sim)
    assert out.plan(1).copies[0].dst_block in group._by_slot, "the snapshot's copy, first"
    assert sched.get_request("c").num_cached_tokens == 15
    while sched.has_unfinished():
        _step(h, sim)
    assert h.finished["c"].output_token_ids == h.reference(h.finished["c"])
    sched.check_integrity()


def _step(h: Harness, sim: StateSim) -> SchedulerOutput:
    """One synchronous step: schedule, then `_record`."""
    out = h.scheduler.schedule()
    _record(h, sim, out)
    return out


def _record(h: Harness, sim: StateSim, out: SchedulerOutput) -> None:
    """Play a scheduled step's slots and record it (the fake model's tokens)."""
    sched = h.scheduler
    sim.step(out)
    sampled = {
        r.request_id: fake_token(sched.get_request(r.request_id).all_token_ids)
        for r in out.rows
        if r.sample
    }
    for req in sched.update_from_output(out, sampled):
        h.finished[req.request_id] = req
    sim.check_snapshots()
    sim.group.check_integrity()
