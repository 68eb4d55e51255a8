"""Smoke test of the live page's snapshot benchmark: a small tree through the same code.

No timing assertions: only what must hold whatever the machine.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from benchmarks.view_bench import build_tree, run, snapshot
from radixkv.serve.cache_view import MAX_NODES


def test_the_tree_has_the_size_asked_and_the_snapshot_is_bounded() -> None:
    cache, prompt = build_tree(1_000)
    cache.check_integrity()
    num_nodes = cache.stats().num_nodes
    assert 950 <= num_nodes <= 1_050
    _, _, text = snapshot(cache, prompt, None)
    tree = json.loads(text)["tree"]
    assert len(tree["nodes"]) == MAX_NODES + 1  # and the root
    assert tree["num_nodes"] == num_nodes
    listed = len(tree["nodes"]) - 1
    assert listed + sum(f["nodes"] for f in tree["folded"]) == num_nodes
    assert len(tree["path"]) == 2 and tree["path_tokens"] == len(prompt)


def test_run_times_every_snapshot() -> None:
    timing = run(200, repeats=3)
    assert len(timing.summary_ms) == len(timing.payload_ms) == 3
    assert all(t > 0 for t in timing.summary_ms + timing.payload_ms)
