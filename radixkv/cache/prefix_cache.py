"""PrefixCache: the public face of the radix tree over paged KV blocks.

Layers: `BlockPool` (physical blocks, ref counts, free list) <- `RadixTree` (token paths, block
ownership, locks, eviction order) <- `PrefixCache` (this module: validation of caller input, lock
handles, private blocks, statistics).

Ownership model (the invariants in the README):
* A physical block's ref count = number of tree nodes owning it + number of *private* holders
  (0 or 1: a block is never both private and owned by the tree).
* `allocate(n)` hands out private blocks (ref 1, held by the caller). `free(ids)` gives them back.
* Blocks a request uses from a match are *not* ref-counted by the request: they are protected by the
  request's `LockHandle` on the deepest matched node (node and ancestors have lock_ref > 0).
* `insert` transfers private blocks to the tree (no ref change), co-owns tree blocks the new node
  touches (ref +1), frees private duplicates of what the tree already holds, and always returns a
  new lock handle on the deepest node of the inserted path (caller must release it).

Block accounting, always: `num_free + num_evictable + num_in_use == num_blocks`, where evictable =
cached blocks whose owners are all unlocked (what `evict` can free) and in use = private blocks +
blocks of locked paths.

The cache is deterministic: recency comes from a logical clock that advances once per `acquire`
and per `insert` (the operations that touch a path); nothing reads the wall clock. It is not
thread-safe.

A request's life (B = block size, `m` = cached tokens):

    match(prompt, max_tokens=len(prompt)-1)   read-only; m tokens, blocks 0..ceil(m/B)-1
    can_allocate(n, reserve=match)            read-only; False: wait, the cache is untouched
    acquire(match) -> handle                  lock the path before allocating (allocation evicts)
    allocate(...)                             a fresh block for the copy-on-write of a partial last
                                              block (m % B slots) + blocks for the uncached tokens
    insert(written, table, handle=handle)     adopt the new blocks, free duplicates; new handle
    release(result.handle); free(result.owned_block_ids)

Tokens are any sequence of ints, validated on every call (a list costs ~8 ns a token); a caller
that hands the same tokens to several calls can validate them once with `PackedTokens`. Under
`handle=`, insert does not walk the tree again over the prefix the handle locks.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, TypeVar

from radixkv.cache.pool import BlockPool
from radixkv.cache.tree import RadixTree, TreeNode, block_id_array, pack_tokens, unpack_tokens
from radixkv.cache.validation import check_size

logger = logging.getLogger(__name__)

_HEAD_TOKENS = 8  # tokens shown per node by nodes()

_T = TypeVar("_T")


def _positional_constructor(cls: type[_T]) -> Callable[..., _T]:
    """A constructor for the frozen slots dataclass `cls`, for the per-request hot path.

    The generated `__init__` of a frozen dataclass sets each field with `object.__setattr__` (a
    global lookup, an attribute lookup and a call per field), which made building the three
    result objects of a request cost microseconds. This one writes the slots through their
    descriptors, looked up once. `make(*values)` gives the same object as `cls(*values)` with
    every field passed positionally, in declaration order (there is no `__post_init__`).
    """
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    namespace.update({f"_set_{name}": getattr(cls, name).__set__ for name in names})
    lines = [f"def make({', '.join(names)}):", "    self = _new(_cls)"]
    lines += [f"    _set_{name}(self, {name})" for name in names]
    lines.append("    return self")
    exec("\n".join(lines), namespace)  # the same technique dataclasses use for __init__
    return namespace["make"]


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Read-only result of `PrefixCache.match`. Safe to use only until the cache next mutates."""

    num_query_tokens: int  # len(tokens) given to match()
    num_cached_tokens: int  # m: tokens [0, m) have KV in the cache
    block_ids: tuple[int, ...]  # physical blocks of indices 0 .. ceil(m/B)-1 (last may be partial)
    num_partial_slots: int  # m % B: valid slots of the last block when it is partial, else 0
    _node: Any = field(default=None, repr=False, compare=False)  # deepest node touched (internal)
    _version: int = field(default=-1, repr=False, compare=False)  # cache version at match time
    _owner: Any = field(default=None, repr=False, compare=False)  # the tree that matched (internal)
    _tokens: bytes = field(default=b"", repr=False, compare=False)  # the packed query (internal)

    @property
    def last_block_partial(self) -> bool:
        return self.num_partial_slots != 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_ids) - (1 if self.last_block_partial else 0)


