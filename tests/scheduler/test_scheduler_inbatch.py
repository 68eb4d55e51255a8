"""In-batch prefix caching: a waiting request whose prompt prefix a request admitted earlier in the
same step is computing waits one step and then hits the cache (`defer_shared_prefix_tokens`).

Every `Harness.step` checks the rows, the reference KV simulation and `check_integrity()`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from radixkv.cache.tokens import PackedTokens, shares_prefix
from radixkv.cache.tokens import common_prefix_len as _common_prefix_len

MakeHarness = Callable[..., Any]  # the `harness` fixture of conftest.py
Harness = Any

SYSTEM = [7 + (i * 37) % 900 for i in range(188)]  # a 188-token "system prompt"


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def conversation(i: int, shared: list[int] = SYSTEM) -> list[int]:
    """The shared prefix + 20 tokens of this conversation's own (distinct from the first)."""
    return [*shared, *seq(1000 * (i + 1), 20)]


def num_prefill_tokens(h: Harness) -> int:
    """Prompt tokens computed over the whole run (a cache hit is not computed)."""
    total = 0
    for out in h.outputs:
        for row in out.rows:
            num_prompt = h.finished[row.request_id].num_prompt_tokens
            end = row.start_position + len(row.token_ids)
            total += max(0, min(end, num_prompt) - row.start_position)
    return total


def first_step(h: Harness, request_id: str) -> int:
    return next(
        i for i, o in enumerate(h.outputs) if any(r.request_id == request_id for r in o.rows)
    )


