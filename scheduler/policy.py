"""Waiting-queue order: a tiny strategy the scheduler asks once per step.

The queue handed in is in FCFS order (arrival, with preempted requests put back at the front).
A policy returns the order in which the scheduler tries to admit; admission stops at the first
request that does not fit, so a policy decides who goes first, never who is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from radixkv.cache.prefix_cache import PrefixCache
from radixkv.scheduler.request import Request


class SchedulingPolicy(Protocol):
    def order(self, waiting: Sequence[Request], cache: PrefixCache | None) -> Iterable[Request]:
        """Admission order of `waiting`. `cache` is None when prefix caching is off.
        Must not change the cache."""
        ...


class FcfsPolicy:
    """First come, first served: the queue order itself."""

    def order(self, waiting: Sequence[Request], cache: PrefixCache | None) -> Iterable[Request]:
        return iter(waiting)


class LongestPrefixMatchPolicy:
    """Longest cached prefix first (SGLang's "lpm"); ties keep queue order.

    Scored with the cache's read-only `match` (capped like admission: the last token is always
    computed), so scoring neither splits nodes, refreshes recency nor pins anything.
    """

    def order(self, waiting: Sequence[Request], cache: PrefixCache | None) -> Iterable[Request]:
        if cache is None or len(waiting) < 2:
            return iter(waiting)
        scored = [
            (
                -cache.match(
                    r.all_token_ids, max_tokens=r.num_tokens - 1, namespace=r.cache_salt
                ).num_cached_tokens,
                i,
                r,
            )
            for i, r in enumerate(waiting)
        ]
        scored.sort(key=lambda s: (s[0], s[1]))
        return [r for _, _, r in scored]


def make_policy(name: str) -> SchedulingPolicy:
    if name == "fcfs":
        return FcfsPolicy()
    if name == "lpm":
        return LongestPrefixMatchPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}")
