"""radixkv: a prefix-cache engine for LLM inference.

The core (`BlockPool`, `PrefixCache`) is pure Python; the kernels live in `radixkv.kernels`, the
continuous-batching scheduler in `radixkv.scheduler`.
"""

from radixkv.block_pool import BlockPool, BlockPoolStats
from radixkv.prefix_cache import (
    CacheStats,
    InsertResult,
    LockHandle,
    MatchResult,
    NodeView,
    PrefixCache,
)
from radixkv.sampling_params import SamplingParams

__all__ = [
    "BlockPool",
    "BlockPoolStats",
    "CacheStats",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "NodeView",
    "PrefixCache",
    "SamplingParams",
]