# ---------------------------------------------------------------- the common-prefix helper


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 47, 48, 100, 1000, 5000])
def test_common_prefix_len_finds_the_first_mismatch(n: int) -> None:
    rng = random.Random(n)
    base = [rng.randrange(1, 50) for _ in range(n)]
    assert _common_prefix_len(base, list(base), n + 5) == n
    for j in sorted({0, n // 3, n - 17, n - 16, n - 1} & set(range(n))):
        other = list(base)
        other[j] += 1
        assert _common_prefix_len(base, other, n) == j
        assert _common_prefix_len(other, base, j) == j  # the limit stops before the mismatch
        assert _common_prefix_len(base[:j], other, n) == j  # a shorter list ends the prefix
    assert _common_prefix_len(base, base, n // 2) == n // 2


@pytest.mark.parametrize("n", [1, 16, 100, 2500])
def test_shares_prefix_agrees_with_common_prefix_len(n: int) -> None:
    """The yes-or-no compare the deferral uses says `common_prefix_len(a, b) >= k`, lengths
    included, for every k around a mismatch and past either end."""
    rng = random.Random(n)
    base = [rng.randrange(1, 2**32) for _ in range(n)]
    for j in sorted({0, n // 2, n - 1}):
        other = list(base)
        other[j] ^= 1 << 31  # a difference in the last byte of a little-endian id, or the first
        for a, b in ((base, other), (base, base[:j]), (other[: n // 2], base), (base, base)):
            lcp = _common_prefix_len(a, b)
            for k in {0, 1, lcp - 1, lcp, lcp + 1, len(a), len(b), len(a) + 1}:
                if k >= 0:
                    assert shares_prefix(PackedTokens(a), PackedTokens(b), k) == (lcp >= k), (j, k)


# ---------------------------------------------------------------- the shared prompt computed once


@pytest.mark.parametrize("defer", [32, 0])
def test_shared_prefix_computed_once(harness: MakeHarness, defer: int) -> None:
    """Four conversations arrive together sharing a 188-token system prompt. With deferral the
    first computes it and the other three, one step later, hit it: 188 + 4 x 20 prompt tokens are
    computed instead of 4 x 208, and the outputs are the same."""
    outputs = {}
    for d in (defer, 32 - defer):
        h = harness(num_blocks=128, block_size=16, defer_shared_prefix_tokens=d)
        reqs = [h.add(f"c{i}", conversation(i), max_tokens=5) for i in range(4)]
        out = h.step()
        assert [r.request_id for r in out.rows] == (["c0"] if d else ["c0", "c1", "c2", "c3"])
        assert [r.request_id for r in h.scheduler.waiting_requests] == (
            ["c1", "c2", "c3"] if d else []
        )
        h.run()
        outputs[d] = [r.output_token_ids for r in reqs]
        assert all(r.output_token_ids == h.reference(r) for r in reqs)
        if d:
            assert num_prefill_tokens(h) == 188 + 4 * 20
            assert [first_step(h, r.request_id) for r in reqs] == [0, 1, 1, 1]
            assert [r.num_cached_tokens for r in reqs] == [0, 188, 188, 188]
            # 188 = 11 full blocks + 12 tokens: each hit copies the partial block on write.
            assert [c.num_slots for c in h.outputs[1].plan(0).copies] == [12, 12, 12]
        else:
            assert num_prefill_tokens(h) == 4 * 208
            assert [first_step(h, r.request_id) for r in reqs] == [0, 0, 0, 0]
        h.assert_no_leak()
    assert outputs[32] == outputs[0]


@pytest.mark.parametrize(
    ("num_shared", "warm", "threshold", "deferred"),
    [
        (31, 0, 32, False),  # shares less than the threshold: computed twice, no wait
        (33, 0, 32, True),  # the hit is capped at len - 1 = 32: exactly the threshold
        (32, 0, 32, False),  # capped at 31 (the last prompt token is always computed)
        (61, 20, 40, True),  # 20 cached already: waiting gains 60 - 20 = 40
        (61, 20, 41, False),  # ... which is not 41
        (60, 0, 1, True),
        (60, 0, 0, False),  # 0: off
    ],
)
def test_defers_only_for_a_gain_of_at_least_the_threshold(
    harness: MakeHarness, num_shared: int, warm: int, threshold: int, deferred: bool
) -> None:
    h = harness(num_blocks=64, block_size=4, defer_shared_prefix_tokens=threshold)
    shared = seq(1, num_shared)
    if warm:
        h.add("warm", [*shared[:warm], 500], max_tokens=1)
        h.run()
    a = h.add("a", [*shared, 600], max_tokens=3)
    b = h.add("b", shared, max_tokens=3)  # its hit is capped at num_shared - 1
    out = h.step()
    assert [r.request_id for r in out.rows] == (["a"] if deferred else ["a", "b"])
    h.run()
    assert b.num_cached_tokens == (num_shared - 1 if deferred else warm)
    assert a.output_token_ids == h.reference(a) and b.output_token_ids == h.reference(b)
    h.assert_no_leak()


def test_no_deferral_with_the_cache_off(harness: MakeHarness) -> None:
    h = harness(num_blocks=128, block_size=16, enable_prefix_cache=False)
    reqs = [h.add(f"c{i}", conversation(i), max_tokens=3) for i in range(4)]
    assert len(h.step().rows) == 4
    h.run()
    assert all(r.output_token_ids == h.reference(r) for r in reqs)
    h.assert_no_leak()


# ---------------------------------------------------------------- the admission rule


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_deferral_is_not_a_failure_to_fit_and_keeps_the_seat(
    harness: MakeHarness, policy: str
) -> None:
    """a and b share a prompt, c and d share nothing. b is deferred; admission goes on with c (an
    unrelated request loses no step), and b keeps its seat among max_num_seqs = 3, so d, behind
    it, does not take it: b runs next step and d when a seat frees up."""
    h = harness(num_blocks=128, block_size=16, max_num_seqs=3, policy=policy)
    a = h.add("a", conversation(0), max_tokens=2)
    b = h.add("b", conversation(1), max_tokens=6)
    c = h.add("c", seq(5000, 30), max_tokens=6)
    d = h.add("d", seq(6000, 30), max_tokens=6)
    assert [r.request_id for r in h.step().rows] == ["a", "c"]
    assert [r.request_id for r in h.scheduler.waiting_requests] == ["b", "d"]
    assert {r.request_id for r in h.step().rows} == {"a", "b", "c"}  # a finishes here
    assert b.num_cached_tokens == 188
    h.run()
    assert first_step(h, "d") == 2
    assert all(r.output_token_ids == h.reference(r) for r in (a, b, c, d))
    h.assert_no_leak()


def test_fcfs_still_stops_at_the_first_request_that_does_not_fit(harness: MakeHarness) -> None:
    """Passing over a deferred request does not pass over one that does not fit: "big" waits, and
    so does "small" behind it."""
    h = harness(num_blocks=19, block_size=16, policy="fcfs")
    h.add("a", conversation(0), max_tokens=2)  # 13 blocks
    h.add("b", conversation(1), max_tokens=2)  # deferred
    h.add("big", seq(5000, 100), max_tokens=2)  # 7 blocks: do not fit beside a
    h.add("small", seq(6000, 10), max_tokens=2)  # 1 block: would fit
    assert [r.request_id for r in h.step().rows] == ["a"]
    assert [r.request_id for r in h.step().rows] == ["a", "b"]
    assert [r.request_id for r in h.scheduler.waiting_requests] == ["big", "small"]
    h.run()
    assert h.finished["b"].num_cached_tokens == 188
    assert all(r.output_token_ids == h.reference(r) for r in h.finished.values())
    h.assert_no_leak()


def test_deferred_request_does_not_wait_for_an_aborted_one(harness: MakeHarness) -> None:
    """a is aborted before its chunk is inserted: b, deferred behind it, is admitted next step
    anyway (nothing was admitted before it then) and computes the prefix itself."""
    h = harness(num_blocks=128, block_size=16)
    h.add("a", conversation(0), max_tokens=3)
    b = h.add("b", conversation(1), max_tokens=3)
    h.step(in_flight=lambda: h.scheduler.abort("a"))
    out = h.step()
    assert [r.request_id for r in out.rows] == ["b"] and b.num_cached_tokens == 0
    h.run()
    assert b.output_token_ids == h.reference(b)
    h.assert_no_leak()


def test_chunked_shared_prefix_is_computed_once(harness: MakeHarness) -> None:
    """Chunks of 64 < the 188-token prefix: the others defer behind c0's prefill chunks, running
    or just admitted, until their hit has caught up within the threshold, so the prefix is
    computed once (n choices of a long prompt); every request runs."""
    totals = {}
    for defer in (32, 0):
        h = harness(
            num_blocks=128, block_size=16, chunked_prefill_size=64, defer_shared_prefix_tokens=defer
        )
        reqs = [h.add(f"c{i}", conversation(i), max_tokens=4) for i in range(4)]
        h.run()
        assert all(r.output_token_ids == h.reference(r) for r in reqs)
        totals[defer] = num_prefill_tokens(h)
        if defer:
            # c1, c2, c3 wait for c0's chunks and come in with its whole prefix cached.
            assert [first_step(h, r.request_id) for r in reqs] == [0, 3, 3, 3]
            assert [r.num_cached_tokens for r in reqs] == [0, 188, 188, 188]
        h.assert_no_leak()
    assert totals[0] == 4 * 208 and totals[32] == 4 * 208 - 3 * 188
