"""The prefix cache: pure Python, imports nothing else from radixkv.

pool.py          BlockPool: physical blocks, ref counts, free list
tokens.py        PackedTokens: token ids validated once, packed as the tree stores them
tree.py          RadixTree: token paths, block ownership, locks, eviction
eviction.py      the sorted set of evictable leaves
prefix_cache.py  PrefixCache: the facade (argument checks, handles, stats, integrity)
"""

from radixkv.cache.pool import BlockPool, BlockPoolStats
from radixkv.cache.prefix_cache import (
    CacheStats,
    InsertResult,
    LockHandle,
    MatchResult,
    NodeView,
    PrefixCache,
)
from radixkv.cache.tree import PackedTokens
from radixkv.cache.validation import check_size

__all__ = [
    "BlockPool",
    "BlockPoolStats",
    "CacheStats",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "NodeView",
    "PackedTokens",
    "PrefixCache",
    "check_size",
]
