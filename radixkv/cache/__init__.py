"""The prefix cache: pure Python, imports nothing else from radixkv.

pool.py          BlockPool: physical blocks, owner counts, free list
tokens.py        PackedTokens, token validation, the common-prefix helper
tree.py          RadixTree: token paths per namespace, block ownership, locks, insert plan/commit
eviction.py      the sorted set of evictable leaves
prefix_cache.py  PrefixCache: the facade (argument checks, handles, stats, integrity)
"""

from radixkv.cache.pool import BlockPool, BlockPoolStats
from radixkv.cache.prefix_cache import (
    BlockTable,
    CacheStats,
    InsertResult,
    LockHandle,
    MatchResult,
    NodeView,
    PrefixCache,
    hit_rate,
)
from radixkv.cache.tokens import PackedTokens, common_prefix_len
from radixkv.cache.validation import check_size

__all__ = [
    "BlockPool",
    "BlockPoolStats",
    "BlockTable",
    "CacheStats",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "NodeView",
    "PackedTokens",
    "PrefixCache",
    "check_size",
    "common_prefix_len",
    "hit_rate",
]
