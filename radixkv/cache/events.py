"""KV events: an opt-in stream of which full blocks the cache holds, for cache-aware routers.

A router in front of several replicas (llm-d, NVIDIA Dynamo) keeps an index of the blocks each
replica holds and sends a request where the longest prefix of it is cached. It learns that index
from three events, the ones vLLM publishes (`radixkv.engine.kv_events` puts them on the wire):

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size)
        consecutive full blocks of one path entered the cache; `parent_block_hash` is the hash
        of the block before the first (None: the first block of a sequence)
    BlockRemoved(block_hashes)          those blocks left the cache
    AllBlocksCleared()                  everything left the cache

Only FULL blocks are announced: a router indexes whole blocks, and a partial tail (which radixkv
caches, token-granular) would never match one of its block keys anyway.

Block hashes are chained, as nano-vllm and vLLM chain them, so that a hash names the whole prefix
ending at its block:

    h_0 = xxh64(tokens of block 0)
    h_i = xxh64(h_{i-1} as 8 little-endian bytes ++ tokens of block i)

tokens as little-endian uint32. A cache namespace (a tenant's cache salt) seeds the chain:
`namespace_seed(name)` is mixed in as h_{-1}, so equal tokens in two namespaces never share a
hash (the wire still shows `parent_block_hash=None` for a first block).

The Python side of a subscription is `KVEventStream.subscribe(callback)`: the cache calls every
callback synchronously, in event order, inside the cache operation that caused the event.
`BlockHashIndex` is what a router keeps, rebuilt from events alone.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

_xxh64 = xxhash.xxh64_intdigest
_NATIVE_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks of one path entered the cache, in path order."""

    block_hashes: tuple[int, ...]  # chained hash of each block (uint64)
    parent_block_hash: int | None  # the block before the first; None when the first is block 0
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size ids: the blocks' tokens
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Full blocks left the cache (deepest first along a path)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block left the cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventCallback = Callable[[KVEvent], None]


# ---------------------------------------------------------------------------------- hashing
def token_bytes_le(packed: bytes) -> bytes:
    """Native uint32 token bytes (how the tree stores tokens) as little-endian ones, the hash
    input on every machine."""
    if _NATIVE_LITTLE:
        return packed
    swapped = array("I", packed)  # pragma: no cover - big-endian hosts only
    swapped.byteswap()
    return swapped.tobytes()


def hash_block(parent_hash: int | None, tokens_le: bytes) -> int:
    """Chained hash of one block: xxh64(parent hash as 8 little-endian bytes, if any ++ tokens)."""
    if parent_hash is None:
        return _xxh64(tokens_le)
    return _xxh64(parent_hash.to_bytes(8, "little") + tokens_le)


def chain_hashes(parent_hash: int | None, tokens_le: bytes, block_size: int) -> list[int]:
    """Hashes of the consecutive full blocks in `tokens_le` (little-endian uint32 ids, a whole
    number of blocks), chained from `parent_hash`. Mutates nothing."""
    nbytes = 4 * block_size
    assert len(tokens_le) % nbytes == 0, "chain_hashes takes whole blocks"
    hashes = []
    h = parent_hash
    for start in range(0, len(tokens_le), nbytes):
        h = hash_block(h, tokens_le[start : start + nbytes])
        hashes.append(h)
    return hashes


def namespace_seed(namespace: str) -> int:
    """The h_{-1} of a namespace's chains: keeps equal prefixes of two namespaces apart."""
    return _xxh64(b"radixkv-namespace:" + namespace.encode("utf-8"))


# ----------------------------------------------------------------------------- subscribers
class Subscription:
    """A subscriber's registration; `close()` stops delivery (idempotent)."""

    __slots__ = ("_callback", "_stream")

    def __init__(self, stream: KVEventStream, callback: EventCallback) -> None:
        self._stream: KVEventStream | None = stream
        self._callback = callback

    @property
    def active(self) -> bool:
        return self._stream is not None

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream._remove(self._callback)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVEventStream:
    """Fan-out of one cache's events to its subscribers.

    `subscribe(callback)` returns a `Subscription`; callbacks run synchronously in the cache
    operation that caused the event, in subscription order. A callback that raises is logged and
    counted (`num_callback_errors`) and keeps its subscription: the cache operation around it
    always completes. The cache computes block hashes only while `active` (someone listens).
    """

    __slots__ = ("_callbacks", "num_callback_errors")

    def __init__(self) -> None:
        self._callbacks: list[EventCallback] = []
        self.num_callback_errors = 0

    @property
    def active(self) -> bool:
        return bool(self._callbacks)

    def subscribe(self, callback: EventCallback) -> Subscription:
        """Deliver every later event to `callback(event)`. Raises TypeError if not callable.

        A subscriber that joins a cache already holding blocks sees only what changes from now
        on; a router resynchronises from `AllBlocksCleared` or a fresh replica.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._callbacks.append(callback)
        return Subscription(self, callback)

    def emit(self, event: KVEvent) -> None:
        """Deliver `event` to every subscriber (the cache's call)."""
        for callback in tuple(self._callbacks):
            try:
                callback(event)
            except Exception:
                self.num_callback_errors += 1
                logger.exception("KV event subscriber %r failed on %r", callback, event)

    def _remove(self, callback: EventCallback) -> None:
        self._callbacks.remove(callback)


# ------------------------------------------------------------------------ reference consumer
class BlockHashIndex:
    """What a router knows of one replica: the set of full-block hashes, from events alone.

    Strict: a `BlockStored` whose parent is unknown, a hash stored twice, or a removal of an
    unknown hash raises ValueError, naming the hash (a router would re-sync; a test wants to know).
    Invariant: `parents[h]` is the parent hash of every stored `h` (None for a first block).
    """

    def __init__(self) -> None:
        self.parents: dict[int, int | None] = {}
        self.tokens: dict[int, tuple[int, ...]] = {}

    @property
    def hashes(self) -> set[int]:
        return set(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.parents

    def apply(self, event: KVEvent) -> None:
        """Update the index with one event (usable directly as a subscriber callback)."""
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            missing = [h for h in event.block_hashes if h not in self.parents]
            if missing:
                raise ValueError(f"BlockRemoved of unknown block hashes {missing}")
            for h in event.block_hashes:
                del self.parents[h]
                del self.tokens[h]
        elif isinstance(event, AllBlocksCleared):
            self.parents.clear()
            self.tokens.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(event)

    def _store(self, event: BlockStored) -> None:
        B = event.block_size
        if len(event.token_ids) != B * len(event.block_hashes):
            raise ValueError(
                f"BlockStored carries {len(event.token_ids)} token ids for"
                f" {len(event.block_hashes)} blocks of {B}"
            )
        parent = event.parent_block_hash
        if parent is not None and parent not in self.parents:
            raise ValueError(f"BlockStored under unknown parent hash {parent}")
        for i, h in enumerate(event.block_hashes):
            if h in self.parents:
                raise ValueError(f"block hash {h} stored twice")
            self.parents[h] = parent
            self.tokens[h] = event.token_ids[i * B : (i + 1) * B]
            parent = h

    def longest_prefix_blocks(self, token_ids: Iterable[int], block_size: int) -> int:
        """Full blocks of `token_ids` (default namespace) the replica holds: what a router scores.
        Mutates nothing."""
        ids = np.asarray(list(token_ids), dtype="<u4")
        tokens_le = ids[: len(ids) // block_size * block_size].tobytes()
        n = 0
        for h in chain_hashes(None, tokens_le, block_size):
            if h not in self.parents:
                break
            n += 1
        return n
