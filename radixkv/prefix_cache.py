"""PrefixCache: the public face of the radix tree over paged KV blocks (INTERFACE CONTRACT).

This file is the contract the scheduler and benchmarks are written against; bodies to be filled in.

Ownership model (see DESIGN.md):
* A physical block's ref count = number of tree nodes owning it + number of *private* holders.
* `allocate(n)` hands out private blocks (ref 1, held by the caller). `free(ids)` gives them back.
* Blocks a request uses from a match are *not* ref-counted by the request: they are protected by the
  request's `LockHandle` on the deepest matched node (node and ancestors have lock_ref > 0).
* `insert` transfers private blocks to the tree (no ref change), co-owns tree blocks the new node
  touches (ref +1), frees private duplicates of what the tree already holds, and always returns a new
  lock handle on the deepest node of the inserted path (caller must release it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Read-only result of `PrefixCache.match`. Safe to use only until the cache next mutates."""

    num_query_tokens: int  # len(tokens) given to match()
    num_cached_tokens: int  # m: tokens [0, m) have KV in the cache
    block_ids: tuple[int, ...]  # physical blocks of indices 0 .. ceil(m/B)-1 (last may be partial)
    num_partial_slots: int  # m % B: valid slots of the last block when it is partial, else 0
    _node: Any = field(default=None, repr=False, compare=False)  # deepest node touched (internal)
    _version: int = field(default=-1, repr=False, compare=False)  # cache version at match time

    @property
    def last_block_partial(self) -> bool:
        return self.num_partial_slots != 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_ids) - (1 if self.last_block_partial else 0)


@dataclass(frozen=True, slots=True)
class LockHandle:
    """A lock on a tree path. Release exactly once with `PrefixCache.release`."""

    handle_id: int
    num_tokens: int  # length of the locked path prefix the holder relies on


@dataclass(frozen=True, slots=True)
class InsertResult:
    num_new_tokens: int  # tokens added to the tree by this call
    block_ids: tuple[int, ...]  # canonical table for tokens[0:n): use these from now on
    owned_block_ids: tuple[int, ...]  # blocks of block_ids still privately owned by the caller
    num_freed_duplicates: int  # caller's private duplicates returned to the free list
    handle: LockHandle  # new lock on the inserted path (the `handle` argument, if any, is released)


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_evictable_blocks: int  # cached, owned only by unlocked nodes
    num_in_use_blocks: int  # locked-path blocks + private blocks
    num_nodes: int
    num_queries: int  # acquire() calls
    num_query_tokens: int
    num_hit_tokens: int
    num_computed_tokens: int  # query tokens not served by the cache
    num_evicted_blocks: int
    num_evicted_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


@dataclass(frozen=True, slots=True)
class NodeView:
    """Snapshot of one tree node for display (`PrefixCache.nodes()`, depth-first order)."""

    node_id: int
    parent_id: int | None
    depth: int  # root = 0
    start: int  # absolute token positions [start, end)
    end: int
    block_ids: tuple[int, ...]
    lock_ref: int
    last_access: int  # logical tick
    head_tokens: tuple[int, ...]  # first few tokens of the segment


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int) -> None: ...

    num_blocks: int
    block_size: int

    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_evictable_blocks(self) -> int: ...
    def can_allocate(self, num_blocks: int) -> bool: ...  # free + evictable >= n

    def match(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of tokens, at most max_tokens long. Mutates nothing."""
        ...

    def acquire(self, match: MatchResult) -> LockHandle:
        """Lock the matched path, refresh recency (new tick on every node of the path), count stats.
        Raises ValueError for a stale match (cache changed since match())."""
        ...

    def release(self, handle: LockHandle) -> None:
        """Unlock. ValueError if foreign or already released."""
        ...

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Private blocks (evicting LRU leaves on demand); None, with nothing changed, if it cannot fit."""
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """Return private blocks. ValueError (nothing freed) if any is not privately held."""
        ...

    def insert(
        self, tokens: Sequence[int], block_ids: Sequence[int], *, handle: LockHandle | None = None
    ) -> InsertResult:
        """Insert tokens[0:n) whose KV lives in block_ids (len == ceil(n/B)). See module docstring."""
        ...

    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks by evicting LRU unlocked leaves (tail first); returns freed ids in order."""
        ...

    def stats(self) -> CacheStats: ...
    def nodes(self) -> Iterator[NodeView]: ...
    def check_integrity(self) -> None: ...
