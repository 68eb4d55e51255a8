"""fleet_bench's table: each policy is compared with the one-replica run nearest in time, so
that interleaved runs (`one-replica A one-replica B`) cancel the drift of a shared machine."""

from __future__ import annotations

from benchmarks.fleet_bench import Result, nearest_baseline, report


def result(policy: str, tok_s: float, system: bool = True) -> Result:
    return Result(policy, system, 32, 1000, 800, int(tok_s * 10), 10.0, [16, 16], 1000, 800, 2.5)


def test_each_policy_is_compared_with_the_nearest_one_replica_run() -> None:
    runs = [
        result("one-replica", 10.0),
        result("vllm-kv-aware", 19.0),
        result("one-replica", 5.0),
        result("round-robin", 9.0),
        result("one-replica", 4.0, system=False),
    ]
    assert [nearest_baseline(runs, i) for i in range(5)] == [
        runs[0],
        runs[0],
        runs[2],
        runs[2],
        runs[4],
    ]
    rows = report(runs).splitlines()[2:]
    assert "| 19.0 | 1.90x | 2.5 |" in rows[1]  # against the run before it, not the last
    assert "| 9.0 | 1.80x | 2.5 |" in rows[3]
