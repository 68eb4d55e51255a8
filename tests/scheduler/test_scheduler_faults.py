"""A fault anywhere in a step, inside the scheduler's own cache calls included, leaves the scheduler
consistent: `fail_step()` (plus aborting the step's rows, for a fault after the update began, as
the engine does) fails what the step touched and returns every block and lock; the other requests
then finish with the output they would have had alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from radixkv.scheduler.request import RequestStatus

# The tree group's calls of schedule() (admission, growth, preemption) and of update_from_output(),
# and the allocation inside admit and grow (after admit has locked its hit); "forward" is a fault
# between the two, in the model.
POINTS = ("match", "admit", "_allocate", "grow", "commit", "close", "forward")


class Injected(Exception):
    pass


def test_fail_step_without_a_step_fails_nothing(harness: Callable[..., Any]) -> None:
    h = harness()
    h.add("a", [1, 2, 3])
    assert h.scheduler.fail_step() == []
    h.run()
    assert h.finished["a"].output_token_ids == h.reference(h.finished["a"])
    h.assert_no_leak()


@pytest.mark.parametrize("seed", range(70))
def test_a_fault_anywhere_fails_only_what_its_step_touched(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    # A small pool, so that steps preempt and insert as well as admit.
    h = harness(num_blocks=20, block_size=4, max_num_seqs=3, chunked_prefill_size=6)
    sched = h.scheduler
    shared = [rng.randrange(1, 500) for _ in range(7)]
    reqs = [
        h.add(f"r{i}", shared[: rng.randint(0, 7)] + [500 + i] * rng.randint(1, 9), 6)
        for i in range(6)
    ]
    point, at = POINTS[seed % len(POINTS)], rng.randint(1, 4)
    calls = iter(range(1, 10**6))

    def trip() -> None:
        if next(calls) == at:
            raise Injected(point)

    if point != "forward":
        real = getattr(h.cache.tree, point)

        def faulty(*args: object, **kwargs: object) -> object:
            trip()
            return real(*args, **kwargs)

        monkeypatch.setattr(h.cache.tree, point, faulty)

    failed: set[str] = set()
    while sched.has_unfinished() and not failed:
        out = None
        try:
            out = sched.schedule()
            h.check_output(out)
            h.sim.step(out, sched)
            sampled = {r.request_id: next_token(h, r.request_id) for r in out.rows if r.sample}
            if point == "forward":
                trip()
            for req in sched.update_from_output(out, sampled):
                h.finished[req.request_id] = req
        except Injected:
            failed = {req.request_id for req in sched.fail_step()}
            if out is not None:  # like the engine: a fault inside the update leaves none pending
                for row in out.rows:
                    sched.abort(row.request_id)
                failed |= {row.request_id for row in out.rows}
        sched.check_integrity()
    assert failed, f"the fault in {point} never fired"
    monkeypatch.undo()

    h.run()
    for req in reqs:
        if req.request_id in failed:
            assert req.is_finished and sched.get_request(req.request_id) is None, req
        else:
            assert h.finished[req.request_id].output_token_ids == h.reference(req)
    # A commit or a close can fault inside the update only, where nothing is pending to fail.
    errors = any(r.status is RequestStatus.FINISHED_ERROR for r in reqs)
    assert errors or point in ("commit", "close")
    h.assert_no_leak()


def next_token(h: Any, request_id: str) -> int:
    """The fake model's next token for a request: the one it generates when run alone."""
    req = h.scheduler.get_request(request_id)
    return h.reference(req)[len(req.output_token_ids)]


def test_a_fault_releasing_a_preempted_request_fails_it_too(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while a victim's table is closed (it has left the running set and is not yet
    waiting): `fail_step()` still finds it, fails it and returns its lock and blocks."""
    # Three requests decoding side by side in 14 blocks: the eighth step preempts r2.
    h = harness(num_blocks=14, block_size=4, max_num_batched_tokens=64)
    reqs = [
        h.add(f"r{i}", [i + 1, *range(40 * i + 100, 40 * i + 109)], max_tokens=m)
        for i, m in enumerate((9, 14, 14))
    ]
    for _ in range(7):
        h.step()
    assert h.scheduler.num_running == 3 and not any(o.preempted_ids for o in h.outputs)

    def faulty(*args: object, **kwargs: object) -> None:
        raise Injected("close")

    monkeypatch.setattr(h.cache, "close", faulty)
    with pytest.raises(Injected):
        h.scheduler.schedule()
    monkeypatch.undo()
    failed = h.scheduler.fail_step()
    assert sorted(r.request_id for r in failed) == ["r0", "r1", "r2"]
    assert all(r.status is RequestStatus.FINISHED_ERROR for r in reqs)
    h.assert_no_leak()


def test_a_fault_releasing_a_finished_request_leaks_nothing(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while the update closes the table of a request that just finished: aborting the
    step's rows
    (as the engine does after a fault inside the update) still returns its lock and blocks."""
    h = harness(num_blocks=16, block_size=4)
    a, b = h.add("a", [1, 2, 3, 4, 5], max_tokens=1), h.add("b", [7, 8, 9], max_tokens=3)
    sched = h.scheduler
    out = sched.schedule()
    assert [r.request_id for r in out.rows] == ["a", "b"]

    def faulty(*args: object, **kwargs: object) -> None:
        raise Injected("close")

    monkeypatch.setattr(h.cache, "close", faulty)
    sampled = {r.request_id: next_token(h, r.request_id) for r in out.rows}
    with pytest.raises(Injected):
        sched.update_from_output(out, sampled)  # `a` finishes: its table is closed first
    monkeypatch.undo()
    assert sched.fail_step() == []  # the update had begun: nothing is pending
    for row in out.rows:
        sched.abort(row.request_id)
    assert a.is_finished and b.status is RequestStatus.FINISHED_ABORTED
    h.assert_no_leak()


def test_an_abort_whose_release_faults_leaves_the_request_live(
    harness: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while an abort closes a running request's table: the request stays where it was,
    holding its table, so a later abort (or `fail_step`) still returns its lock and blocks."""
    h = harness(num_blocks=16, block_size=4)
    a = h.add("a", [1, 2, 3, 4, 5], max_tokens=4)
    h.step()

    def faulty(*args: object, **kwargs: object) -> None:
        raise Injected("close")

    monkeypatch.setattr(h.cache, "close", faulty)
    with pytest.raises(Injected):
        h.scheduler.abort("a")
    monkeypatch.undo()
    assert h.scheduler.get_request("a") is a and a.status is RequestStatus.RUNNING
    h.scheduler.check_integrity()
    assert h.scheduler.abort("a")
    assert a.status is RequestStatus.FINISHED_ABORTED
    h.assert_no_leak()
