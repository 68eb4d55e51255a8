"""vLLM 0.33's KV-event structs (`vllm/distributed/kv_events.py`), mirrored field for field
(order, types, defaults and struct options) for decoding what radixkv publishes, as a router
built on vLLM's definitions decodes it; and the older releases' `array_like` events."""

from __future__ import annotations

from typing import Any

import msgspec

# ---- vLLM's definitions (vllm/distributed/kv_events.py), mirrored for decoding ----


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# The releases' layout: the same structs with `array_like=True` on the event base.
class ArrayBlockStored(VllmBlockStored, array_like=True, tag="BlockStored"):
    pass


class ArrayBlockRemoved(VllmBlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(VllmAllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


STRUCTS = {
    "array": (ArrayKVEventBatch, ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
    "map": (KVEventBatch, VllmBlockStored, VllmBlockRemoved, VllmAllBlocksCleared),
}
DECODERS = {layout: msgspec.msgpack.Decoder(type=t[0]) for layout, t in STRUCTS.items()}
DECODER = DECODERS["map"]  # the publisher's default layout
