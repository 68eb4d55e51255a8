"""radixkv: a prefix-cache engine for LLM inference.

The core (`BlockPool`, `PrefixCache`) is pure Python; the kernels live in `radixkv.kernels`, the
continuous-batching scheduler in `radixkv.scheduler`.
"""

from radixkv.block_pool import BlockPool
from radixkv.prefix_cache import CacheStats, InsertResult, LockHandle, MatchResult, PrefixCache

__all__ = [
    "BlockPool",
    "CacheStats",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "PrefixCache",
]
