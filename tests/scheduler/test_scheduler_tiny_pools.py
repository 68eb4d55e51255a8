"""A pool that fits each request alone completes every request (issue 11, F2).

A hit that ends mid-block is copied into a private block while the request's lock keeps the
original pinned, so such a request can hold one block more than its tokens need. Here pools are
as small as the largest request allows; the fake model is deterministic, so a request's output
equals the one it gets alone in a huge pool (`Harness.reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.scheduler.request import Request

MakeHarness = Callable[..., Any]


def blocks_needed(req: Request, block_size: int, max_model_len: int) -> int:
    """Blocks of the request's longest KV (the last token of a finished sequence has none)."""
    return -(-(req.max_num_tokens(max_model_len) - 1) // block_size)


@st.composite
def tiny_pool_runs(draw: st.DrawFn) -> dict[str, Any]:
    prefixes = draw(st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=40), min_size=1))
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, len(prefixes) - 1),  # shared prefix
                st.lists(st.integers(1, 5), max_size=12),  # own suffix
                st.integers(1, 20),  # max_tokens
                st.integers(0, 6),  # arrival step
            ),
            min_size=1,
            max_size=6,
        )
    )
    return {
        "block_size": draw(st.integers(1, 16)),
        "extra_blocks": draw(st.sampled_from([0, 0, 0, 1, 2])),  # 0: the smallest pool that fits
        "chunked_prefill_size": draw(st.integers(1, 24)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "policy": draw(st.sampled_from(["fcfs", "lpm"])),
        "prefill_first": draw(st.booleans()),
        "prefixes": prefixes,
        "requests": requests,
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=tiny_pool_runs())
def test_every_request_completes_in_the_smallest_pool_that_fits(
    harness: MakeHarness, run: dict[str, Any]
) -> None:
    B, max_len = run["block_size"], 64
    reqs: dict[int, list[Request]] = {}
    for i, (prefix, suffix, max_tokens, arrival) in enumerate(run["requests"]):
        prompt = (run["prefixes"][prefix] + suffix)[: max_len - 1] or [1]
        reqs.setdefault(arrival, []).append(Request(f"r{i}", prompt, max_tokens))
    everyone = [r for batch in reqs.values() for r in batch]
    num_blocks = max(blocks_needed(r, B, max_len) for r in everyone) + run["extra_blocks"]
    h = harness(
        num_blocks=num_blocks,
        block_size=B,
        chunked_prefill_size=run["chunked_prefill_size"],
        max_num_batched_tokens=32,
        max_num_seqs=run["max_num_seqs"],
        policy=run["policy"],
        max_model_len=max_len,
        prefill_first=run["prefill_first"],
    )
    h.run(max_steps=5_000, arrivals=reqs)
    for req in everyone:
        assert h.finished[req.request_id] is req
        assert req.output_token_ids == h.reference(req), req
    h.assert_no_leak()


def test_partial_hit_in_a_pool_of_exactly_the_request(harness: MakeHarness) -> None:
    """The cases of the issue: block 16 with 3 blocks; block 4, 12 blocks, chunks of 5."""
    for B, num_blocks, chunk in ((16, 3, 512), (4, 12, 5)):
        h = harness(num_blocks=num_blocks, block_size=B, chunked_prefill_size=chunk)
        capacity = num_blocks * B + 1  # the longest sequence whose KV fits the pool
        shared = list(range(1, capacity // 2))
        h.add("a", [*shared, 9, 9, 9], max_tokens=1, ignore_eos=True)
        h.run()
        # Hits `shared` mid-block, inside a's node (so the original block stays on the locked
        # path after the split), then generates up to the last slot of the pool.
        prompt = [*shared, 7, 7, 7]
        b = h.add("b", prompt, max_tokens=capacity - len(prompt), ignore_eos=True)
        h.run()
        assert h.finished["b"].output_token_ids == h.reference(b)
        assert b.num_cached_tokens > 0
        h.assert_no_leak()
