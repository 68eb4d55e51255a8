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
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from radixkv.radix_tree import TreeNode

EvictionKey = Callable[["TreeNode"], Any]


def lru_key(node: TreeNode) -> tuple[int, int]:
    """Least recently used first; the older node (smaller id) first among equal ticks."""
    return (node.tick, node.node_id)


class EvictionIndex:
    """Sorted set of evictable nodes; O(log n) add, remove and peek at the first.

    Entries are `(key, node)`; keys are unique (LRU's includes the node id), so entries never
    compare nodes. Invariant: `node.evict_key is not None` iff the node is a member, and then it is
    the key the node is stored under.
    """

    __slots__ = ("_entries", "key")

    def __init__(self, key: EvictionKey = lru_key) -> None:
        self.key = key
        self._entries: SortedList = SortedList()

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __iter__(self) -> Iterator[TreeNode]:
        """Members in eviction order (first = next victim)."""
        return (node for _, node in self._entries)

    def add(self, node: TreeNode) -> None:
        assert node.evict_key is None, f"node {node.node_id} is already evictable"
        k = self.key(node)
        node.evict_key = k
        self._entries.add((k, node))

    def discard(self, node: TreeNode) -> None:
        """Remove `node` if it is a member."""
        k = node.evict_key
        if k is not None:
            self._entries.remove((k, node))
            node.evict_key = None

    def first(self) -> TreeNode:
        """The next victim (the set must not be empty)."""
        return self._entries[0][1]

    def items(self) -> list[tuple[Any, TreeNode]]:
        """(key, node) pairs in eviction order, for integrity checks and displays."""
        return list(self._entries)