@dataclass(frozen=True, slots=True)
class LockHandle:
    """A lock on a tree path. Release exactly once with `PrefixCache.release`.

    A handle that is garbage-collected while still locked is reported (ResourceWarning, a log line
    and `CacheStats.num_leaked_handles`); its lock is deliberately *not* released, so what the cache
    does never depends on when the garbage collector runs.
    """

    handle_id: int
    num_tokens: int  # length of the locked path prefix the holder relies on
    _owner: Any = field(default=None, repr=False, compare=False)  # weakref to the issuing cache

    def __del__(self) -> None:
        owner = self._owner
        if owner is not None:
            cache = owner()
            # Released handles (the common case) are checked here, without a method call.
            if cache is not None and self.handle_id in cache._live:
                cache._handle_dropped(self.handle_id)


class _Lock(NamedTuple):
    """What the cache keeps per live handle. While the lock holds, tokens [0, num_tokens) stay on
    the tree along the path to `node` with exactly these blocks (a locked path is never evicted
    or trimmed, and a split keeps the block of every index), so `insert(handle=)` resumes its
    walk there instead of reading the prefix again."""

    node: TreeNode  # position num_tokens lies in it, or (after a split) in an ancestor
    tokens: bytes  # packed; its first num_tokens tokens are the locked path's
    num_tokens: int
    block_ids: tuple[int, ...]  # the path's blocks of indices 0 .. ceil(num_tokens/B)-1


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
    num_nodes: int  # tree nodes, root excluded
    num_queries: int  # acquire() calls
    num_query_tokens: int
    num_hit_tokens: int
    num_computed_tokens: int  # query tokens not served by the cache
    num_evicted_blocks: int
    num_evicted_tokens: int
    num_private_blocks: int = 0  # allocated and not yet adopted by the tree or freed
    num_cached_tokens: int = 0  # tokens held by the tree
    num_live_handles: int = 0
    num_leaked_handles: int = 0  # handles garbage-collected without release() (still locked)
    num_inserts: int = 0
    num_inserted_tokens: int = 0  # new tokens added to the tree by insert()
    num_duplicate_blocks_freed: int = 0  # private duplicates insert() returned to the free list
    # partial tails of a node that insert() replaced by the new child's copy and freed
    num_superseded_tails_freed: int = 0

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


_new_match = _positional_constructor(MatchResult)
_new_lock_handle = _positional_constructor(LockHandle)
_new_insert_result = _positional_constructor(InsertResult)
_tuple_new = tuple.__new__  # _tuple_new(_Lock, (...)) skips NamedTuple's Python-level __new__


