"""The prefix cache: pure Python, imports nothing else from radixkv.

pool.py          BlockPool: physical blocks, owner counts, free list
node.py          TreeNode: one node of the radix tree
tokens.py        the door's checks: PackedTokens, token validation, sizes; the common-prefix helper
tree.py          RadixTree: token paths per namespace, block ownership, locks, insert plan/commit
eviction.py      the sorted set of evictable leaves
keys.py          block keys: the one chain per node that KV events and the lower tiers read
events.py        KV events: the queue the owner drains
summary.py       a bounded picture of one namespace's tree, for a live view
prefix_cache.py  PrefixCache: the one contract (match; admit / grow / commit / close a
                 BlockTable), stats, integrity
group.py         the protocol every cache group speaks, and the records it passes
grouped.py       GroupedCache: a model's groups as one list, the tree's first; a hit is the
                 deepest point every group can resume from
window.py        WindowGroup: sliding-window layers' blocks, released as they leave the window,
                 kept as tails where a later request can resume
state.py         StateGroup: a hybrid model's recurrent-state slots, one a running request, and
                 snapshots of them where later requests resume
snapshots.py     where snapshots are taken (SnapshotPolicy) and which go first (SnapshotLedger)
points.py        the keys of points on token prefixes, and the lookup of a prompt's deepest one
kinds.py         the registry of group kinds, and the grouped cache built from a model's specs
"""

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from radixkv.cache.grouped import GroupedCache, GroupedTable
from radixkv.cache.pool import BlockPool
from radixkv.cache.prefix_cache import (
    BlockTable,
    CacheStats,
    MatchResult,
    NodeView,
    PrefixCache,
    hit_rate,
)
from radixkv.cache.tokens import PackedTokens, check_size, common_prefix_len

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "BlockTable",
    "CacheStats",
    "GroupedCache",
    "GroupedTable",
    "KVEvent",
    "MatchResult",
    "NodeView",
    "PackedTokens",
    "PrefixCache",
    "check_size",
    "common_prefix_len",
    "hit_rate",
]
