"""radixkv: a prefix-cache engine for LLM inference.

The core (`BlockPool`, `PrefixCache`) is pure Python; the kernels live in `radixkv.kernels`, the
continuous-batching scheduler in `radixkv.scheduler`. The engine (`LLM`, `ChatSession`) imports
torch and transformers, so it is loaded on first access: `from radixkv import PrefixCache` stays
light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.block_pool import BlockPool, BlockPoolStats
from radixkv.outputs import ChatReply, RequestOutput, RequestStats, StreamDelta
from radixkv.prefix_cache import (
    CacheStats,
    InsertResult,
    LockHandle,
    MatchResult,
    NodeView,
    PrefixCache,
)
from radixkv.radix_tree import PackedTokens
from radixkv.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixkv.chat import ChatSession
    from radixkv.engine import LLM
    from radixkv.model_loader import ModelNotFoundError

__all__ = [
    "LLM",
    "BlockPool",
    "BlockPoolStats",
    "CacheStats",
    "ChatReply",
    "ChatSession",
    "InsertResult",
    "LockHandle",
    "MatchResult",
    "ModelNotFoundError",
    "NodeView",
    "PackedTokens",
    "PrefixCache",
    "RequestOutput",
    "RequestStats",
    "SamplingParams",
    "StreamDelta",
]

_LAZY = {
    "LLM": "radixkv.engine",
    "ChatSession": "radixkv.chat",
    "ModelNotFoundError": "radixkv.model_loader",
}


def __getattr__(name: str) -> Any:
    # The engine pulls in torch + transformers (seconds); the cache core must not pay for that.
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
