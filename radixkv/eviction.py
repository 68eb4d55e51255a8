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

from sortedcontainers import SortedDict

if TYPE_CHECKING:
    from radixkv.radix_tree import TreeNode

EvictionKey = Callable[["TreeNode"], Any]


def lru_key(node: TreeNode) -> tuple[int, int]:
    """Least recently used first; the older node (smaller id) first among equal ticks."""
    return (node.tick, node.node_id)


class EvictionIndex:
    """Sorted set of evictable nodes; O(log n) add, remove and pop of the first.

    Invariant: `node.evict_key is not None` iff the node is a member, and then it is the key the
    node is stored under.
    """

    __slots__ = ("_by_key", "key")

    def __init__(self, key: EvictionKey = lru_key) -> None:
        self.key = key
        self._by_key: SortedDict = SortedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def __iter__(self) -> Iterator[TreeNode]:
        """Members in eviction order (first = next victim)."""
        return iter(self._by_key.values())

    def add(self, node: TreeNode) -> None:
        assert node.evict_key is None, f"node {node.node_id} is already evictable"
        k = self.key(node)
        node.evict_key = k
        self._by_key[k] = node

    def discard(self, node: TreeNode) -> None:
        """Remove `node` if it is a member."""
        k = node.evict_key
        if k is not None:
            del self._by_key[k]
            node.evict_key = None

    def first(self) -> TreeNode:
        """The next victim (the set must not be empty)."""
        return self._by_key.peekitem(0)[1]

    def items(self) -> list[tuple[Any, TreeNode]]:
        """(key, node) pairs in eviction order, for integrity checks and displays."""
        return list(self._by_key.items())
