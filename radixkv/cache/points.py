"""Points on token prefixes: what a group keeps at the end of an exact prefix, and the lookup
that finds a prompt's deepest one.

A group that resumes a prompt only where it kept something (the window group's tails, the state
group's snapshots) keys each kept thing by the exact prefix it ends: (namespace, number of
tokens, xxh3-128 of the packed tokens), `point_key`. `PointEnds` holds the kept ends per
namespace, sorted, so that a lookup hashes a prompt once, taking the digest at each kept end on
the way (`PointEnds.keys_upto`); the group compares the kept tokens before it serves a hit.
Apart from the tree: a point never pins a node, and a prefix the tree evicts and later caches
again is served again at once.
"""

from __future__ import annotations

import xxhash
from sortedcontainers import SortedList

from radixkv.cache.tokens import TOKEN_BYTES

# (namespace, tokens, xxh3-128 of their packed bytes)
PointKey = tuple[str | None, int, int]


def point_key(namespace: str | None, qb: bytes, num_tokens: int) -> PointKey:
    """The key of the point after `num_tokens` tokens of the packed tokens `qb`."""
    return (namespace, num_tokens, xxhash.xxh3_128_intdigest(qb[: TOKEN_BYTES * num_tokens]))


class PointEnds:
    """The ends of the points a group keeps, per namespace, sorted (one entry per point)."""

    def __init__(self) -> None:
        self._ends: dict[str | None, SortedList] = {}

    def add(self, namespace: str | None, end: int) -> None:
        self._ends.setdefault(namespace, SortedList()).add(end)

    def remove(self, namespace: str | None, end: int) -> None:
        ends = self._ends[namespace]
        ends.remove(end)
        if not ends:
            del self._ends[namespace]

    def clear(self) -> None:
        self._ends.clear()

    def keys_upto(self, qb: bytes, upto: int, namespace: str | None) -> list[PointKey]:
        """The keys the kept ends <= `upto` of `namespace` would have on the packed tokens
        `qb`, deepest first. Mutates nothing; O(upto + kept ends up to it): one hash over the
        prompt, a digest at each end."""
        ends = self._ends.get(namespace)
        if not ends:
            return []
        hasher, done = xxhash.xxh3_128(), 0
        keys = []
        for end in ends.irange(maximum=upto):
            if end != done:
                hasher.update(qb[TOKEN_BYTES * done : TOKEN_BYTES * end])
                done = end
                keys.append((namespace, end, hasher.intdigest()))
        keys.reverse()
        return keys

    def as_dict(self) -> dict[str | None, list[int]]:
        """namespace -> its ends, sorted (for integrity checks)."""
        return {ns: list(ends) for ns, ends in self._ends.items()}