class PrefixCache:
    """Token-granular prefix cache over `num_blocks` blocks of `block_size` tokens.

    Invariants (recomputed by `check_integrity`, which tests call after every operation):
    * every block is free, private (ref 1, in `_private`) or owned by tree nodes (ref = owners);
    * `num_free + num_evictable + num_in_use == num_blocks`;
    * every live handle locks one attached node and its ancestors; lock_ref = handles in subtree;
    * plus the `RadixTree` and `BlockPool` invariants.

    Caller mistakes raise TypeError/ValueError naming the argument before anything changes;
    `allocate` returns None (nothing changed) when the blocks are not there.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._pool = BlockPool(num_blocks, block_size)
        self.num_blocks: int = self._pool.num_blocks
        self.block_size: int = self._pool.block_size
        self._tree = RadixTree(self._pool)
        self._private: set[int] = set()
        self._live: dict[int, _Lock] = {}  # handle id -> what it locks
        self._next_handle_id = 1
        self._clock = 0
        self._selfref = weakref.ref(self)
        self._num_queries = 0
        self._num_query_tokens = 0
        self._num_hit_tokens = 0
        self._num_computed_tokens = 0
        self._num_evicted_blocks = 0
        self._num_evicted_tokens = 0
        self._num_leaked_handles = 0
        self._num_inserts = 0
        self._num_inserted_tokens = 0
        self._num_duplicates_freed = 0
        self._num_superseded_freed = 0

    def __repr__(self) -> str:
        return (
            f"PrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size},"
            f" free={self.num_free_blocks}, evictable={self.num_evictable_blocks},"
            f" nodes={self._tree.num_nodes})"
        )

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        return self._tree.num_evictable_blocks

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free - self._tree.num_evictable_blocks

    @property
    def num_private_blocks(self) -> int:
        return len(self._private)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held by the tree."""
        return self._tree.num_cached_tokens

    @property
    def num_nodes(self) -> int:
        """Tree nodes, root excluded."""
        return self._tree.num_nodes

    @property
    def num_live_handles(self) -> int:
        return len(self._live)

    @property
    def version(self) -> int:
        """Changes on every structural mutation; a MatchResult from another version is stale."""
        return self._tree.version

    def can_allocate(self, num_blocks: int, *, reserve: MatchResult | None = None) -> bool:
        """Whether `allocate(num_blocks)` would succeed now, or, given `reserve`, right after
        `acquire(reserve)`. Read-only: no stats, no recency, no lock, in either form.

        Locking a match pins the blocks of its path that are evictable now (the blocks of every
        path node not locked yet), so `can_allocate(n)` alone over-promises to a caller that
        acquires first. Admission asks `can_allocate(n, reserve=match)` and acquires only if it
        is True, so a request that does not fit leaves the cache untouched. Exact: True iff
        free + evictable - pinned >= num_blocks. O(unlocked part of the path). Raises
        TypeError/ValueError for a bad count, and like `acquire` for a stale or foreign match.
        """
        n = check_size(num_blocks, "num_blocks", low=0)
        available = self._pool.num_free + self._tree.num_evictable_blocks
        if reserve is not None:
            available -= self._tree.num_blocks_pinned_by_lock(self._matched_node(reserve))
        return available >= n

    # ----------------------------------------------------------------- matching
    def match(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of tokens, at most max_tokens long. Mutates nothing.

        Scoring waiting requests may call this freely: no split, no recency refresh, no lock. The
        scheduler passes `max_tokens=len(tokens) - 1` for a prefill (the last prompt token is always
        computed, so there are logits to sample from). Raises TypeError/ValueError for token ids
        that are not ints in [0, 2**32) or a negative max_tokens.
        """
        qb = pack_tokens(tokens)
        n = len(qb) >> 2
        limit = n
        if max_tokens is not None:
            cap = check_size(max_tokens, "max_tokens", low=0)
            if cap < limit:
                limit = cap
        tree = self._tree
        m, node, blocks = tree.walk(qb, limit)
        return _new_match(n, m, tuple(blocks), m % self.block_size, node, tree.version, tree, qb)

    def acquire(self, match: MatchResult) -> LockHandle:
        """Lock the matched path, refresh recency (new tick on every node of the path), count stats.

        Recency is kept lazily (only the matched node is stamped; see `RadixTree`), with exactly the
        eviction order of stamping the whole path. A match of 0 tokens locks the root (a no-op
        lock). Raises TypeError for a non-MatchResult and ValueError for a stale match (the cache
        changed structurally since match()) or one from another cache; nothing changes then.
        """
        node = self._matched_node(match)
        tick = self._tick()
        self._tree.lock_path(node, tick)
        m = match.num_cached_tokens
        self._num_queries += 1
        self._num_query_tokens += match.num_query_tokens
        self._num_hit_tokens += m
        self._num_computed_tokens += match.num_query_tokens - m
        return self._new_handle(_tuple_new(_Lock, (node, match._tokens, m, match.block_ids)))

    def release(self, handle: LockHandle) -> None:
        """Unlock. ValueError if foreign or already released."""
        lock = self._live_lock(handle)
        del self._live[handle.handle_id]
        self._tree.unlock_path(lock.node)

    # --------------------------------------------------------------- allocation
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Private blocks (evicting LRU leaves on demand); None, nothing changed, if it cannot fit.

        Evicts only as many blocks as the free list lacks. Raises TypeError/ValueError for a count
        that is not an int >= 0.
        """
        n = check_size(num_blocks, "num_blocks", low=0)
        pool = self._pool
        short = n - pool.num_free
        if short > 0:
            if short > self._tree.num_evictable_blocks:
                return None
            self._evict(short)
        ids = pool.take(n)
        assert ids is not None, "eviction freed fewer blocks than it counted as evictable"
        self._private.update(ids)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Return private blocks. ValueError (nothing freed) if any is not privately held."""
        ids = self._block_id_array(block_ids, "block_ids").tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"block_ids contains a repeated id: {ids}")
        private = self._private
        foreign = [b for b in ids if b not in private]
        if foreign:
            for i, b in enumerate(ids):
                self._check_block_range("block_ids", i, b)
            raise ValueError(
                f"block_ids {foreign} are not held privately by the caller (never allocated,"
                " already freed, or adopted by the tree)"
            )
        private.difference_update(ids)
        self._pool.drop_refs(ids[::-1])  # reversed: handed out again in the order given

    # ---------------------------------------------------------------- insertion
    def insert(
        self, tokens: Sequence[int], block_ids: Sequence[int], *, handle: LockHandle | None = None
    ) -> InsertResult:
        """Insert tokens[0:n) whose KV lives in block_ids (len == ceil(n/B)).

        Let p = the cached prefix of tokens. Per block index i (caller's positions
        [i*B, min((i+1)*B, n))):

            covered by the tree (positions all < p):
                block_ids[i] is the tree's block     -> nothing
                a private block                      -> duplicate: freed, the tree's block is used;
                                                        except the partial last block when n == p,
                                                        which the caller keeps (it writes on there)
                a block a shallower path node owns   -> nothing (the caller's own earlier tail);
                  at that index                         kept in the table if it is the partial last
            new (index >= p // B, when n > p): tokens [p, n) become a new leaf (after splitting the
            node holding p) that owns:
                a private block                      -> transferred (no ref change)
                a path node's block at that index    -> co-owned (ref + 1); only the first index,
                  (p % B != 0)                          e.g. the partial tail of an earlier insert
            anything else                            -> ValueError naming the index
            When the leaf starts at its parent's mid-block end with a private copy of the parent's
            partial tail, the parent has no other child, no other live handle in its subtree and
            is that tail's only owner, the parent co-owns the copy and its old tail is freed (no
            path could read it any more; `CacheStats.num_superseded_tails_freed`).

        Returns the canonical table, the caller's still-private blocks, the number of duplicates
        freed, and a new lock handle on the deepest node of tokens[0:n) (path recency refreshed);
        `handle`, if given, is released after the new lock is taken. Everything is validated
        (TypeError/ValueError) before anything changes.
        """
        qb = pack_tokens(tokens)
        n = len(qb) >> 2
        B = self.block_size
        id_array = self._block_id_array(block_ids, "block_ids")
        num_idx = -(-n // B)
        if len(id_array) != num_idx:
            raise ValueError(
                f"block_ids has {len(id_array)} entries; {n} tokens with block_size {B} need"
                f" exactly ceil({n}/{B}) = {num_idx}"
            )
        tree = self._tree
        if handle is None:
            old_node = None
            p, node, canonical = tree.walk(qb, n)
        else:
            old = self._live_lock(handle)
            old_node = old.node
            p, node, canonical = self._walk_past_lock(old, qb, n)
        private = self._private

        # Indices the tree already covers: compare with its blocks. The common case is a caller
        # that used exactly the cached blocks: one C-level compare, and no int object made for the
        # covered ids (the table returned is built from the tree's own list).
        covered = num_idx if p == n else p // B
        if len(canonical) > covered:
            del canonical[covered:]
        duplicates: list[int] = []
        kept: int | None = None
        path_ids: tuple[int, ...] | None = None  # the path's blocks, if they differ from the table
        new_ids = id_array[covered:].tolist()
        if type(block_ids) is list:
            # The ids are validated ints; a table built from the match holds the tree's own int
            # objects, which the list compare takes by identity (no uint32 array of the tree's).
            as_cached = block_ids[:covered] == canonical
        else:
            as_cached = id_array[:covered] == array("I", canonical)
        # Repeated ids: the blocks of a tree path are distinct, so when the covered part is exactly
        # the tree's, only the new part needs checking (and it is short).
        if len(set(new_ids)) != len(new_ids) or (not as_cached and len(set(id_array)) != num_idx):
            raise ValueError(f"block_ids contains a repeated id: {id_array.tolist()}")
        if not as_cached:
            ids = id_array.tolist()
            partial_tail = num_idx - 1 if p == n and n % B else -1
            if partial_tail >= 0:
                path_ids = tuple(canonical)  # before the table keeps the caller's tail block
            for i in range(covered):
                b = ids[i]
                if b == canonical[i]:
                    continue
                if b in private:
                    if i == partial_tail:
                        kept = canonical[i] = b
                    else:
                        duplicates.append(b)
                elif b < self.num_blocks and tree.path_block_at(node, i, p, b):
                    if i == partial_tail:
                        canonical[i] = b
                else:
                    self._check_block_range("block_ids", i, b)
                    raise ValueError(
                        f"block_ids[{i}] = {b} is neither the cached block {canonical[i]} at block"
                        f" index {i} nor a block the caller holds privately"
                    )
        # New indices: private blocks, or (first index only) a path block co-owned mid-block.
        co_owned: int | None = None
        if new_ids and not private.issuperset(new_ids):
            for j, b in enumerate(new_ids):
                if b in private:
                    continue
                if j == 0 and p % B and tree.path_block_at(node, covered, p, b):
                    co_owned = b
                    continue
                self._check_block_range("block_ids", covered + j, b)
                raise ValueError(
                    f"block_ids[{covered + j}] = {b} is not held privately by the caller (never"
                    " allocated, freed, or owned by the tree elsewhere); new tokens need private"
                    " blocks"
                )

        # ---- validated: commit ----
        tick = self._tick()
        if handle is not None:
            del self._live[handle.handle_id]  # its lock moves to the new handle below
        if n > p:
            if p < node.end:
                node = tree.split(node, p)
            if old_node is None:
                tree.lock_path(node, tick)
            else:
                tree.move_lock(old_node, node, tick)
            if co_owned is not None:
                self._pool.incref(co_owned)
                head_shared = True
            elif p % B and not node.children:
                # The leaf's first block is the caller's copy of node's partial tail: node may
                # take the copy over and free its own tail, which nothing could use any more.
                superseded = tree.supersede_tail(node, new_ids[0])
                head_shared = superseded is not None
                if head_shared:
                    self._num_superseded_freed += 1
            else:
                head_shared = False
            private.difference_update(new_ids)
            target = tree.attach_leaf(
                node,
                qb[4 * p :],
                new_ids,
                head_shared=head_shared,
                lock_ref=1,
                tick=tick,
            )
            canonical += new_ids
        else:
            target = node
            if old_node is None:
                tree.lock_path(node, tick)
            else:
                tree.move_lock(old_node, node, tick)
        if duplicates:
            private.difference_update(duplicates)
            self._pool.drop_refs(duplicates[::-1])
        table = tuple(canonical)
        path = table if path_ids is None else path_ids
        new_handle = self._new_handle(_tuple_new(_Lock, (target, qb, n, path)))
        self._num_inserts += 1
        self._num_inserted_tokens += n - p
        self._num_duplicates_freed += len(duplicates)
        return _new_insert_result(
            n - p,  # num_new_tokens
            table,  # block_ids
            () if kept is None else (kept,),  # owned_block_ids
            len(duplicates),  # num_freed_duplicates
            new_handle,  # handle
        )

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks by evicting LRU unlocked leaves (tail first); returns freed ids.

        Fewer than asked (possibly none) means nothing else is evictable. A leaf with more blocks
        than still needed is trimmed from its tail (its head stays cached). Raises TypeError/
        ValueError for a count that is not an int >= 0.
        """
        return self._evict(check_size(num_blocks, "num_blocks", low=0))

    def _evict(self, n: int) -> list[int]:
        freed, num_tokens = self._tree.evict(n)
        self._num_evicted_blocks += len(freed)
        self._num_evicted_tokens += num_tokens
        return freed

    # ------------------------------------------------------------------ reports
    def stats(self) -> CacheStats:
        tree = self._tree
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=self._pool.num_free,
            num_evictable_blocks=tree.num_evictable_blocks,
            num_in_use_blocks=self.num_in_use_blocks,
            num_nodes=tree.num_nodes,
            num_queries=self._num_queries,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_computed_tokens=self._num_computed_tokens,
            num_evicted_blocks=self._num_evicted_blocks,
            num_evicted_tokens=self._num_evicted_tokens,
            num_private_blocks=len(self._private),
            num_cached_tokens=tree.num_cached_tokens,
            num_live_handles=len(self._live),
            num_leaked_handles=self._num_leaked_handles,
            num_inserts=self._num_inserts,
            num_inserted_tokens=self._num_inserted_tokens,
            num_duplicate_blocks_freed=self._num_duplicates_freed,
            num_superseded_tails_freed=self._num_superseded_freed,
        )

    def nodes(self) -> Iterator[NodeView]:
        """Snapshots of all nodes, root first, depth-first, children by increasing first token."""
        last_use = self._tree.last_uses()
        for node, depth in self._tree.iter_nodes():
            parent = node.parent
            yield NodeView(
                node_id=node.node_id,
                parent_id=None if parent is None else parent.node_id,
                depth=depth,
                start=node.start,
                end=node.end,
                block_ids=tuple(node.blocks),
                lock_ref=node.lock_ref,
                last_access=last_use[node.node_id],
                head_tokens=unpack_tokens(node.tokens[: 4 * _HEAD_TOKENS]),
            )

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch; raise AssertionError naming the first violation.

        O(num_blocks + tree size): for tests and debugging, not for the hot path.
        """
        pool = self._pool
        pool.check_integrity()
        handles_on = Counter(lock.node.node_id for lock in self._live.values())
        owners = self._tree.check_integrity(handles_on, self._clock)
        private = self._private
        for b in private:
            if not 0 <= b < self.num_blocks:
                raise AssertionError(f"private block id {b} out of range")
            if b in owners:
                raise AssertionError(f"block {b} is both private and owned by the tree")
        for b, ref in enumerate(pool._refs):
            expected = owners.get(b, 0) + (b in private)
            if ref != expected:
                raise AssertionError(
                    f"block {b} ref count {ref} != {expected} owners"
                    f" ({owners.get(b, 0)} nodes, private={b in private})"
                )
        evictable = self._tree.num_evictable_blocks
        in_use = len(private) + len(owners) - evictable
        if pool.num_free + evictable + in_use != self.num_blocks:
            raise AssertionError(
                f"free {pool.num_free} + evictable {evictable} + in use {in_use}"
                f" != {self.num_blocks} blocks"
            )
        if self._num_hit_tokens + self._num_computed_tokens != self._num_query_tokens:
            raise AssertionError("hit + computed tokens != query tokens")
        if self._live and max(self._live) >= self._next_handle_id:
            raise AssertionError("a live handle id was never issued")
        # Each lock's recorded prefix is the tree's: tokens and blocks, on the locked node's path
        # (the node holding its last position is the locked node or, after a split, an ancestor).
        tree = self._tree
        for hid, lock in self._live.items():
            k = lock.num_tokens
            m, holder, blocks = tree.walk(lock.tokens[: 4 * k], k)
            if m != k or tuple(blocks) != lock.block_ids:
                raise AssertionError(
                    f"handle {hid}: {m} of its {k} locked tokens are on the tree, blocks"
                    f" {blocks} != recorded {lock.block_ids}"
                )
            node = lock.node
            while node is not holder:
                if node is tree.root:
                    raise AssertionError(f"handle {hid}: its prefix is not on its node's path")
                node = node.parent  # type: ignore[assignment]

    # ---------------------------------------------------------------- internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_handle(self, lock: _Lock) -> LockHandle:
        hid = self._next_handle_id
        self._next_handle_id = hid + 1
        self._live[hid] = lock
        return _new_lock_handle(hid, lock.num_tokens, self._selfref)

    def _matched_node(self, match: MatchResult) -> TreeNode:
        """The node a current match of this cache ends at; TypeError/ValueError otherwise."""
        if not isinstance(match, MatchResult):
            raise TypeError(f"match must be a MatchResult, got {type(match).__name__}")
        tree = self._tree
        node = match._node
        if match._owner is not tree or not isinstance(node, TreeNode):
            raise ValueError("match was not produced by this cache")
        # Same version => no structural change since the match: the node is still in the tree.
        if match._version != tree.version:
            raise ValueError(
                f"stale match: taken at cache version {match._version}, cache is at"
                f" {tree.version}; match() again"
            )
        return node

    def _live_lock(self, handle: LockHandle) -> _Lock:
        """What a live handle of this cache locks; TypeError/ValueError otherwise."""
        if not isinstance(handle, LockHandle):
            raise TypeError(f"handle must be a LockHandle, got {type(handle).__name__}")
        lock = self._live.get(handle.handle_id)
        if lock is None or handle._owner is not self._selfref:
            raise ValueError(
                f"handle {handle.handle_id} is not a live handle of this cache (already released,"
                " or issued by another cache)"
            )
        return lock

    def _walk_past_lock(self, lock: _Lock, qb: bytes, n: int) -> tuple[int, TreeNode, list[int]]:
        """`tree.walk(qb, n)`, resumed after the prefix `lock` holds when qb starts with it.

        The common insert: a request inserts what it wrote under the handle of its own match or
        earlier insert. One memcmp of the prefix replaces the walk over every node of its path.
        """
        k = lock.num_tokens
        if k == 0 or k > n:
            return self._tree.walk(qb, n)
        locked = lock.tokens
        if not qb.startswith(locked if len(locked) == 4 * k else locked[: 4 * k]):
            return self._tree.walk(qb, n)  # another sequence than the one the handle locks
        node = lock.node
        while node.start >= k:  # split at a position >= k since: k is in an ancestor now
            node = node.parent  # type: ignore[assignment]
        return self._tree.walk_from(node, k, list(lock.block_ids), qb, n)

    def _handle_dropped(self, handle_id: int) -> None:
        """Called when a LockHandle object is garbage-collected: report it if still locked."""
        if handle_id in self._live:
            self._num_leaked_handles += 1
            logger.warning(
                "lock handle %d was dropped without release(); its path stays locked", handle_id
            )
            warnings.warn(
                f"LockHandle {handle_id} was garbage-collected without PrefixCache.release();"
                " its path stays locked",
                ResourceWarning,
                stacklevel=2,
            )

    def _block_id_array(self, block_ids: Sequence[int], name: str) -> array:
        """Block ids as array('I') (ints >= 0); TypeError/ValueError naming the culprit.

        The upper bound is not checked here: every id must also be private or the tree's block at
        its index, which no out-of-range id is; `_check_block_range` words that rejection.
        """
        if type(block_ids) is list:  # the common table: straight to the one C pass
            try:
                return array("I", block_ids)
            except (TypeError, OverflowError):
                pass  # named below
        try:
            return block_id_array(block_ids, name)
        except ValueError:
            for i, b in enumerate(block_ids):
                self._check_block_range(name, i, int(b))
            raise  # pragma: no cover

    def _check_block_range(self, name: str, i: int, b: int) -> None:
        if not 0 <= b < self.num_blocks:
            raise ValueError(f"{name}[{i}] = {b} is out of range [0, {self.num_blocks})")
