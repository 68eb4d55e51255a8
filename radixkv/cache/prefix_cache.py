"""PrefixCache: the radix tree over paged KV blocks, used through one contract, a request's
`BlockTable`.

Layers: `BlockPool` (physical blocks, ref counts, free list) <- `RadixTree` (token paths, block
ownership, locks, eviction order) <- `PrefixCache` (this module: the door for the caller's input,
block tables, private blocks, statistics, KV events).

A request's life (B = block size, `m` = cached tokens):

    match(prompt, max_tokens=len(prompt)-1)   the read-only scorer: how much is cached; m tokens,
                                              blocks 0..ceil(m/B)-1; nothing changes
    t = admit(prompt, max_hit=len(prompt)-1)  None: the blocks are not there, the cache untouched;
                                              else the hit is locked and `t.blocks` covers the
                                              prompt: the hit's blocks, a private copy of a
                                              partial hit block (`t.copy`: copy its m % B valid
                                              slots before writing), private blocks for the rest
    grow(t, n)                                n more private blocks (decoding); evicts on demand
    commit(t, written)                        insert what was written: the tree adopts t's new
                                              blocks, frees its duplicates; t takes the canonical
                                              blocks and its lock moves to the inserted path
    close(t)                                  unlock, free what is still private

`match` and `admit` are the door: they validate tokens (a `PackedTokens` is valid already), the
namespace and the hit cap, raising TypeError/ValueError before anything changes. `grow`, `commit`
and `close` trust their caller (tables are the cache's own); their preconditions are asserts and
`check_integrity()` recomputes the rest. A table never closed is the caller's bug: its blocks and
lock stay, and the scheduler's and engine's integrity checks see them.

Ownership model:
* A physical block's ref count = number of tree nodes owning it + number of *private* holders
  (0 or 1: a block is never both private and owned by the tree). Every private block lies in
  exactly one open table.
* The tree blocks a table uses are not ref-counted by it: its lock on its deepest node (node and
  ancestors have lock_ref > 0) keeps them from eviction.
* Block accounting, always: `num_free + num_evictable + num_in_use == num_blocks`, where
  evictable = cached blocks whose owners are all unlocked (what `evict` can free) and in use =
  private blocks + blocks of locked paths.

Namespaces isolate tenants: `match` and `admit` take `namespace=` (None: the shared one); what is
cached under one namespace never matches under another. They share the blocks and one eviction
order (GDSF over the path tokens that evicting a leaf's last block loses, by default; see
`radixkv.cache.eviction`).

KV events (`radixkv.cache.events`): a cache built with `kv_events=True` records which full blocks
enter and leave it; its owner drains them with `take_events()`.

The cache is deterministic: recency comes from a logical clock that advances once per locking
`admit` and per `commit` (the operations that touch a path); nothing reads the wall clock. It is
not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from radixkv.cache.events import EventRecorder, KVEvent
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.group import GroupSetup, GroupSpec, PoolConfig
from radixkv.cache.keys import XXH64, BlockHasher, BlockKey, KeyChain, PromptKeys
from radixkv.cache.moves import Move
from radixkv.cache.pool import BlockPool
from radixkv.cache.summary import EMPTY, TreeSummary, summarize
from radixkv.cache.tiers import DiskIndex, LowerHit, LowerTiers
from radixkv.cache.tokens import TOKEN_BYTES, check_size, pack_tokens, unpack_tokens
from radixkv.cache.tree import RadixTree, TreeNode

_HEAD_TOKENS = 8  # tokens shown per node by nodes()
_COUNTERS = (
    "num_queries",
    "num_query_tokens",
    "num_hit_tokens",
    "num_evicted_blocks",
    "num_evicted_tokens",
    "num_inserts",
    "num_inserted_tokens",
    "num_duplicate_blocks_freed",
    "num_superseded_tails_freed",
    "num_host_hit_tokens",
    "num_disk_hit_tokens",
)


@dataclass(slots=True)
class MatchResult:
    """Result of `PrefixCache.match`: what is cached now, valid until the cache next changes.
    Not frozen: one is made per scored request, and a frozen dataclass costs several times more
    to build (see RESULTS.md)."""

    num_query_tokens: int  # len(tokens) given to match()
    num_cached_tokens: int  # m: tokens [0, m) have KV in the cache
    block_ids: tuple[int, ...]  # physical blocks of indices 0 .. ceil(m/B)-1 (last may be partial)
    num_partial_slots: int  # m % B: valid slots of the last block when it is partial, else 0
    namespace: str | None = None  # the namespace matched in
    # Full blocks after `block_ids` found in the lower tiers (then `block_ids` holds whole blocks
    # only and `num_cached_tokens` counts the hit in every tier): on the host, then on disk.
    num_host_blocks: int = 0
    num_disk_blocks: int = 0

    @property
    def last_block_partial(self) -> bool:
        return self.num_partial_slots != 0

    @property
    def num_full_blocks(self) -> int:
        return len(self.block_ids) - (1 if self.last_block_partial else 0)


@dataclass(slots=True, eq=False)
class BlockTable:
    """The blocks one request uses: issued by `PrefixCache.admit`, changed by `grow` and
    `commit`, given back by `close` (the cache's methods are its only writers).

    `blocks[i]` is the physical block of block index i. It is a tuple, replaced whole on every
    change, so whoever holds it (a scheduler step's rows) keeps what it was given without a copy.
    The entries that are not private are tree blocks on the path of `node`, which the table
    locks (None: admitted without the cache, `max_hit=None`, and holding private blocks only).
    """

    blocks: tuple[int, ...]
    num_cached_tokens: int  # the hit at admission: KV of tokens [0, m) is there already
    copy: tuple[int, int, int] | None  # (source, target, slots): copy-on-write of a partial hit
    namespace: str | None
    node: TreeNode | None = field(repr=False)  # the locked node
    # The issuing cache's record of every private block (its one home), read-only here.
    cache_private: set[int] = field(repr=False)

    @property
    def locked(self) -> bool:
        """Whether the table holds a lock on a cached path (it was admitted with the cache)."""
        return self.node is not None

    @property
    def private(self) -> set[int]:
        """The entries the request holds alone (allocated, not adopted by the tree): its tail."""
        return {b for b in self.blocks if b in self.cache_private}


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_evictable_blocks: int  # cached, owned only by unlocked nodes
    num_in_use_blocks: int  # locked-path blocks + private blocks
    num_nodes: int  # tree nodes, roots excluded
    num_queries: int  # admissions that locked a hit
    num_query_tokens: int
    num_hit_tokens: int
    num_computed_tokens: int  # query tokens not served by the cache
    num_evicted_blocks: int
    num_evicted_tokens: int
    num_private_blocks: int = 0  # allocated and not yet adopted by the tree or freed
    num_cached_tokens: int = 0  # tokens held by the tree
    num_locked_tables: int = 0  # open tables holding a lock
    num_inserts: int = 0
    num_inserted_tokens: int = 0  # new tokens added to the tree by commit()
    num_duplicate_blocks_freed: int = 0  # private duplicates commit() returned to the free list
    # partial tails of a node that commit() replaced by the new child's copy and freed
    num_superseded_tails_freed: int = 0
    num_namespaces: int = 1  # tree roots: the shared one + namespaces holding something
    # The lower tiers (`radixkv.cache.tiers`); zeros without them.
    num_host_blocks: int = 0  # the host tier's size
    num_host_cached_blocks: int = 0  # host blocks holding a block
    num_host_hit_tokens: int = 0  # of num_hit_tokens: loaded from the host tier
    num_disk_hit_tokens: int = 0  # of num_hit_tokens: read from the disk tier
    num_offloaded_blocks: int = 0  # device -> host copies planned
    num_loaded_blocks: int = 0  # host -> device copies planned (disk reads included)
    num_disk_reads: int = 0  # block files read into the host tier
    num_disk_writes: int = 0  # host blocks written to disk as they left the host tier

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
    num_host_blocks: int = 0  # of its full blocks, those with a copy in the host tier too


class PrefixCache:
    """Token-granular prefix cache over `num_blocks` blocks of `block_size` tokens: the tree's
    group of a `GroupedCache` (it speaks the group protocol of `radixkv.cache.group` but for
    `find` / `fits` / `admit`, which its own `lookup` and `admit` stand in for).

    Invariants (recomputed by `check_integrity`, which tests call after every operation):
    * every block is free, private (ref 1, in `_private`) or owned by tree nodes (ref = owners);
    * `num_free + num_evictable + num_in_use == num_blocks`;
    * every private block lies in exactly one open table, in its tail; lock_ref = open tables
      locking the subtree; a table's other blocks are owned, at their index, by nodes on the path
      of its locked node, which lies under its namespace's root;
    * plus the `RadixTree` and `BlockPool` invariants.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eviction: str = "gdsf",
        kv_events: bool | BlockHasher = False,
        host_blocks: int = 0,
        disk: DiskIndex | None = None,
        write_through: bool = False,
    ) -> None:
        """`eviction`: the order unlocked leaves go in, "gdsf" (fewest tokens lost per freed
        block, aged; see `radixkv.cache.eviction`) or "lru"; ValueError for another.
        `kv_events`: record KV events for `take_events()` (see `radixkv.cache.events`), block
        hashes by xxh64 for True, by the given `BlockHasher` (`make_block_hasher`) otherwise.
        `host_blocks`: the host tier's size in blocks (0: none); `disk`: the disk tier (it needs
        a host tier: its reads and writes go through host blocks). Evicted device blocks are
        demoted to the host (write-back); `write_through` copies every committed full block
        to the host at once instead, so an eviction finds it there. The moves are drained with
        `take_moves()` (see `radixkv.cache.tiers`). Every tier names a block by the same key
        (`radixkv.cache.keys`), so the lower tiers' events use the events' chain too."""
        if eviction not in EVICTION_ORDERS:
            raise ValueError(f"eviction must be one of {sorted(EVICTION_ORDERS)}, got {eviction!r}")
        check_size(host_blocks, "host_blocks", low=0)
        if disk is not None and (not host_blocks or disk.block_size != block_size):
            raise ValueError("a disk tier needs a host tier (host_blocks >= 1) and its block size")
        self._pool = BlockPool(num_blocks, block_size)
        self.name = FullKind.name
        self.num_blocks: int = self._pool.num_blocks
        self.block_size: int = self._pool.block_size
        hasher = XXH64 if isinstance(kv_events, bool) else kv_events
        self._events = EventRecorder(self.block_size) if kv_events else None
        self._keys = KeyChain(self.block_size, hasher) if kv_events or host_blocks else None
        order = EVICTION_ORDERS[eviction](self.block_size)
        self._tree = RadixTree(self._pool, order, self._keys)
        self._tiers: LowerTiers | None = None
        if host_blocks:
            self._tiers = LowerTiers(host_blocks, self.block_size, disk, self._events)
        if self._keys is not None:
            self._tree.on_cut = self._cut
        self._write_through = write_through and self._tiers is not None
        self._private: set[int] = set()
        self._open: set[BlockTable] = set()  # tables admitted and not yet closed
        self._clock = 0
        # The statistics of `stats()` that are counters, by their field names.
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # ----------------------------------------------------------------- the door
    def match(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int | None = None,
        namespace: str | None = None,
    ) -> MatchResult:
        """Longest prefix of tokens cached in `namespace`, at most max_tokens long. Mutates
        nothing (with lower tiers, path nodes may keep the block keys the lookup computed).

        Scoring waiting requests may call this freely: no split, no recency refresh, no lock. The
        scheduler passes `max_tokens=len(tokens) - 1` for a prefill (the last prompt token is always
        computed, so there are logits to sample from). Raises TypeError/ValueError for token ids
        that are not ints in [0, 2**32), a negative max_tokens or a namespace that is not a str.
        """
        return self.lookup(tokens, max_tokens=max_tokens, namespace=namespace)[0]

    def lookup(
        self,
        tokens: Sequence[int],
        *,
        max_tokens: int | None = None,
        namespace: str | None = None,
    ) -> tuple[MatchResult, PromptKeys | None]:
        """`match`, and the prompt's block keys it read or hashed (None: no lower tiers to
        probe), for a caller that probes other tiers by the same keys next (a window group's)
        or admits the same prompt: they are not hashed again (`admit(keys=)`). Mutates
        nothing, as `match`."""
        qb = pack_tokens(tokens)
        n = len(qb) // TOKEN_BYTES
        limit = n if max_tokens is None else min(n, check_size(max_tokens, "max_tokens", low=0))
        _check_namespace(namespace)
        m, node, blocks = self._tree.walk(qb, limit, namespace)
        keys = self._prompt_keys(qb, namespace, m, node)
        hit, lower = self._lower_hit(limit, m, keys)
        if lower is None:
            return MatchResult(n, m, tuple(blocks), m % self.block_size, namespace), keys
        full_blocks = tuple(blocks[: m // self.block_size])
        return MatchResult(n, hit, full_blocks, 0, namespace, lower.h, lower.d), keys

    def admit(
        self,
        tokens: Sequence[int],
        *,
        max_hit: int | None,
        namespace: str | None = None,
        keys: PromptKeys | None = None,
    ) -> BlockTable | None:
        """A block table covering `tokens`: the hit (at most `max_hit` tokens; None: no match
        and no lock), a private copy of a partial hit block (`BlockTable.copy`, to be done
        before the KV is written), private blocks for the rest, evicting on demand. A hit that
        goes on in the lower tiers is loaded into the first of the private blocks (the loads
        are planned for `take_moves()`, to run before anything reads them).

        None if the blocks are not there, and then the cache is untouched: no query counted, no
        recency refreshed. The fit is exact: free + evictable blocks, less those that locking
        the hit would pin, against the blocks needed. Raises like `match` for bad tokens, a bad
        namespace or a negative `max_hit`. `keys`: what a `lookup` of the same tokens and
        namespace just gave (the cache unchanged since), whose blocks are then not hashed again.
        """
        qb = pack_tokens(tokens)
        n = len(qb) // TOKEN_BYTES
        _check_namespace(namespace)
        m, node, blocks = 0, None, []
        hit, lower = 0, None
        if max_hit is not None:
            limit = min(n, check_size(max_hit, "max_hit", low=0))
            m, node, blocks = self._tree.walk(qb, limit, namespace)
            if keys is None:
                keys = self._prompt_keys(qb, namespace, m, node)
            assert keys is None or keys.is_of(qb, namespace), "the keys of another prompt"
            hit, lower = self._lower_hit(limit, m, keys)
        if lower is not None:  # the lower tiers' blocks replace the tree's partial block, if any
            del blocks[m // self.block_size :]
            partial = 0
        else:
            partial = m % self.block_size
        num_new = -(-n // self.block_size) - len(blocks) + bool(partial)
        if not self._fits(num_new, None if max_hit is None else node):
            return None
        table = BlockTable((), max(m, hit), None, namespace, None, self._private)
        if max_hit is not None:
            table.node = node or self._tree.open_root(namespace)
            self._clock += 1
            self._tree.lock_path(table.node, self._clock)  # before allocation evicts
            self._count_hit(n, m, hit, lower)
        self._open.add(table)
        if lower is not None:
            lower.pin()
        try:
            new = self._allocate(num_new)
            if partial:  # never write into a tree block got from a match: new[0] replaces it
                table.copy = (blocks.pop(), new[0], partial)
            table.blocks = (*blocks, *new)  # from here, closing the table frees `new`
            if lower is not None:
                lower.load(new)
        except BaseException:  # a fault (e.g. an interrupt) leaks no block, lock or pin
            if lower is not None:
                lower.unpin()
            self.close(table)
            raise
        return table

    # ------------------------------------------------------------- block tables
    def extend(self, table: BlockTable, num_tokens: int) -> bool:
        """Blocks for every position up to `num_tokens` (`grow` by what is missing)."""
        need = -(-num_tokens // self.block_size) - len(table.blocks)
        return need <= 0 or self.grow(table, need)

    def slide(self, table: BlockTable, num_written: int) -> None:
        """Nothing to let go: every later query reads every earlier token."""

    def chunk_end(self, table: BlockTable, start: int, end: int) -> int:
        """Every point of a path is one a hit resumes from: no chunk must end early."""
        return end

    def row_blocks(self, table: BlockTable, num_blocks: int) -> tuple[int, ...]:
        """The table's first `num_blocks` entries (its own tuple when that is all of it)."""
        return table.blocks[:num_blocks]

    def grow(self, table: BlockTable, num_blocks: int) -> bool:
        """Append `num_blocks` private blocks to `table` (evicting on demand); False, nothing
        changed, if they are not there."""
        assert table in self._open and num_blocks >= 0, (table, num_blocks)
        if not self._fits(num_blocks, None):
            return False
        table.blocks += tuple(self._allocate(num_blocks))
        return True

    def commit(self, table: BlockTable, tokens: Sequence[int], *, prompt_end: bool = False) -> None:
        """Insert `tokens[0:n)`, whose KV is written in the table's first ceil(n/B) blocks, into
        the table's namespace; the table's lock moves to the inserted path (its recency
        refreshed) and it takes the canonical blocks the tree returns.

        Let p = the cached prefix of tokens. Per block index i of [0, ceil(n/B)):
            covered by the tree (positions all < p): the table's block is the tree's (nothing),
                a private duplicate (freed, the tree's block is used; except the partial last
                block when n == p, which the table keeps: the request writes on there) or a
                shallower path node's block at that index (its own earlier tail: kept likewise);
            new (index >= p // B, when n > p): tokens [p, n) become a new leaf (after splitting
                the node holding p) that adopts the private blocks, or co-owns the first one when
                it is the table's own earlier tail (p % B != 0).
            When the leaf starts at its parent's mid-block end with a private copy of the parent's
            partial tail, the parent has no other child, no other lock in its subtree and is that
            tail's only owner, the parent co-owns the copy and its old tail is freed (no path
            could read it any more; `CacheStats.num_superseded_tails_freed`).
        Raises like `match` for bad tokens, before anything changes. `prompt_end` (the tokens
        are a whole prompt) changes nothing here: every point of a path is one a hit can
        resume from.
        """
        assert table.node is not None, "a table admitted without the cache cannot commit"
        qb = pack_tokens(tokens)
        n = len(qb) // TOKEN_BYTES
        k = -(-n // self.block_size)
        assert k <= len(table.blocks), f"{n} tokens need {k} blocks, the table has {table.blocks}"
        m, node, canonical = self._tree.walk(qb, n, table.namespace)
        assert node is not None, "the table's lock keeps its namespace's root"
        plan = self._tree.plan_insert((m, node, canonical), n, table.blocks[:k], self._private)
        self._clock += 1
        table.node, superseded = self._tree.commit_insert(plan, qb, table.node, self._clock)
        self._private.difference_update(plan.new_ids)
        if plan.duplicates:
            self._private.difference_update(plan.duplicates)
            self._pool.release(plan.duplicates)
        table.blocks = (*plan.table, *table.blocks[k:])
        self._counts["num_inserts"] += 1
        self._counts["num_inserted_tokens"] += n - m
        self._counts["num_duplicate_blocks_freed"] += len(plan.duplicates)
        self._counts["num_superseded_tails_freed"] += superseded
        if n > m and self._events is not None:  # a new leaf: its full blocks are announced
            self._events.stored(self._keys.node_keys(table.node), table.namespace)  # type: ignore[union-attr]
        if self._write_through and n > m:
            self._demote(table.node, 0)  # the new leaf's full blocks

    def close(self, table: BlockTable) -> None:
        """Release the table's lock and free its private blocks; the table is left empty."""
        assert table in self._open, "a table is closed once, by the cache that issued it"
        self._open.remove(table)
        if table.node is not None:
            self._tree.unlock_path(table.node)
        private = table.blocks[self._private_start(table) :]
        self._private.difference_update(private)
        self._pool.release(private)  # nothing cached lives in them: their order does not matter
        table.blocks, table.node, table.copy = (), None, None

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
        """Drop everything cached, as if new (statistics kept; an `AllBlocksCleared` event).
        Returns False, changing nothing, while a table holds a lock: its request still reads
        the blocks."""
        if any(root.lock_ref for root in self._tree.roots.values()):
            return False
        self._tree.clear()
        if self._events is not None:
            self._events.cleared()
        if self._tiers is not None:
            self._tiers.clear()
        return True

    def persist(self) -> None:
        """Plan copies of every full block the tree holds into the host tier and of the host
        tier into the disk tier: what a process started later over the same directory finds.
        Nothing leaves the device; a host tier smaller than the tree spills to disk on the way.
        Nothing to do without a disk tier."""
        tiers = self._tiers
        if tiers is None or tiers.disk is None:
            return
        for node, _ in self._tree.iter_nodes():
            if node.parent is not None:
                self._demote(node, 0)
        tiers.write_to_disk()

    def take_moves(self) -> list[Move]:
        """The tier moves planned since the last call, in the order they must run: before the
        forward of the step that reads their blocks ([] without lower tiers)."""
        return [] if self._tiers is None else self._tiers.take_moves()

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The tree's only copies are its admissions' (`BlockTable.copy`)."""
        return []

    def step_failed(self) -> None:
        """A copy-on-write writes a private block of the failed step's own request: nothing
        the tree holds is at stake."""

    @property
    def clock(self) -> int:
        """The logical clock: the last tick an admission or commit took (what a group beside
        the tree stamps its own recency with)."""
        return self._clock

    def forget(self, host_blocks: Sequence[int]) -> None:
        """A move failed and left these host blocks holding garbage: their entries go."""
        if self._tiers is not None:
            self._tiers.forget(host_blocks)

    @property
    def tiers(self) -> LowerTiers | None:
        return self._tiers

    @property
    def num_open_tables(self) -> int:
        return len(self._open)

    def is_open(self, table: BlockTable) -> bool:
        return table in self._open

    @property
    def event_recorder(self) -> EventRecorder | None:
        """The queue this cache records into (None: built without events) and the chain that
        names its blocks: a window group beside it announces its blocks there too."""
        return self._events

    @property
    def key_chain(self) -> KeyChain | None:
        return self._keys

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first ([] when the cache was built
        without `kv_events=True`)."""
        return [] if self._events is None else self._events.take()

    # ------------------------------------------------------------------ reports
    def stats(self) -> CacheStats:
        pool, tree, c = self._pool, self._tree, self._counts
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=pool.num_free,
            num_evictable_blocks=tree.num_evictable_blocks,
            num_in_use_blocks=self.num_blocks - pool.num_free - tree.num_evictable_blocks,
            num_nodes=tree.num_nodes,
            num_computed_tokens=c["num_query_tokens"] - c["num_hit_tokens"],
            num_private_blocks=len(self._private),
            num_cached_tokens=tree.num_cached_tokens,
            # a lock counts once at its root: locks cover whole paths
            num_locked_tables=sum(root.lock_ref for root in tree.roots.values()),
            num_namespaces=len(tree.roots),
            **({} if self._tiers is None else self._tiers.stats()),
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
                num_host_blocks=self._num_on_host(node),
            )

    def summary(
        self,
        *,
        namespace: str | None = None,
        max_nodes: int = 300,
        prompt: Sequence[int] = (),
    ) -> TreeSummary:
        """A bounded picture of one namespace's tree (`radixkv.cache.summary`): at most
        `max_nodes` nodes, the path `prompt` matches first, the rest folded with counts.
        Read-only; O(nodes of the namespace). Only that namespace is read: nothing of another
        tenant shows, not even whether it exists."""
        _check_namespace(namespace)
        check_size(max_nodes, "max_nodes", low=0)
        root = self._tree.roots.get(namespace)
        if root is None:
            return EMPTY
        path: list[TreeNode] = []
        m = 0
        if len(prompt):
            m, node, _ = self._tree.walk(pack_tokens(prompt, "prompt"), len(prompt), namespace)
            while node is not None and node.parent is not None:
                path.append(node)
                node = node.parent
            path.reverse()
        return summarize(root, max_nodes, path, m, self._num_on_host)

    def nodes_ending(self, prefixes: Iterable[bytes], namespace: str | None = None) -> Counter[int]:
        """Node id -> how many of the packed `prefixes` end in it (start < len <= end: the
        prefix's whole path is cached and its last token is that node's); a prefix the tree
        does not hold whole counts nowhere. Read-only; O(the prefixes' tokens)."""
        counts: Counter[int] = Counter()
        for qb in prefixes:
            n = len(qb) // TOKEN_BYTES
            m, node, _ = self._tree.walk(qb, n, namespace)
            if n and m == n and node is not None and node.parent is not None:
                counts[node.node_id] += 1
        return counts

    def _num_on_host(self, node: TreeNode) -> int:
        tiers = self._tiers
        if tiers is None or node.parent is None or not tiers.entries:
            return 0
        keys, _ = self._full_block_keys(node, 0)
        return sum(map(tiers.holds, keys))

    def check_integrity(self) -> None:
        """Recompute every invariant from scratch; raise AssertionError naming the first violation.

        O(num_blocks + tree size + table sizes x depth): for tests and debugging, not the hot path.
        """
        locks_on = Counter(t.node.node_id for t in self._open if t.node is not None)
        owners = self._tree.check_integrity(locks_on, self._clock)
        for b in self._private:
            if b in owners:
                raise AssertionError(f"block {b} is both private and owned by the tree")
            owners[b] = 1
        self._pool.check_integrity(owners)
        if self._tiers is not None:
            self._tiers.check_integrity()
        if self._events is not None:
            self._events.check_integrity(self._tree.iter_attached())
        # free + evictable + in use == all, where evictable + in use = blocks with an owner
        free, owned = self._pool.num_free, len(owners)
        if free + owned != self.num_blocks:
            raise AssertionError(f"free {free} + owned {owned} != {self.num_blocks} blocks")
        held = Counter(b for t in self._open for b in t.blocks if b in self._private)
        if held.keys() != self._private or any(count > 1 for count in held.values()):
            raise AssertionError(f"private blocks {sorted(self._private)} != open tables' {held}")
        for table in self._open:
            self._check_table(table)

    def check_table(self, table: BlockTable, num_written: int, num_tokens: int, chunk: int) -> None:
        """A running request's table covers its `num_written` tokens and no more blocks than
        its `num_tokens` take (admission reserves them all), each once, each in the pool."""
        B, blocks = self.block_size, table.blocks
        assert -(-num_written // B) <= len(blocks) <= -(-num_tokens // B), (table, num_written)
        assert len(set(blocks)) == len(blocks), f"a block twice in {blocks}"
        assert all(0 <= b < self.num_blocks for b in blocks), blocks

    def _check_table(self, table: BlockTable) -> None:
        """A table's blocks that are not private are owned, at their index, by nodes on the path
        of its locked node, which lies under its namespace's root (no lock: no such block)."""
        node = table.node
        shared = [(i, b) for i, b in enumerate(table.blocks) if b not in self._private]
        if len(table.blocks) - len(shared) != len(table.blocks) - self._private_start(table):
            raise AssertionError(f"the private blocks of table {table.blocks} are not its tail")
        if node is None:
            if shared:
                raise AssertionError(f"a table without a lock holds tree blocks {shared}")
            return
        root = node
        while root.parent is not None:
            root = root.parent
        if root is not self._tree.roots.get(table.namespace):
            raise AssertionError(f"a table of namespace {table.namespace!r} locks another's path")
        for i, b in shared:
            if not self._tree.path_block_at(node, i, node.end, b):
                raise AssertionError(f"table entry {i} = {b} is not its locked path's block")

    # ---------------------------------------------------------------- internals
    def _private_start(self, table: BlockTable) -> int:
        """Where the table's private blocks begin: they are always its tail (admit and grow
        append them; commit adopts a prefix and keeps at most its partial last block)."""
        blocks, i = table.blocks, len(table.blocks)
        while i and blocks[i - 1] in self._private:
            i -= 1
        return i

    def _prompt_keys(
        self, qb: bytes, namespace: str | None, m: int, node: TreeNode | None
    ) -> PromptKeys | None:
        """The keys a lower-tier lookup of `qb` reads, m of its tokens matched in the tree ending
        at `node` (hashed only when read); None without lower tiers."""
        if self._tiers is None:
            return None
        return PromptKeys(self._keys, qb, namespace, m, node)  # type: ignore[arg-type]

    def _lower_hit(
        self, limit: int, m: int, keys: PromptKeys | None
    ) -> tuple[int, LowerHit | None]:
        """The hit once the lower tiers are probed past the tree's `m` tokens of the prompt
        `keys` name, and the blocks it reads there: the prompt's full blocks from index m // B
        on, just as many as the hit needs; (m, None) when they add nothing. Read-only (the disk
        is probed, not read; path nodes may keep the keys they compute)."""
        tiers, B = self._tiers, self.block_size
        i0 = m // B
        if tiers is None or keys is None or i0 >= keys.num_full or limit <= m:
            return m, None
        if not tiers.entries and tiers.disk is None:
            return m, None
        found = tiers.lookup(i0, keys.span(i0, keys.num_full))
        hit = min(limit, found.end_block * B)
        if hit <= m:
            return m, None
        return hit, found.cut(-(-hit // B) - i0)

    def _count_hit(self, n: int, m: int, hit: int, lower: LowerHit | None) -> None:
        """Count a locking admission of `n` tokens: `m` hit in the tree, or `hit` > m with the
        `lower` tiers' blocks (their first ones from the host)."""
        c = self._counts
        c["num_queries"] += 1
        c["num_query_tokens"] += n
        if lower is not None:
            lower_start = m // self.block_size * self.block_size
            from_host = min(hit, lower_start + lower.h * self.block_size) - lower_start
            c["num_host_hit_tokens"] += from_host
            c["num_disk_hit_tokens"] += hit - lower_start - from_host
        c["num_hit_tokens"] += max(m, hit)

    def _cut(self, node: TreeNode, keep: int) -> None:
        """The tree is about to cut `node`'s blocks from its `keep`-th on: the lower tiers take
        copies of the full ones, and they are announced as gone from the device."""
        if self._tiers is not None:
            self._demote(node, keep)
        if self._events is not None:
            gone = self._keys.node_keys(node)[keep:]  # type: ignore[union-attr]
            self._events.removed([key.block_hash for key in reversed(gone)])

    def _demote(self, node: TreeNode, keep: int) -> None:
        """`node`'s full blocks from its `keep`-th on are leaving the device (or, written
        through, may later): the lower tiers take copies of those they lack."""
        assert self._tiers is not None
        keys, blocks = self._full_block_keys(node, keep)
        if keys:
            self._tiers.demote(keys, blocks)

    def _full_block_keys(self, node: TreeNode, keep: int) -> tuple[list[BlockKey], list[int]]:
        """The keys and device blocks of the full blocks ending in `node`, from its `keep`-th
        block on (the node's blocks are hashed, chained from its parent's kept key)."""
        B = self.block_size
        first, full_end = node.start // B, node.end // B  # full blocks ending in node
        if first + keep >= full_end:
            return [], []
        keys = self._keys.node_keys(node)  # type: ignore[union-attr]
        return keys[keep:], node.blocks[keep : full_end - first]

    def _fits(self, num_blocks: int, lock: TreeNode | None) -> bool:
        """Whether `num_blocks` can be allocated (evicting what it takes) once `lock`, if any, is
        locked: locking pins the blocks of its path that are evictable now. Read-only."""
        if num_blocks <= self._pool.num_free:
            return True  # the common case: no eviction, nothing to count
        pinned = 0 if lock is None else self._tree.num_blocks_pinned_by_lock(lock)
        return num_blocks <= self._pool.num_free + self._tree.num_evictable_blocks - pinned

    def _allocate(self, num_blocks: int) -> list[int]:
        """Private blocks, evicting only as many as the free list lacks; the caller has checked
        that free + evictable blocks suffice."""
        short = num_blocks - self._pool.num_free
        if short > 0:
            self.evict(short)
        ids = self._pool.allocate(num_blocks)
        assert ids is not None, "eviction freed fewer blocks than it counted as evictable"
        self._private.update(ids)
        return ids


def _check_namespace(namespace: object) -> None:
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")


class FullKind:
    """The tree's kind of group (`radixkv.cache.kinds`): the layers that read every token."""

    name = "full"

    def plan_blocks(
        self, spec: GroupSpec, config: PoolConfig, bytes_per_block: int, budget: int | None
    ) -> int | None:
        """`config.num_blocks`, else what the budget leaves after the other groups' pools."""
        return config.num_blocks

    def build(self, spec: GroupSpec, setup: GroupSetup) -> PrefixCache:
        return PrefixCache(
            setup.num_blocks,
            setup.block_size,
            eviction=setup.eviction,
            kv_events=setup.kv_events,
            host_blocks=setup.host_blocks,
            disk=setup.disk,
            write_through=setup.write_through,
        )
