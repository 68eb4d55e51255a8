"""Smoke test of the snapshot simulation: the model tree's invariants after every request of the
quick traces under every placement, and what each placement must do by its own rule."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import snapshot_bench as bench
from benchmarks.snapshot_sim import (
    FullAttention,
    GridPlacement,
    PerNodePlacement,
    RadixkvPlacement,
    Request,
    SimTree,
    simulate,
    working_set_tokens,
)
from radixkv.cache.snapshots import SnapshotPolicy

TRACES = {t.name: t for t in bench.traces(seed=0, quick=True)}
SNAPSHOT = 100  # bytes of a snapshot, with one byte of KV per token: small caches stay busy


def _requests(name: str) -> list[Request]:
    return [Request(r.tokens, r.num_prompt_tokens) for r in TRACES[name].requests]


def _run(name: str, placement, share: float = 0.3, **kw):
    requests = _requests(name)
    total = working_set_tokens(requests) // 2
    return simulate(
        requests,
        placement,
        total_bytes=total,
        snapshot_budget=int(share * total),
        kv_bytes_per_token=1,
        snapshot_bytes=SNAPSHOT,
        check_every=1,  # the tree, the ledger and their agreement after every request
        **kw,
    )


PLACEMENTS = {
    "radixkv": lambda: RadixkvPlacement(SnapshotPolicy(), 512),
    "grid": lambda: GridPlacement(528),
    "per-node": lambda: PerNodePlacement(8192),
    "full": lambda: FullAttention(),
}


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_keeps_the_model_consistent(trace: str, placement: str) -> None:
    radixkv = placement == "radixkv"
    result = _run(
        trace, PLACEMENTS[placement](), supersede=radixkv, eviction="gdsf" if radixkv else "lru"
    )
    assert 0 <= result.served < result.num_prompt_tokens
    assert result.peak_snapshot_bytes <= result.snapshot_budget
    if placement == "grid":
        assert result.served % 528 == 0  # every hit resumes on the grid
    if placement == "full":
        assert result.num_taken == 0 and result.snapshot_budget == 0


def test_radixkv_serves_the_short_prompts_a_grid_cannot() -> None:
    ours = _run("agent", PLACEMENTS["radixkv"](), supersede=True, eviction="gdsf")
    grid = _run("agent", PLACEMENTS["grid"]())
    assert ours.served_short > 2 * grid.served_short
    assert ours.num_hits > 0


def test_a_document_asked_about_again_resumes_where_the_prompts_diverged() -> None:
    # the doc-QA trace: SGLang's per-node snapshots sit at prompt and request ends, which no
    # other question shares; radixkv's divergence snapshot is at the document's end
    ours = _run("doc-qa", PLACEMENTS["radixkv"](), supersede=True, eviction="gdsf")
    per_node = _run("doc-qa", PLACEMENTS["per-node"]())
    assert per_node.served == 0 and ours.served > 0


def test_the_tree_splits_at_snapshot_points_and_evicts_dead_leaves_first() -> None:
    tree = SimTree(dead_first=True)
    a = np.arange(10, dtype=np.int32)
    at = tree.insert(a, [4, 10], tick=1)
    assert sorted(at) == [4, 10] and at[4].end == 4 and at[10].end == 10
    tree.set_snapshot(at[10], True)
    b = np.concatenate([a[:6], np.arange(100, 104, dtype=np.int32)])  # diverges at 6
    tree.insert(b, [], tick=2)  # newer, but no snapshot at its end: dead KV
    tree.check_integrity()
    path, matched = tree.match(b)
    assert matched == 10 and [n.end for n in path] == [4, 6, 10]
    evicted = tree.evict_to(tree.num_tokens - 1)
    assert [n.end for n in evicted] == [10] and evicted[0].tokens.tolist() == [100, 101, 102, 103]
    tree.check_integrity()
    assert tree.match(b)[1] == 6 and tree.match(a)[1] == 10


def test_the_bench_prints_its_goals(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--capacity", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "(d) all full attention" in out and "Goals (issue 40)" in out
    assert out.count("at 1.00 of its working set") == len(TRACES)
