"""The snapshot policy (where recurrent-state snapshots are taken) and the ledger (their budget
and eviction order): exact orders under a logical clock, and a state machine against a naive
model that recomputes every victim from scratch."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.cache.snapshots import SnapshotLedger, SnapshotPoint, SnapshotPolicy

MIB = 1 << 20


def _positions(points: tuple[SnapshotPoint, ...]) -> list[tuple[int, bool, str]]:
    return [(p.position, p.required, p.reason) for p in points]


def test_a_new_prompt_is_snapshotted_where_it_leaves_the_tree_and_at_chunk_ends() -> None:
    policy = SnapshotPolicy(min_gap_tokens=64)
    points = policy.prefill_points(
        resume=100, divergence=700, num_prompt_tokens=1400, chunk_ends=[612, 1124, 1400]
    )
    # 612 is taken (512 past the resume), 700 only 88 past it (kept: required), 1124 a chunk
    # end; the prompt's own end is the finished snapshot's business, not a chunk point
    assert _positions(points) == [
        (612, False, "chunk"),
        (700, True, "divergence"),
        (1124, False, "chunk"),
    ]


def test_points_closer_than_the_gap_are_skipped() -> None:
    policy = SnapshotPolicy(min_gap_tokens=64)
    assert policy.prefill_points(resume=300, divergence=330, num_prompt_tokens=400) == ()
    points = policy.prefill_points(resume=0, divergence=40, num_prompt_tokens=900, chunk_ends=[512])
    assert _positions(points) == [(512, False, "chunk")]  # the divergence is 40 tokens in
    no_chunks = SnapshotPolicy(chunk_snapshots=False)
    assert (
        no_chunks.prefill_points(resume=0, divergence=40, num_prompt_tokens=900, chunk_ends=[512])
        == ()
    )


def test_a_resumed_prompt_takes_no_divergence_snapshot_at_its_resume_point() -> None:
    # the prompt resumes where it leaves the tree: a snapshot already exists there
    policy = SnapshotPolicy()
    assert policy.prefill_points(resume=500, divergence=500, num_prompt_tokens=700) == ()


def test_a_finished_request_is_snapshotted_at_its_end_unless_too_close() -> None:
    policy = SnapshotPolicy(min_gap_tokens=64)
    end = policy.finish_point(last_point=500, num_written=620)
    assert end == SnapshotPoint(620, True, "finished")
    assert policy.finish_point(last_point=600, num_written=620) is None


def test_the_policy_checks_its_setting() -> None:
    with pytest.raises(ValueError, match="min_gap_tokens"):
        SnapshotPolicy(min_gap_tokens=0)


def test_eviction_goes_orphans_then_superseded_then_lru() -> None:
    ledger = SnapshotLedger(4 * MIB, MIB, eviction="lru")
    for key, tick in ((10, 1), (11, 2), (12, 3), (13, 4)):
        assert ledger.take(key, tick, required=True) == []
        ledger.check_integrity()
    ledger.touch(10, 5)
    ledger.set_superseded(12, True)
    ledger.set_orphan(13, True)
    assert ledger.victims() == [13, 12, 11, 10]
    assert ledger.take(14, 6, required=True) == [13]
    assert ledger.take(15, 6, required=True) == [12]
    assert ledger.take(16, 6, required=True) == [11]
    ledger.check_integrity()
    assert ledger.keys() == [10, 14, 15, 16]
    assert ledger.stats().num_evicted == 3


def test_gdsf_keeps_a_snapshot_many_requests_resumed_from() -> None:
    ledger = SnapshotLedger(2 * MIB, MIB)  # GDSF by default
    ledger.take(1, 1, required=True)  # a document's junction
    for tick in (2, 3, 4):
        ledger.touch(1, tick, hit=True)
    ledger.take(2, 5, required=True)  # a one-off request's end, newer
    # LRU would evict the junction (older); GDSF the one-off end (priority 1 < 4)
    assert ledger.take(3, 6, required=True) == [2]
    # the victim's priority raised the inflation: an unused newcomer now outranks an old hit
    assert ledger.take(4, 7, required=True) == [3]
    assert ledger.stats().num_hits == 3
    ledger.check_integrity()


def test_an_optional_snapshot_is_taken_only_into_free_budget() -> None:
    ledger = SnapshotLedger(2 * MIB + MIB // 2, MIB)
    assert ledger.capacity == 2
    assert ledger.take(1, 1, required=False) == []
    assert ledger.take(2, 2, required=True) == []
    assert ledger.take(3, 3, required=False) is None  # full: not taken, nothing evicted
    assert ledger.keys() == [1, 2] and ledger.stats().num_refused == 1


def test_pinned_snapshots_are_never_victims() -> None:
    ledger = SnapshotLedger(2 * MIB, MIB)
    ledger.take(1, 1, required=True)
    ledger.take(2, 2, required=True)
    ledger.pin(1)
    ledger.pin(1)
    ledger.pin(2)
    assert ledger.take(3, 3, required=True) is None  # all pinned: refused
    ledger.unpin(2)
    ledger.set_orphan(1, True)  # changes while pinned keep it out of the order
    ledger.check_integrity()
    assert ledger.take(3, 3, required=True) == [2]
    ledger.unpin(1)
    assert ledger.victims() == [3]  # 1 was pinned twice, unpinned once: still out
    ledger.unpin(1)
    assert ledger.victims() == [1, 3]  # the orphan first
    ledger.check_integrity()


def test_the_ledger_checks_its_settings() -> None:
    with pytest.raises(ValueError, match="snapshot_bytes"):
        SnapshotLedger(10, 0)
    with pytest.raises(ValueError, match="budget_bytes"):
        SnapshotLedger(-1, 1)
    with pytest.raises(ValueError, match="eviction"):
        SnapshotLedger(10, 1, eviction="fifo")  # type: ignore[arg-type]


class LedgerMachine(RuleBasedStateMachine):
    """Random takes, touches, flags, pins and drops against a dict of plain records, whose
    victim is recomputed from scratch each time."""

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 4
        self.ledger = SnapshotLedger(self.capacity * 100, 100)
        self.model: dict[int, dict] = {}
        self.inflation = 0
        self.tick = 0
        self.next_key = 0

    def _order(self) -> list[int]:
        unpinned = [k for k, e in self.model.items() if e["pins"] == 0]
        return sorted(
            unpinned,
            key=lambda k: (
                not self.model[k]["orphan"],
                not self.model[k]["superseded"],
                self.model[k]["priority"],
                self.model[k]["tick"],
                k,
            ),
        )

    @rule(required=st.booleans())
    def take(self, required: bool) -> None:
        self.tick += 1
        key, self.next_key = self.next_key, self.next_key + 1
        need = len(self.model) + 1 - self.capacity
        order = self._order()
        result = self.ledger.take(key, self.tick, required=required)
        if need > 0 and (not required or need > len(order)):
            assert result is None
            return
        expected = order[: max(need, 0)]
        assert result == expected
        for victim in expected:
            self.inflation = max(self.inflation, self.model.pop(victim)["priority"])
        self.model[key] = {"tick": self.tick, "priority": self.inflation + 1, "uses": 1}
        self.model[key] |= {"orphan": False, "superseded": False, "pins": 0}

    @precondition(lambda self: self.model)
    @rule(data=st.data(), hit=st.booleans())
    def touch(self, data: st.DataObject, hit: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.tick += 1
        self.ledger.touch(key, self.tick, hit=hit)
        entry = self.model[key]
        entry["tick"], entry["uses"] = self.tick, entry["uses"] + hit
        entry["priority"] = self.inflation + entry["uses"]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), flag=st.sampled_from(["orphan", "superseded"]), value=st.booleans())
    def mark(self, data: st.DataObject, flag: str, value: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        if flag == "orphan":
            self.ledger.set_orphan(key, value)
        else:
            self.ledger.set_superseded(key, value)
        self.model[key][flag] = value

    @precondition(lambda self: self.model)
    @rule(data=st.data(), pin=st.booleans())
    def pin_or_unpin(self, data: st.DataObject, pin: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        if pin:
            self.ledger.pin(key)
            self.model[key]["pins"] += 1
        elif self.model[key]["pins"]:
            self.ledger.unpin(key)
            self.model[key]["pins"] -= 1

    @precondition(lambda self: any(e["pins"] == 0 for e in self.model.values()))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k, e in self.model.items() if not e["pins"])))
        self.ledger.drop(key)
        del self.model[key]

    @invariant()
    def agrees(self) -> None:
        self.ledger.check_integrity()
        assert self.ledger.keys() == sorted(self.model)
        assert self.ledger.victims() == self._order()
        assert len(self.ledger) * 100 <= self.capacity * 100


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
