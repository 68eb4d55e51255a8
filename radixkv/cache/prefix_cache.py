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

Namespaces isolate tenants: `match` and `insert` take `namespace=` (None: the shared one); what is
cached under one namespace never matches under another. They share the blocks and one eviction
order (GDSF over the path tokens that evicting a leaf's last block loses, by default; see
`radixkv.cache.eviction`).

KV events (`radixkv.cache.events`): `cache.events.subscribe(callback)` streams which full blocks
enter and leave the cache, for cache-aware routers; `reset()` drops everything cached.

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

A scheduler holds all of that in one `BlockTable` per request: `admit` (match, check the fit,
acquire, allocate, copy-on-write), `grow` (blocks for decoding), `commit` (insert what was written,
adopt the canonical table) and `close` (release and free).

Tokens are any sequence of ints, validated on every call; a caller that hands the same tokens to
several calls can validate them once with `PackedTokens`. Under `handle=`, insert does not walk
the tree again over the prefix the handle locks.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from radixkv.cache.events import KVEventStream
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.pool import BlockPool
from radixkv.cache.tokens import pack_tokens, uint32_array, unpack_tokens
from radixkv.cache.tree import InsertPlan, RadixTree, TreeNode, Walk
from radixkv.cache.validation import check_size

logger = logging.getLogger(__name__)

_HEAD_TOKENS = 8  # tokens shown per node by nodes()
_COUNTERS = (
    "num_queries",
    "num_query_tokens",
    "num_hit_tokens",
    "num_evicted_blocks",
    "num_evicted_tokens",
    "num_leaked_handles",
    "num_inserts",
    "num_inserted_tokens",
    "num_duplicate_blocks_freed",
    "num_superseded_tails_freed",
)


@dataclass(slots=True)
class _Matched:
    """What the cache matched, kept inside a MatchResult so that `acquire` can tell it from a
    result whose public fields were edited (e.g. with `dataclasses.replace`)."""

    tree: RadixTree
    version: int  # the tree's version at match time
    node: TreeNode | None  # deepest node touched; None: the namespace has no root yet
    tokens: bytes  # the packed query
    fields: tuple[object, ...]  # the MatchResult's public fields, as issued


@dataclass(slots=True)
class MatchResult:
    """Result of `PrefixCache.match`, to be read, not edited (`acquire` rejects an edited one).
    Safe to use only until the cache next mutates. Not frozen: one is made per request, and a
    frozen dataclass costs several times more to build (see RESULTS.md)."""

    num_query_tokens: int  # len(tokens) given to match()
    num_cached_tokens: int  # m: tokens [0, m) have KV in the cache
    block_ids: tuple[int, ...]  # physical blocks of indices 0 .. ceil(m/B)-1 (last may be partial)
    num_partial_slots: int  # m % B: valid slots of the last block when it is partial, else 0
    namespace: str | None = None  # the namespace matched in
    matched: _Matched | None = field(default=None, repr=False, compare=False)  # for acquire()

    @property
    def last_block_partial(self) -> bool:
        return self.num_partial_slots != 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_ids) - (1 if self.last_block_partial else 0)


@dataclass(slots=True, eq=False)
class _Lease:
    """The record every copy of one LockHandle shares (`copy`, `deepcopy` and
    `dataclasses.replace` keep it): when the last copy is garbage-collected while its lock is
    still held (its id still in the issuing cache's `live` table), the cache, if still alive,
    reports it, once."""

    handle_id: int
    live: dict[int, _Lock]
    report: weakref.WeakMethod  # the issuing cache's leak report, gone with the cache

    def __copy__(self) -> _Lease:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> _Lease:
        return self

    def __del__(self) -> None:
        if self.handle_id in self.live:  # released, the common case: no call
            report = self.report()
            if report is not None:
                report(self.handle_id)


@dataclass(slots=True)
class LockHandle:
    """A lock on a tree path. Release exactly once with `PrefixCache.release` (any copy will do).

    A handle garbage-collected (every copy of it) while still locked is reported (ResourceWarning,
    a log line and `CacheStats.num_leaked_handles`); its lock is deliberately *not* released, so
    what the cache does never depends on when the garbage collector runs.
    """

    handle_id: int
    num_tokens: int  # length of the locked path prefix the holder relies on
    lease: _Lease | None = field(default=None, repr=False, compare=False)  # shared by copies


