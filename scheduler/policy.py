"""Waiting-queue order: a tiny strategy the scheduler asks once per step.

The queue handed in is in FCFS order (arrival, with preempted requests put back at the front).
A policy returns the order in which the scheduler tries to admit; admission stops at the first
request that does not fit, so a policy decides who goes first, never who is skipped.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from radixkv.cache.grouped import GroupedCache
from radixkv.scheduler.request import Request


class FcfsPolicy:
    """First come, first served: the queue order itself. The base of every policy."""

    def order(self, waiting: Collection[Request], cache: GroupedCache | None) -> Iterable[Request]:
        """Admission order of `waiting`. `cache` is None when prefix caching is off. Must not
        change the cache."""
        return waiting


class LongestPrefixMatchPolicy(FcfsPolicy):
    """Longest cached prefix first (SGLang's "lpm"); ties keep queue order (`sorted` is stable).

    Scored with the cache's read-only `match` (capped like admission: the last token is always
    computed), so scoring neither splits nodes, refreshes recency nor pins anything.
    """

    def order(self, waiting: Collection[Request], cache: GroupedCache | None) -> Iterable[Request]:
        if cache is None or len(waiting) < 2:
            return waiting

        def num_cached_tokens(r: Request) -> int:
            return cache.match(
                r.packed_tokens, max_tokens=r.num_tokens - 1, namespace=r.cache_salt
            ).num_cached_tokens

        return sorted(waiting, key=num_cached_tokens, reverse=True)


# The names a config's `policy` may take (the engine's config checks it is one of them).
POLICIES: dict[str, type[FcfsPolicy]] = {"fcfs": FcfsPolicy, "lpm": LongestPrefixMatchPolicy}
