"""The set of evictable tree nodes (unlocked leaves), ordered by an eviction policy's sort key.

A policy is a tiny function from a node to a sort key; the smallest key is evicted first. Keys
are computed when a node joins the set and stored on the node (`evict_key`); a key must not change
while the node is a member (the tree re-keys a member whose segment it changes).

Two policies, both fully deterministic (logical clock, node id last):

* `lru_key`: `(last_access_tick, node_id)`, least recently used first.
* `gdsf_key(B)`, the tree's default: Greedy-Dual-Size-Frequency with the cost of a block in
  tokens. Evicting a leaf frees its LAST block first (a trim), and what is lost with it is the
  tokens of the path that block holds (`gdsf_priority`): B for a full block, 1..B-1 for a partial
  tail, and, when the leaf shares that block with its parent (a branch that starts and ends
  inside one block), the parent's tokens in it too, which go with the block. The priority is
  `inflation at the leaf's last use + those tokens`; the tree raises its inflation to the priority
  of every victim (GDSF's L). So a leaf whose last block is nearly empty goes before an equally
  recent full one, and every leaf ages: one left unused while about a block's worth of priority
  was evicted goes before a fresh one whatever its tail. Why this order: it frees a block for the
  fewest hit tokens lost (the tokens a block holds are the prefill a later hit saves), weighted by
  recency, and it has no parameter: scaling every cost by the same factor scales the inflation
  alike and leaves the order unchanged (measured; see benchmarks/RESULTS.md for the comparison
  with LRU, partial-tail-first, frequency-weighted and blended orders).
  Ties: older tick, then smaller node id.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from radixkv.cache.node import TreeNode

EvictionKey = Callable[[TreeNode], Any]


def lru_key(node: TreeNode) -> tuple[int, int]:
    """Least recently used first; the older node (smaller id) first among equal ticks."""
    return (node.tick, node.node_id)


def gdsf_priority(node: TreeNode, block_size: int) -> int:
    """`node.gdsf_base` + the tokens of the node's path in its last block (end > start): what
    evicting that block loses. A head block shared with the parent counts from the block's start:
    it is freed only once the parent's tail in it goes as well. (A head shared with a higher
    ancestor only: the parent's tokens there lie in the parent's own copy, freed on their own.)"""
    end = node.end
    parent = node.parent
    shared = node.head_shared and parent is not None and parent.blocks[-1] == node.blocks[0]
    return (
        node.gdsf_base
        + end
        - max(0 if shared else node.start, (end - 1) // block_size * block_size)
    )


def gdsf_key(block_size: int) -> Callable[[TreeNode], tuple[int, int, int]]:
    """The GDSF policy for blocks of `block_size` tokens: key `(gdsf_priority, tick, node_id)`
    (see the module docstring)."""

    def key(node: TreeNode) -> tuple[int, int, int]:
        return (gdsf_priority(node, block_size), node.tick, node.node_id)

    return key


# The orders a cache can be built with: name -> (block size -> key).
EVICTION_ORDERS: dict[str, Callable[[int], EvictionKey]] = {
    "gdsf": gdsf_key,
    "lru": lambda block_size: lru_key,
}


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
        self._nodes: dict[Any, TreeNode] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        """Members in eviction order (first = next victim)."""
        return (self._nodes[k] for k in self._keys)

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

    def items(self) -> list[tuple[Any, TreeNode]]:
        """(key, node) pairs in eviction order, for integrity checks and displays."""
        return [(k, self._nodes[k]) for k in self._keys]


@dataclass(slots=True, eq=False)
class LruEntry:
    """One full block a lower tier indexes by its hash; a member of the LRU order unless pinned.
    Duck-types the `TreeNode` fields `lru_key` and `EvictionIndex` read."""

    block_hash: int
    node_id: int = 0  # order of arrival: breaks ties between equal ticks
    tick: int = 0  # last use on the index's logical clock
    evict_key: Any = field(default=None, repr=False)


class LruEntries(dict):
    """A lower tier's index (the host tier's blocks, the disk tier's files): a dict of block hash
    -> entry, the unpinned entries ordered least recently used first on a logical clock (one tick
    per use). Read it as a dict; change it only through `add`, `touch`, `pin` and `remove`.

    Invariants (`check_integrity`): each entry is filed under its hash; the order holds exactly
    the unpinned entries, each under its current key; no tick is ahead of the clock.
    """

    def __init__(self) -> None:
        super().__init__()
        self.order = EvictionIndex(lru_key)
        self.clock = 0
        self._ids = itertools.count()

    def add(self, entry: Any) -> Any:
        """File a new entry (its hash not filed yet) as the most recently used; returns it."""
        assert entry.block_hash not in self, f"{entry.block_hash:016x} filed twice"
        entry.node_id = next(self._ids)
        self[entry.block_hash] = entry
        return self.touch(entry)

    def touch(self, entry: Any) -> Any:
        """The entry becomes the most recently used (and unpinned); returns it."""
        self.order.discard(entry)
        self.clock += 1
        entry.tick = self.clock
        self.order.add(entry)
        return entry

    def pin(self, entry: Any) -> None:
        """Take the entry out of the order (`touch` puts it back)."""
        self.order.discard(entry)

    def remove(self, block_hash: int) -> Any:
        """Drop the entry of `block_hash`; returns it (None: there was none)."""
        entry = self.pop(block_hash, None)
        if entry is not None:
            self.order.discard(entry)
        return entry

    def check_integrity(self, tier: str) -> None:
        """Recompute the invariants in the class docstring; AssertionError names `tier`."""
        unpinned = set()
        for h, entry in self.items():
            if entry.block_hash != h or entry.tick > self.clock:
                raise AssertionError(f"{tier} entry {h:016x} misfiled or ticked ahead")
            if entry.evict_key is not None:
                unpinned.add(id(entry))
        members = self.order.items()
        if {id(e) for _, e in members} != unpinned or len(members) != len(unpinned):
            raise AssertionError(f"the {tier} LRU order does not hold exactly the unpinned entries")
        for k, entry in members:
            if k != lru_key(entry):
                raise AssertionError(f"{tier} entry {entry.block_hash:016x} under a stale key")