@dataclass(slots=True)
class _Lock:
    """What the cache keeps per live handle. While the lock holds, tokens [0, num_tokens) stay on
    the tree along the path to `node` with exactly these blocks (a locked path is never evicted
    or trimmed, and a split keeps the block of every index), so `insert(handle=)` resumes its
    walk there instead of reading the prefix again."""

    node: TreeNode  # position num_tokens lies in it, or (after a split) in an ancestor
    tokens: bytes  # packed; its first num_tokens tokens are the locked path's
    num_tokens: int
    block_ids: tuple[int, ...]  # the path's blocks of indices 0 .. ceil(num_tokens/B)-1
    namespace: str | None


@dataclass(slots=True)
class InsertResult:
    num_new_tokens: int  # tokens added to the tree by this call
    block_ids: tuple[int, ...]  # canonical table for tokens[0:n): use these from now on
    owned_block_ids: tuple[int, ...]  # blocks of block_ids still privately owned by the caller
    num_freed_duplicates: int  # caller's private duplicates returned to the free list
    handle: LockHandle  # new lock on the inserted path (the `handle` argument, if any, is released)


@dataclass(slots=True, eq=False)
class BlockTable:
    """The blocks one request uses: issued by `PrefixCache.admit`, changed by `grow` and
    `commit`, given back by `close` (the cache's methods are its only writers).

    `blocks[i]` is the physical block of block index i. It is a tuple, replaced whole on every
    change, so whoever holds it (a scheduler step's rows) keeps what it was given without a copy.
    The entries that are not private are tree blocks that `handle` keeps locked (None: the table
    was admitted without the cache and holds private blocks only).
    """

    blocks: tuple[int, ...]
    handle: LockHandle | None
    num_cached_tokens: int  # the hit at admission: KV of tokens [0, m) is there already
    copy: tuple[int, int, int] | None  # (source, target, slots): copy-on-write of a partial hit
    # The issuing cache's record of every private block (its one home), read-only here.
    is_private: Callable[[int], bool] = field(repr=False)

    @property
    def private(self) -> set[int]:
        """The entries the request holds alone (allocated, not adopted by the tree)."""
        return {b for b in self.blocks if self.is_private(b)}


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_evictable_blocks: int  # cached, owned only by unlocked nodes
    num_in_use_blocks: int  # locked-path blocks + private blocks
    num_nodes: int  # tree nodes, roots excluded
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
    num_namespaces: int = 1  # tree roots: the shared one + namespaces holding something

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.num_hit_tokens, self.num_query_tokens)


