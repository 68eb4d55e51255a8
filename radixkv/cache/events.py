"""KV events: a queue of which full blocks entered and left the cache, for cache-aware routers.

A router in front of several replicas (llm-d, NVIDIA Dynamo) keeps an index of the blocks each
replica holds and sends a request where the longest prefix of it is cached. It learns that index
from three events, the ones vLLM publishes (`radixkv.kv_events` puts them on the wire):

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size)
        consecutive full blocks of one path entered the cache; `parent_block_hash` is the hash
        of the block before the first (None: the first block of a sequence)
    BlockRemoved(block_hashes)          those blocks left the cache
    AllBlocksCleared()                  everything left the cache

Each names its KV cache group (`group_idx`, vLLM's field, below) and its tier (`medium`, vLLM's
field): None for the device pool (the publisher names it, "GPU" by default), "CPU" for the host
tier and "DISK" for the disk tier (`radixkv.cache.tiers`).
A block demoted from the device to the host is removed from one and stored in the other; the disk
tier announces what this process writes or reads and forgets (not the files found at start).

Only FULL blocks are announced: a router indexes whole blocks, and a partial tail (which radixkv
caches, token-granular) would never match one of its block keys anyway.

Groups, numbered as vLLM's `group_idx`: 0 is the full-attention layers' (the tree; the only group
of a model without window layers), 1 the sliding-window layers' of a
hybrid model (`radixkv.cache.window`). The window group announces the full blocks its tails keep
(the window KV a later hit resumes from: its blocks up to e // B - 1 of a tail ending
at e), named by the same chained keys as the full group's blocks of that prefix, with the
group's window (vLLM's `kv_cache_spec_sliding_window`); a key is stored when the first tail
holding it is kept and removed when the last one goes. A window run's parent is the full chain's
block before it, which the window group need not hold. The window group's host and disk tiers
announce what they hold as group 1 too, under the same keys.

A hybrid model's recurrent-state group (the last, `radixkv.cache.state`) announces each
snapshot as one key of kind "mamba" (vLLM's `kv_cache_spec_kind` of every recurrent state):
stored when taken, removed when dropped, and its host and disk tiers likewise. The key chains the
snapshot's tail (the tokens after its prefix's last full block, 1 to B of them: the event's
token_ids) from that block's key (`radixkv.cache.state_tiers`), so a snapshot at a block
boundary carries the hash of the KV block that ends there.

Block hashes are the wire form of the blocks' chained keys (`radixkv.cache.keys`: xxh64 by
default, or vLLM's sha256_cbor chain), so that a hash names the whole prefix ending at its block,
namespace-salted (the wire still shows `parent_block_hash=None` for a first block). The tree and
the tiers name a block by the same key, so the events of every tier agree under either chain.

Recording is the cache's choice at construction (`PrefixCache(kv_events=True)`), as in SGLang's
radix cache and vLLM's block pool: the cache appends events to a queue and its owner drains it
(`PrefixCache.take_events()`, after each engine step). A cache built without it has no recorder
at all: no queue (and, without lower tiers, no hashing). Recording from the first block on means
the queue describes the whole content, with no snapshot to take; a router that joins later
re-syncs from the publisher's replay buffer, as it does with vLLM.

Where the cache produces them: a full block of a path is announced by the node in which it ENDS
(block i by the node with start < (i+1)*B <= end), from the keys the node keeps. Tokens enter the
tree only as new leaves (`stored`); they leave only when a leaf is trimmed or removed (`removed`),
or all at once (`cleared`). A split changes no block's key; block ids (copy-on-write copies,
superseded tails, co-owned heads) never enter a key, so re-owning a block announces nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.cache.keys import BlockKey
from radixkv.cache.node import TreeNode


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
    group_idx: int = 0  # the KV cache group: 0 full-attention layers, then window / state
    sliding_window: int | None = None  # the group's window (None: full attention)
    # vLLM's kv_cache_spec_kind where the group says more than its window: "mamba" for the
    # recurrent-state group's snapshots (`radixkv.cache.state_tiers`); None: attention
    kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Full blocks left the cache (deepest first along a path)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None  # the tier ("CPU": host, "DISK"); None: the device pool
    group_idx: int = 0  # the KV cache group, as in `BlockStored`


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block left the cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventRecorder:
    """The queue of events as blocks enter and leave a tier, which the cache's owner drains.
    The cache calls `stored`, `removed` and `cleared` where its paths change; the lower tiers
    where theirs do, naming their `medium`.

    Invariant (`check_integrity`): every attached node keeps its block keys (announced when it
    was attached; the key chain checks their values).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.queue: list[KVEvent] = []

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first; the queue is left empty."""
        events, self.queue = self.queue, []
        return events

    def stored(
        self,
        keys: Sequence[BlockKey],
        namespace: str | None = None,
        medium: str | None = None,
        *,
        group: int = 0,
        window: int | None = None,
        kind: str | None = None,
    ) -> None:
        """Consecutive full blocks of one path entered a tier; `namespace` is published only
        with a path's block 0. `group`: the KV cache group whose blocks they are, `window` its
        sliding window (None: it reads every token), `kind` its kind when not attention's (a
        snapshot: one key, whose tokens are its tail)."""
        if keys:
            parent = keys[0].parent_hash
            tokens = tuple(np.frombuffer(b"".join(k.tokens for k in keys), "<u4").tolist())
            hashes = tuple(k.block_hash for k in keys)
            namespace = namespace if parent is None else None
            B = self.block_size
            event = BlockStored(hashes, parent, tokens, B, namespace, medium, group, window, kind)
            self.queue.append(event)

    def removed(self, hashes: Sequence[int], medium: str | None = None, *, group: int = 0) -> None:
        """Blocks (deepest first along a path) of KV cache group `group` left a tier."""
        if hashes:
            self.queue.append(BlockRemoved(tuple(hashes), medium, group))

    def cleared(self) -> None:
        self.queue.append(AllBlocksCleared())

    def check_integrity(self, nodes: Iterable[TreeNode]) -> None:
        """The class invariant over the tree's attached `nodes`. Raises AssertionError naming
        the node's segment."""
        for node in nodes:
            if node.block_keys is None:
                raise AssertionError(f"[{node.start},{node.end}) was never hashed")
