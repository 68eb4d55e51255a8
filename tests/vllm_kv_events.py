"""vLLM 0.33 as a consumer sees it: its KV-event structs (`vllm/distributed/kv_events.py`),
mirrored field for field (order, types, defaults and struct options) for decoding what radixkv
publishes, as a router built on vLLM's definitions decodes it, with the older releases'
`array_like` events; and its sha256_cbor block hashes, computed as vLLM computes them."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

# The kv-events extra is absent on the GPU machine: a test module importing this one is skipped.
msgspec = pytest.importorskip("msgspec")

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


def vllm_chain(
    seed: str, token_ids: list[int], block_size: int, salt: str | None = None
) -> list[int]:
    """vLLM 0.33's event hashes of a request's full blocks under sha256_cbor: `hash_block_tokens`
    over `cbor2.dumps(canonical=True)` (vllm/utils/hashing.py), NONE_HASH from the seed
    (`init_none_hash`), a salt tagged in block 0's extra keys (`generate_block_hash_extra_keys`),
    the low 64 bits on the wire (`maybe_convert_block_hash`)."""
    import cbor2

    def sha256_cbor(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    none_hash = sha256_cbor(seed)
    parent, hashes = None, []
    for i in range(len(token_ids) // block_size):
        extra = (("cache_salt", salt),) if i == 0 and salt else None
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = sha256_cbor((parent or none_hash, block, extra))
        hashes.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return hashes
