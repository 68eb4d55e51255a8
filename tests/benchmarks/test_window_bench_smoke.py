"""Smoke test of the window benchmark: what must hold whatever the machine (no timings here)."""

from __future__ import annotations

import pytest

from benchmarks.cache_bench import doc_qa_trace
from benchmarks.window_bench import NUM_LAYERS, NUM_WINDOW_LAYERS, WINDOW, run_capacity, run_request


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_a_running_request_holds_its_full_kv_and_one_window(block_size: int) -> None:
    r = run_request(block_size, chunk=512, num_prompt=2048, num_decode=64)
    n = 2048 + 64
    full_blocks = -(-n // block_size)
    window_blocks = -(-WINDOW // block_size) + 1  # at most: the window plus a block it starts in
    bound = (full_blocks + NUM_WINDOW_LAYERS * window_blocks) / (NUM_LAYERS * full_blocks)
    floor = (n + NUM_WINDOW_LAYERS * (WINDOW - 1)) / (NUM_LAYERS * n)
    assert floor - 0.01 <= r.end_ratio <= bound
    assert r.end_ratio <= r.peak_ratio < 1


def test_capacity_runs_at_equal_bytes() -> None:
    trace = doc_qa_trace(0, num_documents=4, num_requests=24, doc_len=(1500, 3000))
    c = run_capacity(trace, 16, 0.45, 512)
    assert c.servable_all_full > 0 and c.hits_hybrid > 0
    assert c.servable_hybrid > c.servable_all_full  # the same bytes hold more servable prefix
