"""Smoke test of the cache benchmark: the quick traces through the shared driver, both caches.

No timing assertions: only what must hold whatever the machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.cache_bench import (
    ADAPTERS,
    RunResult,
    Trace,
    capacity_blocks,
    make_traces,
    run_trace,
)

TRACES = {t.name: t for t in make_traces(seed=0, quick=True)}


def _check_accounting(result: RunResult) -> None:
    """The driver's hit count agrees with the cache's own statistics (minus acquisitions undone
    because the allocation did not fit, and reply tokens admitted with their prompt), and every
    prompt token is either cached or computed."""
    adapter = result.adapter
    stats = adapter.cache.stats()
    assert result.num_computed_tokens + result.num_cached_tokens == result.num_prompt_tokens
    queries = stats.num_query_tokens - adapter.num_reply_tokens_admitted
    assert queries - adapter.aborted_query_tokens == result.num_prompt_tokens
    assert stats.num_hit_tokens - adapter.aborted_hit_tokens == result.num_cached_tokens
    assert stats.num_evicted_blocks == result.num_evicted_blocks
    assert 0 <= result.num_cached_tokens < result.num_prompt_tokens


@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_driver_under_pressure(trace_name: str, block_size: int, fraction: float) -> None:
    trace = TRACES[trace_name]
    num_blocks = capacity_blocks(trace, block_size, fraction, window=4)
    # run_trace ends with each adapter's check_idle(): integrity holds and no block is leaked.
    results = {
        name: run_trace(trace, name, block_size, num_blocks, capacity_fraction=fraction, window=4)
        for name in ADAPTERS
    }
    for result in results.values():
        _check_accounting(result)
    radix, flat = results["radixkv"], results["flat"]
    # (Hit-rate goals against the baselines are the benchmark's to report, cell by cell.)
    if trace_name == "no-sharing":
        assert radix.num_cached_tokens == flat.num_cached_tokens == 0


def _oracle_hits(trace: Trace, block_size: int) -> tuple[list[int], list[int]]:
    """Per request, with nothing ever evicted and one request at a time: the token-granular hit
    (longest common prefix with an earlier written sequence, at most len(prompt) - 1) and the
    block-aligned hit of a map of full blocks."""
    written: list[np.ndarray] = []
    token_hits, block_hits = [], []
    for request in trace.requests:
        prompt = request.prompt
        cap = len(prompt) - 1
        best = 0
        for seq in written:
            n = min(cap, len(seq))
            diff = np.flatnonzero(seq[:n] != prompt[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        token_hits.append(best)
        block_hits.append(best // block_size * block_size)
        written.append(request.written)
    return token_hits, block_hits


@pytest.mark.parametrize("trace_name", ["chat", "few-shot", "branching"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_hits_match_oracle_without_eviction(trace_name: str, block_size: int) -> None:
    trace = TRACES[trace_name]
    num_blocks = 2 * capacity_blocks(trace, block_size, 1.0, window=1)
    token_hits, block_hits = _oracle_hits(trace, block_size)
    expected_hits = {"radixkv": token_hits, "token": token_hits}
    expected_hits.update(flat=block_hits, page=block_hits)
    for name, expected in expected_hits.items():
        result = run_trace(trace, name, block_size, num_blocks, window=1)
        assert result.num_evicted_blocks == 0
        assert result.num_stalls == 0
        assert result.num_cached_tokens == sum(expected), name
        _check_accounting(result)
    # Token-granular matching loses nothing to alignment: strictly more hits when prefixes end
    # mid-block, which every one of these traces has.
    assert sum(token_hits) > sum(block_hits)
