"""KV events: a queue of which full blocks entered and left the cache, for cache-aware routers.

A router in front of several replicas (llm-d, NVIDIA Dynamo) keeps an index of the blocks each
replica holds and sends a request where the longest prefix of it is cached. It learns that index
from three events, the ones vLLM publishes (`radixkv.kv_events` puts them on the wire):

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size)
        consecutive full blocks of one path entered the cache; `parent_block_hash` is the hash
        of the block before the first (None: the first block of a sequence)
    BlockRemoved(block_hashes)          those blocks left the cache
    AllBlocksCleared()                  everything left the cache

Each names its tier (`medium`, vLLM's field): None for the device pool (the publisher names it,
"GPU" by default), "CPU" for the host tier and "DISK" for the disk tier (`radixkv.cache.tiers`).
A block demoted from the device to the host is removed from one and stored in the other; the disk
tier announces what this process writes or reads and forgets (not the files found at start).

Only FULL blocks are announced: a router indexes whole blocks, and a partial tail (which radixkv
caches, token-granular) would never match one of its block keys anyway.

Block hashes are chained, as nano-vllm and vLLM chain them, so that a hash names the whole prefix
ending at its block:

    h_0 = hash_block(None, tokens of block 0)
    h_i = hash_block(h_{i-1}, tokens of block i)      (xxh64 over the parent as 8 little-endian
                                                       bytes ++ the tokens, by default)

tokens as little-endian uint32. A cache namespace (a tenant's cache salt) seeds the chain:
`namespace_seed(name)` is mixed in as h_{-1}, so equal tokens in two namespaces never share a
hash (the wire still shows `parent_block_hash=None` for a first block). A `BlockHasher` is the
one place the chain is chosen: `XXH64` (the default, above) or vLLM's sha256_cbor chain
(`radixkv.cache.vllm_hash`), for routers that hash request tokens themselves as vLLM does
(`make_block_hasher`). Nodes hold the hasher's own values; events carry their 64-bit wire form.

Recording is the cache's choice at construction (`PrefixCache(kv_events=True)`), as in SGLang's
radix cache and vLLM's block pool: the cache appends events to a queue and its owner drains it
(`PrefixCache.take_events()`, after each engine step). A cache built without it has no recorder
at all: no hashing, no queue. Recording from the first block on means the queue describes the
whole content, with no snapshot to take; a router that joins later re-syncs from the publisher's
replay buffer, as it does with vLLM.

Where the tree produces them (`EventRecorder`): a full block of a path is announced by the node in
which it ENDS (block i by the node with start < (i+1)*B <= end). Tokens enter the tree only as new
leaves (`stored`); they leave only when a leaf is trimmed or removed (`removed`), or all at once
(`cleared`). A split cuts a node's list of hashes in two and changes no block's hash; block ids
(copy-on-write copies, superseded tails, co-owned heads) never enter a hash, so re-owning a block
announces nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import xxhash

from radixkv.cache.node import TreeNode
from radixkv.cache.tokens import unpack_tokens

_xxh64 = xxhash.xxh64_intdigest
_NATIVE_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks of one path entered the cache, in path order."""

    block_hashes: tuple[int, ...]  # chained hash of each block (uint64)
    parent_block_hash: int | None  # the block before the first; None when the first is block 0
    token_ids: tuple[int, ...]  # len(block_hashes) * block_size ids: the blocks' tokens
    block_size: int
    # The namespace (cache salt) of the path when the first block is its block 0, else None:
    # vLLM publishes a salt as that block's extra key, for consumers that recompute hashes.
    namespace: str | None = None
    medium: str | None = None  # the tier ("CPU": host, "DISK"); None: the device pool


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Full blocks left the cache (deepest first along a path)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None  # the tier ("CPU": host, "DISK"); None: the device pool


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block left the cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
HashFn = Callable[[Any, bytes], Any]  # (parent hash, block tokens LE) -> hash


