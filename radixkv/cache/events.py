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

The Python side of a subscription is `PrefixCache.events.subscribe(callback)`: the cache calls
every callback synchronously, in event order, inside the cache operation that caused the event. A
subscriber that joins a cache already holding blocks first gets `BlockStored` events for all of
them (parents first), so that its index is complete from the start.
`BlockHashIndex` is what a router keeps, rebuilt from events alone.

Where the tree produces them (`BlockEvents`): a full block of a path is announced by the node in
which it ENDS (block i by the node with start < (i+1)*B <= end). Tokens enter the tree only as new
leaves (`stored`); they leave only when a leaf is trimmed or removed (`removed`), or all at once
(`cleared`). A split cuts a node's list of hashes in two and changes no block's hash; block ids
(copy-on-write copies, superseded tails, co-owned heads) never enter a hash, so re-owning a block
announces nothing. Hashes are computed only while someone listens: for a new leaf as it is
announced, and for every node (parents first) when a subscriber joins.
"""

from __future__ import annotations

import logging
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from radixkv.cache.tokens import unpack_tokens

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

    __slots__ = ("_callback", "_callbacks")

    def __init__(self, callbacks: list[EventCallback], callback: EventCallback) -> None:
        self._callbacks: list[EventCallback] | None = callbacks  # the stream's list, while active
        self._callback = callback

    @property
    def active(self) -> bool:
        return self._callbacks is not None

    def close(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        if callbacks is not None:
            callbacks.remove(self._callback)

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
    `snapshot`, if given, yields the events that describe the current content: a new subscriber
    gets them before anything else.
    """

    __slots__ = ("_callbacks", "_snapshot", "num_callback_errors")

    def __init__(self, snapshot: Callable[[], Iterable[KVEvent]] | None = None) -> None:
        self._callbacks: list[EventCallback] = []
        self._snapshot = snapshot
        self.num_callback_errors = 0

    @property
    def active(self) -> bool:
        return bool(self._callbacks)

    def subscribe(self, callback: EventCallback) -> Subscription:
        """Deliver every later event to `callback(event)`. Raises TypeError if not callable.

        A subscriber that joins a cache already holding blocks first gets the snapshot (a
        `BlockStored` per node holding full blocks, parents first). One interrupted there (a
        KeyboardInterrupt out of its callback) is not subscribed: the snapshot hashes the nodes
        it reaches, and a stream left active would leave the rest unhashed, announced wrong.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        self._callbacks.append(callback)
        if self._snapshot is not None:
            try:
                for event in self._snapshot():
                    self._deliver(callback, event)
            except BaseException:
                self._callbacks.remove(callback)
                raise
        return Subscription(self._callbacks, callback)

    def emit(self, event: KVEvent) -> None:
        """Deliver `event` to every subscriber (the cache's call)."""
        for callback in tuple(self._callbacks):
            self._deliver(callback, event)

    def _deliver(self, callback: EventCallback, event: KVEvent) -> None:
        try:
            callback(event)
        except Exception:
            self.num_callback_errors += 1
            logger.exception("KV event subscriber %r failed on %r", callback, event)


# ------------------------------------------------------------------------------ producer
class HashedNode(Protocol):
    """What `BlockEvents` reads and writes of a tree node (the tree's nodes satisfy it)."""

    parent: HashedNode | None  # None for a namespace root
    start: int
    end: int
    tokens: bytes  # packed native uint32, (end - start) tokens
    namespace: str | None  # a root's namespace
    block_hashes: list[int] | None  # hashes of the full blocks ending in the node, if computed


class BlockEvents:
    """The tree's side of KV events: chained hashes of the full blocks each node ends, and the
    events as they enter and leave. Owned by one `RadixTree`, which calls `stored`, `removed`,
    `split` and `cleared` at the only places where its paths change.

    Invariant: a node whose `block_hashes` is not None has them right for its path, and so do its
    ancestors; while `stream.active`, every attached node has them.
    """

    def __init__(self, block_size: int, nodes: Callable[[], Iterator[HashedNode]]) -> None:
        self.block_size = block_size
        self.stream = KVEventStream(snapshot=self._snapshot)
        self._nodes = nodes  # the tree's attached nodes, parents first

    def stored(self, leaf: HashedNode) -> None:
        """`leaf` was attached: announce the full blocks ending in it (partial tails never)."""
        if self.stream.active:
            event = self._stored_event(leaf)
            if event is not None:
                self.stream.emit(event)

    def removed(self, node: HashedNode, keep: int) -> None:
        """`node` is about to lose its full blocks from its `keep`-th on (0: all, the node goes;
        more: a trim back to a block boundary). Call before the node changes."""
        hashes = node.block_hashes  # never None while someone listens
        if hashes is None:
            return
        gone = hashes[keep:]
        del hashes[keep:]
        if gone and self.stream.active:
            self.stream.emit(BlockRemoved(tuple(reversed(gone))))

    def split(self, prefix: HashedNode, suffix: HashedNode, p: int) -> None:
        """`suffix` [s, e) is being split at p into `prefix` [s, p) and itself [p, e): blocks
        ending at or before p now end in the prefix. Call before `suffix.start` changes."""
        hashes = suffix.block_hashes
        if hashes is not None:
            k = p // self.block_size - suffix.start // self.block_size
            prefix.block_hashes, suffix.block_hashes = hashes[:k], hashes[k:]

    def cleared(self) -> None:
        if self.stream.active:
            self.stream.emit(AllBlocksCleared())

    def check_integrity(self, nodes: Iterable[HashedNode]) -> None:
        """The class invariant over the tree's attached `nodes` (parents first): every hash list
        there is the chain recomputed from the path's tokens, and while someone listens, every
        node has one. Raises AssertionError naming the node's segment."""
        for node in nodes:
            if node.block_hashes is None:
                assert not self.stream.active, f"[{node.start},{node.end}) unhashed while active"
            elif node.block_hashes != self._chain(node)[1]:
                raise AssertionError(f"[{node.start},{node.end}) holds stale block hashes")

    # ---------------------------------------------------------------- internals
    def _snapshot(self) -> Iterator[KVEvent]:
        for node in self._nodes():
            event = self._stored_event(node)
            if event is not None:
                yield event

    def _stored_event(self, node: HashedNode) -> BlockStored | None:
        """Hash the full blocks ending in `node` (its ancestors' are hashed) and announce them."""
        tokens, node.block_hashes = self._chain(node)
        if not node.block_hashes:
            return None
        B = self.block_size
        parent = None if node.start < B else self._last_hash(node.parent)
        return BlockStored(tuple(node.block_hashes), parent, tuple(unpack_tokens(tokens)), B)

    def _chain(self, node: HashedNode) -> tuple[bytes, list[int]]:
        """The tokens of the full blocks ending in `node` and their hashes, chained from the
        last full block above it (whose hashes must be computed). Mutates nothing."""
        B = self.block_size
        tokens = self._path_bytes(node, node.start // B * B, node.end // B * B)
        return tokens, chain_hashes(self._last_hash(node.parent), token_bytes_le(tokens), B)

    @staticmethod
    def _last_hash(node: HashedNode | None) -> int | None:
        """Hash of the last full block on the path to `node` (whose hashes, and its ancestors',
        are computed); the namespace seed (None: the shared one) when there is none."""
        while node is not None and node.parent is not None:
            if node.block_hashes:
                return node.block_hashes[-1]
            node = node.parent
        namespace = None if node is None else node.namespace
        return None if namespace is None else namespace_seed(namespace)

    @staticmethod
    def _path_bytes(node: HashedNode, lo: int, hi: int) -> bytes:
        """Packed tokens of path positions [lo, hi) (hi <= node.end), read up the ancestors."""
        parts = []
        cursor: HashedNode | None = node
        end = hi
        while lo < end:
            assert cursor is not None and cursor.parent is not None
            a = max(lo, cursor.start)
            parts.append(cursor.tokens[4 * (a - cursor.start) : 4 * (end - cursor.start)])
            end = a
            cursor = cursor.parent
        return b"".join(reversed(parts))


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
