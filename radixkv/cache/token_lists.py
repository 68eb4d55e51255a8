"""Helpers over token-id lists shared by the scheduler and the chat session."""

from __future__ import annotations


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of `a[:limit]` and `b[:limit]` (no limit: the whole
    lists; both must be lists, since a list slice never equals a tuple).

    List slice equality runs in C: gallop over doubling runs while they agree, then bisect the run
    that differs down to a few tokens. O(result) C work and O(log result) Python steps, so a long
    shared system prompt costs no per-token Python loop.
    """
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    lo, step = 0, 16  # a[:lo] == b[:lo]
    while lo < n:
        hi = min(lo + step, n)
        if a[lo:hi] == b[lo:hi]:
            lo, step = hi, 2 * step
            continue
        while hi - lo > 16:  # the first mismatch lies in [lo, hi)
            mid = (lo + hi) >> 1
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        while a[lo] == b[lo]:
            lo += 1
        return lo
    return lo