# ---------------------------------------------------------------------------------- hashing
def token_bytes_le(packed: bytes) -> bytes:
    """Native uint32 token bytes (how the tree stores tokens) as little-endian ones, the hash
    input on every machine."""
    return packed if _NATIVE_LITTLE else np.frombuffer(packed, "=u4").astype("<u4").tobytes()


def hash_block(parent_hash: int | None, tokens_le: bytes) -> int:
    """Chained hash of one block: xxh64(parent hash as 8 little-endian bytes, if any ++ tokens)."""
    if parent_hash is None:
        return _xxh64(tokens_le)
    return _xxh64(parent_hash.to_bytes(8, "little") + tokens_le)


def chain_hashes(
    parent_hash: int | None,
    tokens_le: bytes,
    block_size: int,
    hash_fn: HashFn = hash_block,
) -> list[Any]:
    """Hashes of the consecutive full blocks in `tokens_le` (little-endian uint32 ids, a whole
    number of blocks), chained from `parent_hash`. Mutates nothing."""
    nbytes = 4 * block_size
    assert len(tokens_le) % nbytes == 0, "chain_hashes takes whole blocks"
    hashes = []
    h = parent_hash
    for start in range(0, len(tokens_le), nbytes):
        h = hash_fn(h, tokens_le[start : start + nbytes])
        hashes.append(h)
    return hashes


def namespace_seed(namespace: str) -> int:
    """The h_{-1} of a namespace's chains: keeps equal prefixes of two namespaces apart."""
    return _xxh64(b"radixkv-namespace:" + namespace.encode("utf-8"))


class BlockHasher(Protocol):
    """A block-hash chain: `block(parent, tokens_le)` hashes one block from its parent's hash,
    `first_parent(namespace)` is the parent of a namespace's block 0, `wire(h)` the uint64 an
    event carries."""

    def first_parent(self, namespace: str | None) -> Any: ...

    def block(self, parent: Any, tokens_le: bytes) -> Any: ...

    def wire(self, h: Any) -> int: ...


class Xxh64Hasher:
    """radixkv's own chain (`hash_block`, `namespace_seed`): hashes are their wire form."""

    block = staticmethod(hash_block)

    @staticmethod
    def first_parent(namespace: str | None) -> int | None:
        return None if namespace is None else namespace_seed(namespace)

    @staticmethod
    def wire(h: int) -> int:
        return h


XXH64 = Xxh64Hasher()
BLOCK_HASHES = ("xxh64", "sha256_cbor")


def make_block_hasher(name: str = "xxh64", seed: str | None = None) -> BlockHasher:
    """The chain called `name` (one of BLOCK_HASHES); `seed` is sha256_cbor's (vLLM's
    PYTHONHASHSEED; None: vLLM's default) and must be None for xxh64. Raises ValueError."""
    if name == "xxh64":
        if seed is not None:
            raise ValueError("block_hash_seed applies to block_hash='sha256_cbor' only")
        return XXH64
    if name == "sha256_cbor":
        from radixkv.cache.vllm_hash import DEFAULT_SEED, Sha256CborHasher

        return Sha256CborHasher(DEFAULT_SEED if seed is None else seed)
    raise ValueError(f"block_hash must be one of {BLOCK_HASHES}, got {name!r}")


