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


class TreeNode(Protocol):
    """What the index reads of a tree node (the tree's nodes satisfy it)."""

    node_id: int
    tick: int
    evict_key: Any


EvictionKey = Callable[[TreeNode], Any]


_NODE_ID_BITS = 64  # node ids are a counter: they never reach 2**64


def lru_key(node: TreeNode) -> int:
    """Least recently used first; the older node (smaller id) first among equal ticks.

    The pair (tick, node_id) packed into one int, ordered exactly like the tuple (node ids stay
    below 2**64): a sorted set of ints compares faster than one of tuples, and the index is
    touched on every acquire and release.
    """
    return node.tick << _NODE_ID_BITS | node.node_id


class EvictionIndex:
    """Sorted set of evictable nodes; O(log n) add, remove and peek at the first.

    The keys alone are kept sorted and a dict maps each key to its node (sorting `(key, node)`
    entries compared tuples on every step). Keys must be unique; LRU's include the node id.
    Invariant: `node.evict_key is not None` iff the node is a member, and then it is the key the
    node is stored under.
    """

    __slots__ = ("_keys", "_nodes", "key")

    def __init__(self, key: EvictionKey = lru_key) -> None:
        self.key = key
        self._keys: SortedList = SortedList()
        self._nodes: dict[Any, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __bool__(self) -> bool:
        return bool(self._nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        """Members in eviction order (first = next victim)."""
        nodes = self._nodes
        return (nodes[k] for k in self._keys)

    def add(self, node: TreeNode) -> None:
        assert node.evict_key is None, f"node {node.node_id} is already evictable"
        k = self.key(node)
        assert k not in self._nodes, f"eviction key {k!r} of node {node.node_id} is not unique"
        node.evict_key = k
        self._keys.add(k)
        self._nodes[k] = node

    def discard(self, node: TreeNode) -> None:
        """Remove `node` if it is a member."""
        k = node.evict_key
        if k is not None:
            self._keys.remove(k)
            del self._nodes[k]
            node.evict_key = None

    def first(self) -> TreeNode:
        """The next victim (the set must not be empty)."""
        return self._nodes[self._keys[0]]

    def pop_first(self) -> TreeNode:
        """Remove and return the next victim (the set must not be empty); cheaper than
        `discard(first())`, which searches for the key it just read."""
        node = self._nodes.pop(self._keys.pop(0))
        node.evict_key = None
        return node

    def items(self) -> list[tuple[Any, TreeNode]]:
        """(key, node) pairs in eviction order, for integrity checks and displays."""
        nodes = self._nodes
        return [(k, nodes[k]) for k in self._keys]
