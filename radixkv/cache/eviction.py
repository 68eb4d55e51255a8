"""The set of evictable tree nodes (unlocked leaves), ordered by an eviction policy's sort key.

A policy is a tiny function from a node to a sort key; the smallest key is evicted first. The
default, `lru_key`, orders by `(last_access_tick, node_id)`: ticks come from the cache's logical
clock and the node id breaks ties, so the order is fully deterministic. A node's key is computed
when it joins the set and stored on the node (`evict_key`). A key must not change while the node is
a member, which holds for LRU: a node's tick only changes when it is locked, and a locked node is
never a member.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from sortedcontainers import SortedList


class EvictableNode(Protocol):
    """What the index reads and writes of a tree node (the tree's nodes satisfy it)."""

    node_id: int
    tick: int
    evict_key: Any


EvictionKey = Callable[[EvictableNode], Any]


def lru_key(node: EvictableNode) -> tuple[int, int]:
    """Least recently used first; the older node (smaller id) first among equal ticks."""
    return (node.tick, node.node_id)


class EvictionIndex:
    """Sorted set of evictable nodes; O(log n) add, remove and pop of the first.

    The keys alone are kept sorted and a dict maps each key to its node, so the sorted list never
    compares nodes. Keys must be unique; LRU's include the node id.
    Invariant: `node.evict_key is not None` iff the node is a member, and then it is the key the
    node is stored under.
    """

    __slots__ = ("_keys", "_nodes", "key")

    def __init__(self, key: EvictionKey = lru_key) -> None:
        self.key = key
        self._keys: SortedList = SortedList()
        self._nodes: dict[Any, EvictableNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[EvictableNode]:
        """Members in eviction order (first = next victim)."""
        return (self._nodes[k] for k in self._keys)

    def add(self, node: EvictableNode) -> None:
        assert node.evict_key is None, f"node {node.node_id} is already evictable"
        k = self.key(node)
        assert k not in self._nodes, f"eviction key {k!r} of node {node.node_id} is not unique"
        node.evict_key = k
        self._keys.add(k)
        self._nodes[k] = node

    def discard(self, node: EvictableNode) -> None:
        """Remove `node` if it is a member."""
        k = node.evict_key
        if k is not None:
            self._keys.remove(k)
            del self._nodes[k]
            node.evict_key = None

    def first(self) -> EvictableNode:
        """The next victim (the set must not be empty)."""
        return self._nodes[self._keys[0]]

    def pop_first(self) -> EvictableNode:
        """Remove and return the next victim (the set must not be empty)."""
        node = self._nodes.pop(self._keys.pop(0))
        node.evict_key = None
        return node

    def items(self) -> list[tuple[Any, EvictableNode]]:
        """(key, node) pairs in eviction order, for integrity checks and displays."""
        return [(k, self._nodes[k]) for k in self._keys]