# ------------------------------------------------------------------------------ recorder
class EventRecorder:
    """The tree's side of KV events: chained hashes of the full blocks each node ends, and the
    queue of events as blocks enter and leave. Owned by one `RadixTree` (only when the cache
    records events), which calls `stored`, `removed`, `split` and `cleared` at the only places
    where its paths change.

    Invariant (recomputed by `check_integrity`): every attached node's `block_hashes` is the chain
    of the full blocks ending in it, recomputed from its path's tokens.
    """

    def __init__(self, block_size: int, hasher: BlockHasher = XXH64) -> None:
        self.block_size = block_size
        self.hasher = hasher
        self.queue: list[KVEvent] = []

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first; the queue is left empty."""
        events, self.queue = self.queue, []
        return events

    def stored(self, leaf: TreeNode) -> None:
        """`leaf` was attached (its ancestors are hashed): hash the full blocks ending in it and
        announce them (partial tails never)."""
        tokens, leaf.block_hashes = self._chain(leaf)
        if leaf.block_hashes:
            B = self.block_size
            wire = self.hasher.wire
            hashes = tuple(map(wire, leaf.block_hashes))
            tokens_ids = tuple(unpack_tokens(tokens))
            if leaf.start < B:  # block 0 of its path
                stored = BlockStored(hashes, None, tokens_ids, B, namespace_of(leaf))
            else:
                stored = BlockStored(hashes, wire(self._last_hash(leaf.parent)), tokens_ids, B)
            self.queue.append(stored)

    def removed(self, node: TreeNode, keep: int) -> None:
        """`node` is about to lose its full blocks from its `keep`-th on (0: all, the node goes;
        more: a trim back to a block boundary). Call before the node changes."""
        hashes = node.block_hashes
        assert hashes is not None, f"[{node.start},{node.end}) was never hashed"
        gone = hashes[keep:]
        del hashes[keep:]
        if gone:
            self.queue.append(BlockRemoved(tuple(map(self.hasher.wire, reversed(gone)))))

    def split(self, prefix: TreeNode, suffix: TreeNode, p: int) -> None:
        """`suffix` [s, e) is being split at p into `prefix` [s, p) and itself [p, e): blocks
        ending at or before p now end in the prefix. Call before `suffix.start` changes."""
        hashes = suffix.block_hashes
        assert hashes is not None, f"[{suffix.start},{suffix.end}) was never hashed"
        k = p // self.block_size - suffix.start // self.block_size
        prefix.block_hashes, suffix.block_hashes = hashes[:k], hashes[k:]

    def cleared(self) -> None:
        self.queue.append(AllBlocksCleared())

    def check_integrity(self, nodes: Iterable[TreeNode]) -> None:
        """The class invariant over the tree's attached `nodes` (parents first). Raises
        AssertionError naming the node's segment."""
        for node in nodes:
            if node.block_hashes != self._chain(node)[1]:
                raise AssertionError(f"[{node.start},{node.end}) holds stale block hashes")

    # ---------------------------------------------------------------- internals
    def _chain(self, node: TreeNode) -> tuple[bytes, list[int]]:
        """The tokens of the full blocks ending in `node` and their hashes, chained from the
        last full block above it (whose hashes must be computed). Mutates nothing."""
        B = self.block_size
        tokens = path_bytes(node, node.start // B * B, node.end // B * B)
        parent = self._last_hash(node.parent)
        return tokens, chain_hashes(parent, token_bytes_le(tokens), B, self.hasher.block)

    def _last_hash(self, node: TreeNode | None) -> Any:
        """Hash of the last full block on the path to `node` (whose hashes, and its ancestors',
        are computed); the hasher's first parent for the path's namespace when there is none."""
        while node is not None and node.parent is not None:
            if node.block_hashes:
                return node.block_hashes[-1]
            node = node.parent
        return self.hasher.first_parent(None if node is None else node.namespace)


def namespace_of(node: TreeNode) -> str | None:
    """The namespace of the root above `node` (or of `node`, a root)."""
    while node.parent is not None:
        node = node.parent
    return node.namespace


def path_bytes(node: TreeNode, lo: int, hi: int) -> bytes:
    """Packed tokens of path positions [lo, hi) (hi <= node.end; hi may lie above the node, in
    an ancestor), read up the ancestors."""
    parts = []
    cursor: TreeNode | None = node
    end = hi
    while lo < end:
        assert cursor is not None and cursor.parent is not None
        a = max(lo, cursor.start)
        if a < end:  # else the range ends above this node
            parts.append(cursor.tokens[4 * (a - cursor.start) : 4 * (end - cursor.start)])
            end = a
        cursor = cursor.parent
    return b"".join(reversed(parts))
