"""radixkv: a prefix-cache engine for LLM inference.

Layers, each importing only those below it:

    radixkv.cache      pure Python: block pool, radix tree, PrefixCache
    radixkv.scheduler  continuous batching over the cache
    radixkv.kernels    paged KV-cache kernels (Triton on CUDA, torch reference on CPU)
    radixkv.kv_events  KV events on the wire (ZeroMQ, vLLM's format), over the cache alone
    radixkv.engine     LLM, its config and sampling params, model runner, sampler
    radixkv.chat       chat session, terminal UI
    radixkv.serve      the OpenAI-compatible HTTP server
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixkv.cache import (
    BlockPool,
    BlockTable,
    CacheStats,
    MatchResult,
    NodeView,
    PackedTokens,
    PrefixCache,
)

if TYPE_CHECKING:
    from radixkv.chat import ChatReply, ChatSession
    from radixkv.engine import (
        LLM,
        ModelLoadError,
        ModelNotFoundError,
        RequestOutput,
        RequestStats,
        RequestUpdate,
        SamplingParams,
        StreamDelta,
    )

__all__ = [
    "LLM",
    "BlockPool",
    "BlockTable",
    "CacheStats",
    "ChatReply",
    "ChatSession",
    "MatchResult",
    "ModelLoadError",
    "ModelNotFoundError",
    "NodeView",
    "PackedTokens",
    "PrefixCache",
    "RequestOutput",
    "RequestStats",
    "RequestUpdate",
    "SamplingParams",
    "StreamDelta",
]

# Names of the engine and chat layers, imported on first use so that `from radixkv import
# PrefixCache` loads neither the scheduler nor torch and transformers.
_ENGINE_NAMES = {
    "LLM": "radixkv.engine",
    "ModelLoadError": "radixkv.engine",
    "ModelNotFoundError": "radixkv.engine",
    "RequestOutput": "radixkv.engine",
    "RequestStats": "radixkv.engine",
    "RequestUpdate": "radixkv.engine",
    "SamplingParams": "radixkv.engine",
    "StreamDelta": "radixkv.engine",
    "ChatReply": "radixkv.chat",
    "ChatSession": "radixkv.chat",
}


def __getattr__(name: str) -> Any:
    if name in _ENGINE_NAMES:
        value = getattr(importlib.import_module(_ENGINE_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