def hit_rate(num_hit_tokens: int, num_query_tokens: int) -> float:
    """Fraction of query tokens served from the cache (0.0 before any query)."""
    return num_hit_tokens / num_query_tokens if num_query_tokens else 0.0


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
    """Token-granular prefix cache over `num_blocks` blocks of `block_size` tokens.

    Invariants (recomputed by `check_integrity`, which tests call after every operation):
    * every block is free, private (ref 1, in `_private`) or owned by tree nodes (ref = owners);
    * `num_free + num_evictable + num_in_use == num_blocks`;
    * every live handle locks one attached node and its ancestors; lock_ref = handles in subtree;
    * plus the `RadixTree` and `BlockPool` invariants.

    Caller mistakes raise TypeError/ValueError naming the argument before anything changes;
    `allocate` returns None (nothing changed) when the blocks are not there.
    """

    def __init__(self, num_blocks: int, block_size: int, *, eviction: str = "gdsf") -> None:
        """`eviction`: the order unlocked leaves go in, "gdsf" (fewest tokens lost per freed
        block, aged; see `radixkv.cache.eviction`) or "lru". Raises ValueError for another."""
        if eviction not in EVICTION_ORDERS:
            raise ValueError(f"eviction must be one of {sorted(EVICTION_ORDERS)}, got {eviction!r}")
        self._pool = BlockPool(num_blocks, block_size)
        self.num_blocks: int = self._pool.num_blocks
        self.block_size: int = self._pool.block_size
        self._tree = RadixTree(self._pool, EVICTION_ORDERS[eviction](self.block_size))
        # KV events (radixkv.cache.events): `cache.events.subscribe(callback)`.
        self.events: KVEventStream = self._tree.events.stream
        self._private: set[int] = set()
        self._live: dict[int, _Lock] = {}  # handle id -> what it locks
        self._next_handle_id = 1
        self._clock = 0
        # The statistics of `stats()` that are counters, by their field names.
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._on_leak = weakref.WeakMethod(self._report_leak)

    def __repr__(self) -> str:
        return (
            f"PrefixCache(num_blocks={self.num_blocks}, block_size={self.block_size},"
            f" free={self.num_free_blocks}, evictable={self.num_evictable_blocks},"
            f" nodes={self.num_nodes})"
        )

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def num_evictable_blocks(self) -> int:
        return self._tree.num_evictable_blocks

    @property
    def num_cached_tokens(self) -> int:
        """Tokens held by the tree."""
        return self._tree.num_cached_tokens

    @property
    def num_nodes(self) -> int:
        """Tree nodes, roots excluded."""
        return self._tree.num_nodes

    @property
    def version(self) -> int:
        """Changes on every structural mutation; a MatchResult from another version is stale."""
        return self._tree.version

    @property
    def num_in_use_blocks(self) -> int:
        return self.num_blocks - self._pool.num_free - self._tree.num_evictable_blocks

    @property
    def num_private_blocks(self) -> int:
        return len(self._private)

    @property
    def num_live_handles(self) -> int:
        return len(self._live)

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
            available -= self._tree.num_blocks_pinned_by_lock(self._matched(reserve).node)
        return available >= n

    # ----------------------------------------------------------------- matching
    def match(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int | None = None,
        namespace: str | None = None,
    ) -> MatchResult:
        """Longest prefix of tokens cached in `namespace`, at most max_tokens long. Mutates
        nothing.

        Scoring waiting requests may call this freely: no split, no recency refresh, no lock. The
        scheduler passes `max_tokens=len(tokens) - 1` for a prefill (the last prompt token is always
        computed, so there are logits to sample from). Raises TypeError/ValueError for token ids
        that are not ints in [0, 2**32), a negative max_tokens or a namespace that is not a str.
        """
        qb = pack_tokens(tokens)
        n = len(qb) // 4
        limit = n if max_tokens is None else min(n, check_size(max_tokens, "max_tokens", low=0))
        _check_namespace(namespace)
        m, node, blocks = self._tree.walk(qb, limit, namespace)
        fields = (n, m, tuple(blocks), m % self.block_size, namespace)
        return MatchResult(*fields, _Matched(self._tree, self._tree.version, node, qb, fields))

    def acquire(self, match: MatchResult) -> LockHandle:
        """Lock the matched path, refresh recency (new tick on every node of the path), count stats.

        Recency is kept lazily (only the matched node is stamped; see `RadixTree`), with exactly the
        eviction order of stamping the whole path. A match of 0 tokens locks its namespace's root
        (a no-op lock). Raises TypeError for a non-MatchResult and ValueError for a stale match
        (the cache changed structurally since match()), one from another cache or one whose
        fields were edited; nothing changes then.
        """
        matched = self._matched(match)
        node = matched.node or self._tree.open_root(match.namespace)
        self._clock += 1
        self._tree.lock_path(node, self._clock)
        m = match.num_cached_tokens
        self._counts["num_queries"] += 1
        self._counts["num_query_tokens"] += match.num_query_tokens
        self._counts["num_hit_tokens"] += m
        return self._new_handle(_Lock(node, matched.tokens, m, match.block_ids, match.namespace))

    def release(self, handle: LockHandle) -> None:
        """Unlock. TypeError for a non-handle; ValueError if foreign or already released."""
        lock = self._live_lock(handle)
        del self._live[handle.handle_id]
        self._tree.unlock_path(lock.node)

    # --------------------------------------------------------------- allocation
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Private blocks (evicting leaves on demand); None, nothing changed, if it cannot fit.

        Evicts only as many blocks as the free list lacks. Raises TypeError/ValueError for a count
        that is not an int >= 0.
        """
        ids = self._pool.allocate(num_blocks)  # checks the count
        if ids is None:
            short = num_blocks - self._pool.num_free
            if short > self._tree.num_evictable_blocks:
                return None
            self.evict(short)
            ids = self._pool.allocate(num_blocks)
            assert ids is not None, "eviction freed fewer blocks than it counted as evictable"
        self._private.update(ids)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Return private blocks. ValueError (nothing freed) if any is not privately held."""
        ids = self._block_id_array(block_ids).tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"block_ids contains a repeated id: {ids}")
        foreign = [b for b in ids if b not in self._private]
        if foreign:
            for i, b in enumerate(ids):
                self._tree.check_block_range(i, b)
            raise ValueError(
                f"block_ids {foreign} are not held privately by the caller (never allocated,"
                " already freed, or adopted by the tree)"
            )
        self._free_private(ids)

    def _free_private(self, ids: list[int]) -> None:
        """Give private blocks back to the pool (checked by the caller)."""
        self._private.difference_update(ids)
        self._pool.release(ids)

    # ---------------------------------------------------------------- insertion
    def insert(
        self,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        *,
        handle: LockHandle | None = None,
        namespace: str | None = None,
    ) -> InsertResult:
        """Insert tokens[0:n) whose KV lives in block_ids (len == ceil(n/B)) into `namespace`
        (under `handle=`, the handle's namespace; another one given is a ValueError).

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
        qb, plan, old, namespace = self._plan_insert(tokens, block_ids, handle, namespace)
        n = len(qb) // 4
        # Validated: commit.
        self._clock += 1
        if handle is not None:
            del self._live[handle.handle_id]  # its lock moves to the new handle below
        old_node = None if old is None else old.node
        target, superseded = self._tree.commit_insert(plan, qb, old_node, self._clock)
        self._private.difference_update(plan.new_ids)
        if plan.duplicates:
            self._private.difference_update(plan.duplicates)
            self._pool.release(plan.duplicates)
        table = tuple(plan.table)
        path = table if plan.path_ids is None else plan.path_ids
        self._counts["num_inserts"] += 1
        self._counts["num_inserted_tokens"] += n - plan.num_cached
        self._counts["num_duplicate_blocks_freed"] += len(plan.duplicates)
        self._counts["num_superseded_tails_freed"] += superseded
        return InsertResult(  # positional: keywords cost twice as much here
            n - plan.num_cached,
            table,
            () if plan.kept is None else (plan.kept,),
            len(plan.duplicates),
            self._new_handle(_Lock(target, qb, n, path, namespace)),
        )

    def _plan_insert(
        self,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        handle: LockHandle | None,
        namespace: str | None,
    ) -> tuple[bytes, InsertPlan, _Lock | None, str | None]:
        """Every check of `insert`, nothing changed: (packed tokens, the tree's plan, the lock
        of `handle`, the namespace inserted into). TypeError/ValueError as `insert` says."""
        qb = pack_tokens(tokens)
        n = len(qb) // 4
        ids = self._block_id_array(block_ids)
        num_idx = -(-n // self.block_size)
        if len(ids) != num_idx:
            raise ValueError(
                f"block_ids has {len(ids)} entries; {n} tokens with block_size"
                f" {self.block_size} need exactly ceil({n}/{self.block_size}) = {num_idx}"
            )
        _check_namespace(namespace)
        old = None if handle is None else self._live_lock(handle)
        if old is not None and namespace not in (None, old.namespace):
            raise ValueError(
                f"namespace {namespace!r} differs from the handle's namespace {old.namespace!r}"
            )
        namespace = namespace if old is None else old.namespace
        walked = self._walk(qb, n, namespace) if old is None else self._walk_past_lock(old, qb, n)
        plan = self._tree.plan_insert(walked, n, ids, block_ids, self._private)
        return qb, plan, old, namespace

    # ------------------------------------------------------------- block tables
    def admit(
        self, tokens: Sequence[int], *, max_hit: int | None, namespace: str | None = None
    ) -> BlockTable | None:
        """A block table covering `tokens`: the hit (at most `max_hit` tokens; None: no match
        and no lock), a private copy of a partial hit block (`BlockTable.copy`, to be done
        before the KV is written), private blocks for the rest. None if the blocks are not
        there, and then the cache is untouched: no query counted, no recency refreshed (the fit
        is checked read-only, `can_allocate(reserve=match)`, before anything is locked).
        Raises like `match` for bad tokens or a bad namespace."""
        match = None
        if max_hit is not None:
            match = self.match(tokens, max_tokens=max_hit, namespace=namespace)
        blocks = [] if match is None else list(match.block_ids)
        partial = 0 if match is None else match.num_partial_slots
        num_new = -(-len(tokens) // self.block_size) - len(blocks) + bool(partial)
        if not self.can_allocate(num_new, reserve=match):
            return None
        handle = None if match is None else self.acquire(match)  # lock before allocation evicts
        try:
            new = self.allocate(num_new)
        except BaseException:  # a fault (e.g. an interrupt) must not leave the lock held
            if handle is not None:
                self.release(handle)
            raise
        assert new is not None, "can_allocate(reserve=match) promised the blocks"
        copy = None
        if partial:  # never write into a tree block got from a match: new[0] replaces it
            copy = (blocks.pop(), new[0], partial)
        blocks += new
        hit = 0 if match is None else match.num_cached_tokens
        return BlockTable(tuple(blocks), handle, hit, copy, self._private.__contains__)

    def grow(self, table: BlockTable, num_blocks: int) -> bool:
        """Append `num_blocks` private blocks to `table` (evicting on demand); False, nothing
        changed, if they are not there."""
        new = self.allocate(num_blocks)
        if new is None:
            return False
        table.blocks += tuple(new)
        return True

    def commit(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """Insert `tokens` (their KV written in `table`'s blocks) under the table's lock, which
        moves to the inserted path; the table takes the canonical blocks the tree returns (what
        the tree did not adopt stays private). Raises like `insert`."""
        assert table.handle is not None, "a table admitted without the cache cannot commit"
        k = -(-len(tokens) // self.block_size)
        result = self.insert(tokens, table.blocks[:k], handle=table.handle)
        table.handle = result.handle
        table.blocks = result.block_ids + table.blocks[k:]

    def close(self, table: BlockTable) -> None:
        """Release the table's lock and free its private blocks; the table is left empty."""
        if table.handle is not None:
            self.release(table.handle)
        # Nothing cached lives in them: their order does not matter.
        self._free_private([b for b in table.blocks if b in self._private])
        table.blocks, table.handle, table.copy = (), None, None

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> list[int]:
        """Free up to num_blocks by evicting unlocked leaves in eviction order (GDSF unless built
        with eviction="lru"; tail first); returns freed ids.

        Fewer than asked (possibly none) means nothing else is evictable. A leaf with more blocks
        than still needed is trimmed from its tail (its head stays cached). Raises TypeError/
        ValueError for a count that is not an int >= 0.
        """
        freed, num_tokens = self._tree.evict(check_size(num_blocks, "num_blocks", low=0))
        self._counts["num_evicted_blocks"] += len(freed)
        self._counts["num_evicted_tokens"] += num_tokens
        return freed

    def reset(self) -> bool:
        """Drop everything cached, as if new (statistics kept; subscribers get
        `AllBlocksCleared`). Returns False, changing nothing, while a handle is live: its request
        still reads the blocks."""
        if self._live:
            return False
        self._tree.clear()
        return True

    # ------------------------------------------------------------------ reports
    def stats(self) -> CacheStats:
        tree, c = self._tree, self._counts
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=self._pool.num_free,
            num_evictable_blocks=tree.num_evictable_blocks,
            num_in_use_blocks=self.num_in_use_blocks,
            num_nodes=tree.num_nodes,
            num_computed_tokens=c["num_query_tokens"] - c["num_hit_tokens"],
            num_private_blocks=len(self._private),
            num_cached_tokens=tree.num_cached_tokens,
            num_live_handles=len(self._live),
            num_namespaces=len(tree.roots),
            **c,
        )

    def nodes(self) -> Iterator[NodeView]:
        """Snapshots of all nodes, root first, depth-first, children by increasing first token;
        then each namespace's root and nodes, by namespace name."""
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
                head_tokens=tuple(unpack_tokens(node.tokens[: 4 * _HEAD_TOKENS])),
            )

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch; raise AssertionError naming the first violation.

        O(num_blocks + tree size): for tests and debugging, not for the hot path.
        """
        handles_on = Counter(lock.node.node_id for lock in self._live.values())
        owners = self._tree.check_integrity(handles_on, self._clock)
        for b in self._private:
            if b in owners:
                raise AssertionError(f"block {b} is both private and owned by the tree")
            owners[b] = 1
        self._pool.check_integrity(owners)
        # free + evictable + in use == all, where evictable + in use = blocks with an owner
        free, owned = self._pool.num_free, len(owners)
        if free + owned != self.num_blocks:
            raise AssertionError(f"free {free} + owned {owned} != {self.num_blocks} blocks")
        if self._live and max(self._live) >= self._next_handle_id:
            raise AssertionError("a live handle id was never issued")
        for hid, lock in self._live.items():
            self._check_lock(hid, lock)

    def _check_lock(self, hid: int, lock: _Lock) -> None:
        """A lock's recorded prefix is its namespace's tree's: tokens and blocks, on the locked
        node's path (the node holding its last position is the locked node or, after a split, an
        ancestor), and the locked node lies under that namespace's root."""
        k = lock.num_tokens
        limit = min(k, len(lock.tokens) // 4)  # a corrupt count must fail the check, not the walk
        m, holder, blocks = self._tree.walk(lock.tokens[: 4 * k], limit, lock.namespace)
        path = [lock.node]  # the locked node up to its root
        while path[-1].parent is not None:
            path.append(path[-1].parent)
        on_path = m == k and tuple(blocks) == lock.block_ids and holder in path
        if not on_path or path[-1] is not self._tree.roots.get(lock.namespace):
            raise AssertionError(
                f"handle {hid}: {m} of its {k} locked tokens are on the tree of namespace"
                f" {lock.namespace!r} with blocks {blocks} (recorded {lock.block_ids}), on the"
                f" path of its node: {on_path}"
            )

    # ---------------------------------------------------------------- internals
    def _new_handle(self, lock: _Lock) -> LockHandle:
        hid = self._next_handle_id
        self._next_handle_id = hid + 1
        self._live[hid] = lock
        return LockHandle(hid, lock.num_tokens, _Lease(hid, self._live, self._on_leak))

    def _matched(self, match: MatchResult) -> _Matched:
        """What a current, unedited match of this cache matched; TypeError/ValueError otherwise."""
        if not isinstance(match, MatchResult):
            raise TypeError(f"match must be a MatchResult, got {type(match).__name__}")
        matched = match.matched
        if not isinstance(matched, _Matched) or matched.tree is not self._tree:
            raise ValueError("match was not produced by this cache")
        m = match
        if matched.fields != (
            m.num_query_tokens,
            m.num_cached_tokens,
            m.block_ids,
            m.num_partial_slots,
            m.namespace,
        ):
            raise ValueError("match was edited after match(): its fields differ from the cache's")
        # Same version => no structural change since the match: the node is still in the tree.
        if matched.version != self._tree.version:
            raise ValueError(
                f"stale match: taken at cache version {matched.version}, cache is at"
                f" {self._tree.version}; match() again"
            )
        return matched

    def _live_lock(self, handle: LockHandle) -> _Lock:
        """What a live handle of this cache locks; TypeError/ValueError otherwise."""
        if not isinstance(handle, LockHandle):
            raise TypeError(f"handle must be a LockHandle, got {type(handle).__name__}")
        hid, lease = handle.handle_id, handle.lease  # the lease: shared by the handle's copies
        issued = lease is not None and lease.live is self._live and lease.handle_id == hid
        lock = self._live.get(hid)
        if lock is None or not issued:
            raise ValueError(
                f"handle {hid} is not a live handle of this cache (already released,"
                " or issued by another cache)"
            )
        return lock

    def _walk(self, qb: bytes, n: int, namespace: str | None) -> Walk:
        """`tree.walk`, with the namespace's root made for an insert into a new namespace."""
        m, node, blocks = self._tree.walk(qb, n, namespace)
        return m, node or self._tree.open_root(namespace), blocks

    def _walk_past_lock(self, lock: _Lock, qb: bytes, n: int) -> Walk:
        """`_walk(qb, n)`, resumed after the prefix `lock` holds when qb starts with it.

        The common insert: a request inserts what it wrote under the handle of its own match or
        earlier insert. One memcmp of the prefix replaces the walk over every node of its path.
        """
        k = lock.num_tokens
        if k == 0 or k > n or not qb.startswith(lock.tokens[: 4 * k]):
            return self._walk(qb, n, lock.namespace)
        node = lock.node
        while node.start >= k:  # split at a position >= k since: k is in an ancestor now
            node = node.parent  # type: ignore[assignment]
        return self._tree.walk_from(node, k, list(lock.block_ids), qb, n)

    def _block_id_array(self, block_ids: Sequence[int]) -> array:
        """Block ids as array('I'); TypeError/ValueError naming the culprit and the range."""
        try:
            return uint32_array(block_ids, "block_ids", "a block id")
        except ValueError:
            for i, b in enumerate(block_ids):
                self._tree.check_block_range(i, int(b))
            raise  # pragma: no cover

    def _report_leak(self, handle_id: int) -> None:
        """Every copy of a handle is gone while its lock is still held."""
        self._counts["num_leaked_handles"] += 1
        logger.warning(
            "lock handle %d was dropped without release(); its path stays locked", handle_id
        )
        warnings.warn(
            f"LockHandle {handle_id} was garbage-collected without PrefixCache.release();"
            " its path stays locked",
            ResourceWarning,
            stacklevel=2,
        )


def _check_namespace(namespace: object) -> None:
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
