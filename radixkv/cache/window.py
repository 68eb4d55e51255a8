"""The window group: KV blocks of sliding-window layers, which only the last W tokens need.

A window-W layer's query at position p reads keys (p - W, p] and nothing older. So the window
layers' KV lives in blocks of its own pool (the full layers' in `PrefixCache`'s), with one table
per request indexed like the full one (entry i holds positions [i*B, (i+1)*B)), and:

    positions     0 ............................ n-W+1 ......... n   (n = tokens written)
    entries       None  None  None  None   | live  live  live  live
                  released: no later query |  what the query at n and later ones read
                  reads them               |  (`first_live_index(n)` on)

* a running request releases the entries that fall out of the window (`slide`);
* a point a later request can resume from keeps a *tail*: the window blocks of the last W tokens
  before it (`commit`), shared by reference, never copied; a request resuming there references
  them and copies the partial last block, as the full group does (`open`, `WindowTable.copy`);
* a hit is valid up to the deepest point of the full match that has a tail (`hit`): without the
  window KV of the W tokens before it, a resume would need the tokens' KV recomputed;
* tails are reclaimed when the pool runs short (`evict`), in two segments, each least recently
  used first: *speculative* tails first (kept at a request's end or chunk end, never resumed
  from, or superseded: the request that resumed there kept a deeper tail on the same path, as a
  chat's next turn does), then *proven* ones (resumed from, or kept at a point where the tree's
  paths branch: the next question about the same document resumes there).

Where this differs from the anchors: SGLang's `SWARadixCache` keeps window KV per tree node and
marks nodes whose window KV is gone as tombstones; vLLM's sliding-window manager caches window
blocks by block hash like full ones. Here a tail is keyed by its exact token prefix and namespace,
apart from the tree: the tree's code and events are unchanged, a tail never pins tree nodes and
is never pinned by a lock (a running request holds its own references to every window block it
reads), and a point that the full tree evicts and later caches again is valid again at once.
The cost: hits resume at commit points only (a prompt's end, a chunk's end, a finished reply),
not mid-node as the full group's token-granular hits do.

KV events (with a recorder, `radixkv.cache.events`): the full blocks a tail keeps are announced
as the window group's (group 1), named by the chained keys of their prefix (`radixkv.cache.keys`,
the full group's chain), each key stored when the first tail holding it is kept and removed when
the last such tail goes; a running table's blocks are never announced (as the tree announces
only what it caches).

Lower tiers (`tiers`, a `LowerTiers` of the window group): an evicted tail's full blocks are
demoted there under the same keys (a window block's KV is a function of its prefix, as a full
block's is), and `lower_hit` finds the deepest block boundary e whose window blocks
first_live_index(e) .. e // B - 1 are all there; `open_lower` loads them into a new table. With
tiers, tables and tails keep one block more before the first live one (`margin`): a tail ending
at t then covers the window of the boundary t // B * B, where a hit from the tiers resumes.
With `write_through`, a new tail's full blocks are copied to the host tier when it is kept, as
the full group copies its committed blocks (`PrefixCache(write_through=)`): its eviction then
finds them there.

Ref counts: a window block's owners are the tails and the open tables that list it (each once),
plus a table's pinned copy source (released at its next `slide` or `close`, once its copy has
run). Deterministic: recency is the order of use, nothing reads the wall clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from radixkv.cache.events import EventRecorder
from radixkv.cache.group import GroupSetup, GroupSpec, PoolConfig, Probe
from radixkv.cache.keys import BlockKey, KeyChain, PromptKeys, token_bytes_le
from radixkv.cache.moves import Move
from radixkv.cache.points import PointEnds, PointKey, point_key
from radixkv.cache.pool import BlockPool
from radixkv.cache.tiers import LowerHit, LowerTiers
from radixkv.cache.tokens import TOKEN_BYTES, PackedTokens, check_size

# A tail's key: the exact prefix it ends (`radixkv.cache.points`); the tail keeps the tokens,
# compared before a hit is served
TailKey = PointKey
tail_key = point_key


def tier_margin(with_tiers: bool) -> int:
    """Window blocks a table or tail keeps before its window's first live one: 1 with lower
    tiers, so that a tail's blocks cover the window before the block boundary at or below its
    end, the point a lower-tier hit resumes from; else 0."""
    return 1 if with_tiers else 0


def first_live_index(num_written: int, window: int, block_size: int) -> int:
    """The first block index that the query at position `num_written` or any later one reads:
    that query sees keys (num_written - window, num_written]."""
    return max(0, num_written - window + 1) // block_size


def window_budget(window: int, block_size: int, chunk: int, margin: int = 0) -> int:
    """Window blocks one running request lists at most: those its next chunk's queries read
    (W - 1 tokens before it and the chunk itself, one more where they straddle a block), one
    for the token the scheduler keeps back from each slide (a stop in an overlapped step gives
    its last computed token back), one copy source pinned until its copy ran, and the `margin`
    kept before the window (`tier_margin`)."""
    return -(-(window + chunk) // block_size) + 2 + margin


@dataclass(frozen=True, slots=True)
class WindowSpec(GroupSpec):
    """The window group of a model's layers: the largest window any of them reads (one group
    serves every window size: a smaller window reads fewer of its tokens)."""

    kind: ClassVar[str] = "window"
    window: int


class WindowPoolConfig(PoolConfig, Protocol):
    @property
    def num_window_blocks(self) -> int | None: ...  # None: sized by `WindowKind.plan_blocks`


class WindowKind:
    """The window group's entry in the registry (`radixkv.cache.kinds`)."""

    name = "window"

    def plan_blocks(
        self, spec: WindowSpec, config: WindowPoolConfig, bytes_per_block: int, budget: int | None
    ) -> int:
        """`config.num_window_blocks`, or room for `max_num_seqs` requests' windows and chunks,
        twice over (tails share them), at most half of a `budget` in bytes (None: the tree's
        pool is counted out in blocks instead) unless that holds not one request's. ValueError
        for a pool that holds not one request's."""
        B = config.block_size
        chunk = min(config.chunked_prefill_size, config.max_num_batched_tokens)
        need = window_budget(spec.window, B, chunk, tier_margin(bool(config.host_cache_bytes)))
        if config.num_window_blocks is None:
            blocks = 2 * config.max_num_seqs * need
            if budget is None:
                return blocks
            return max(need, min(blocks, budget // 2 // bytes_per_block))
        if config.num_window_blocks < need:
            raise ValueError(
                f"num_window_blocks={config.num_window_blocks} holds not one request's window "
                f"({need} blocks of {B} tokens for a window of {spec.window} and chunks of {chunk})"
            )
        return config.num_window_blocks

    def build(self, spec: WindowSpec, setup: GroupSetup) -> WindowGroup:
        tiers = None
        if setup.host_blocks:
            tiers = LowerTiers(
                setup.host_blocks,
                setup.block_size,
                setup.disk,
                setup.events,
                group=setup.index,
                window=spec.window,
            )
        return WindowGroup(
            setup.num_blocks,
            setup.block_size,
            spec.window,
            events=setup.events,
            keys=setup.keys,
            tiers=tiers,
            write_through=setup.write_through,
            index=setup.index,
        )


@dataclass(slots=True, eq=False)
class WindowTable:
    """A request's window-layer blocks: issued by `WindowGroup.open`, changed by `extend` and
    `slide`, given back by `close` (the group's methods are its only writers).

    `blocks[i]` is the block of index i, None once released (or, below the hit's live start,
    never held). A tuple replaced whole on every change, as `BlockTable.blocks`. The table holds
    one reference to every block it lists."""

    blocks: tuple[int | None, ...]
    namespace: str | None
    copy: tuple[int, int, int] | None = None  # (source, target, slots) of a partial hit block
    pinned: int | None = field(default=None, repr=False)  # the copy's source, held until it ran
    # the tail the request last resumed from or kept: a deeper one supersedes it
    last_tail: TailKey | None = field(default=None, repr=False)
    prompt: bytes = field(default=b"", repr=False)  # packed, as admitted
    # Where the request's tokens leave the tree's cached path, past the hit: a point a later
    # request can resume from (the next question about the same document), whose window KV is
    # kept once written (`slide`). None: none, or kept already.
    branch: int | None = None

    @property
    def num_live_blocks(self) -> int:
        return sum(b is not None for b in self.blocks)


@dataclass(slots=True, eq=False)
class _Tail:
    """The window blocks of indices `first .. ceil(end / B) - 1` of one cached prefix."""

    end: int
    prefix: bytes = field(repr=False)  # the packed tokens [0, end)
    first: int
    blocks: tuple[int, ...]
    proven: bool  # in the proven segment, else in the speculative one
    branch: bool  # kept at a branch point of the tree's paths
    # with events or tiers: the keys of its full blocks (indices first .. end // B - 1)
    keys: tuple[BlockKey, ...] = field(default=(), repr=False)

    @property
    def hashes(self) -> tuple[int, ...]:
        return tuple(key.block_hash for key in self.keys)


@dataclass(frozen=True, slots=True)
class WindowHit:
    """Where the window group resumes a prompt (`WindowGroup.find`): at `end` tokens, from the
    tail kept there or (`lower`) from its lower tiers' blocks at a block boundary."""

    end: int
    lower: LowerHit | None = None


@dataclass(frozen=True, slots=True)
class WindowStats:
    """The window group's figures (`WindowGroup.stats`), as `CacheStats` are the full group's.
    Its pool: `num_in_use_blocks + num_tail_blocks + num_free_blocks == num_blocks`."""

    window: int  # tokens a window layer reads
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_tail_blocks: int  # held by tails only: what dropping every tail would free
    num_in_use_blocks: int  # held by open tables (running requests), tails may share them
    num_tails: int
    num_evicted_tails: int  # since start
    # The lower tiers (`LowerTiers.stats`); zeros without them. Hits are counted once, by the
    # full group's `CacheStats`: these count the window blocks a hit loaded.
    num_host_blocks: int = 0  # the host tier's size
    num_host_cached_blocks: int = 0  # host blocks holding a block
    num_offloaded_blocks: int = 0  # device -> host copies planned
    num_loaded_blocks: int = 0  # host -> device copies planned (disk reads included)
    num_disk_reads: int = 0  # block files read into the host tier
    num_disk_writes: int = 0  # host blocks written to disk as they left the host tier


class WindowGroup:
    """`num_blocks` window blocks of `block_size` tokens for layers of window `window`.

    Invariants (recomputed by `check_integrity`):
    * every block's ref count = tails listing it + open tables listing it + tables pinning it;
    * a tail ending at e holds e tokens under their key and exactly the blocks of indices
      first .. ceil(e/B)-1, first_live_index(e) - margin <= first <= first_live_index(e);
    * each namespace's sorted ends list the ends of its tails; the two eviction segments list
      every tail once, in the segment its `proven` names;
    * a table's listed blocks are one run that reaches its last entry;
    * with events, each announced hash is held by as many tails as list it, and a tail lists
      one per full block it keeps.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        *,
        events: EventRecorder | None = None,
        keys: KeyChain | None = None,
        tiers: LowerTiers | None = None,
        write_through: bool = False,
        index: int = 1,
    ) -> None:
        """`events`: the recorder tails are announced to, as group `index`; `tiers`: the lower
        tiers an evicted tail's full window blocks are demoted to and a hit past the device's
        tails is loaded from; both name blocks by `keys` (the tree group's chain).
        `write_through`: a tail's full blocks are copied to the tiers when it is kept, not when
        it is evicted (no effect without tiers)."""
        assert (events is None and tiers is None) or keys is not None, "blocks need keys"
        self.name = WindowKind.name
        self.index = index
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = self.pool.block_size
        self.num_blocks = self.pool.num_blocks
        self.window = check_size(window, "window", low=1)
        self._events, self._keys, self.tiers = events, keys, tiers
        self._write_through = write_through and tiers is not None
        self._announced: Counter[int] = Counter()  # wire hash -> tails holding its block
        self._tails: dict[TailKey, _Tail] = {}
        # the eviction order: speculative tails, then proven ones, least recently used first
        self._speculative: OrderedDict[TailKey, None] = OrderedDict()
        self._proven: OrderedDict[TailKey, None] = OrderedDict()
        self._ends = PointEnds()
        self._tail_refs: Counter[int] = Counter()
        self._open: set[WindowTable] = set()
        self.num_evicted_tails = 0

    @property
    def margin(self) -> int:
        """Blocks kept before a window's first live one (`tier_margin`)."""
        return tier_margin(self.tiers is not None)

    @property
    def num_tails(self) -> int:
        return len(self._tails)

    def stats(self) -> WindowStats:
        """The pool's split, the tails and the lower tiers' figures. O(tail blocks)."""
        pool, tails = self.pool, self.num_evictable_blocks()
        return WindowStats(
            window=self.window,
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            num_free_blocks=pool.num_free,
            num_tail_blocks=tails,
            num_in_use_blocks=pool.num_blocks - pool.num_free - tails,
            num_tails=self.num_tails,
            num_evicted_tails=self.num_evicted_tails,
            **({} if self.tiers is None else self.tiers.stats()),
        )

    # ----------------------------------------------------------------- reading
    def hit(self, qb: bytes, num_matched: int, namespace: str | None) -> int:
        """The deepest point e <= `num_matched` of the packed tokens `qb` that has a tail (0:
        none), where `num_matched` is what the full layers' cache matched. Mutates nothing.
        O(num_matched + tails ending up to it): one hash over the prompt, digests taken at each
        end on the way."""
        for key in self._ends.keys_upto(qb, num_matched, namespace):
            tail = self._tails.get(key)
            if tail is not None and qb.startswith(tail.prefix):
                return key[1]
        return 0

    def tail_prefixes(self) -> list[tuple[str | None, bytes]]:
        """(namespace, packed prefix) of every tail, in eviction order."""
        return [(key[0], self._tails[key].prefix) for key in (*self._speculative, *self._proven)]

    def live_blocks(self, num_tokens: int) -> int:
        """Blocks a table covering `num_tokens` written tokens lists once slid."""
        return -(-num_tokens // self.block_size) - first_live_index(
            num_tokens, self.window, self.block_size
        )

    # ---------------------------------------------------- the group protocol's admission
    def find(self, probe: Probe, upto: int) -> WindowHit:
        """The deepest point <= `upto` of the probed prompt with its window KV kept: a tail on
        the device, or a block boundary past it whose window blocks are in the lower tiers."""
        end = self.hit(probe.tokens, upto, probe.namespace)
        lower = self.lower_hit(probe.keys, upto, end)
        if lower is None:
            return WindowHit(end)
        return WindowHit(lower.end_block * self.block_size, lower)

    def fits(self, probe: Probe, hit: WindowHit, num_tokens: int) -> bool:
        """Whether `admit(probe, hit, num_tokens)` would succeed. Read-only."""
        if hit.lower is not None:
            return self.fits_lower(hit.lower, num_tokens)
        return self.fits_tail(probe.tokens, hit.end, probe.namespace, num_tokens)

    def admit(self, probe: Probe, hit: WindowHit, num_tokens: int) -> WindowTable | None:
        """A table resuming at `hit` with blocks up to `num_tokens` tokens (None, nothing
        changed, if they are not there: `fits` says so beforehand). It keeps a tail where its
        tokens leave the tree's cached path, once written (`slide`)."""
        if hit.lower is None:
            table = self.open(probe.tokens, hit.end, probe.namespace)
        else:
            table = self.open_lower(hit.lower, probe.namespace)
        if table is None:
            return None
        if not self.extend(table, num_tokens):
            self.close(table)
            return None
        table.prompt = probe.tokens
        table.branch = probe.num_matched if probe.num_matched > hit.end else None
        return table

    def fits_tail(self, qb: bytes, hit: int, namespace: str | None, num_tokens: int) -> bool:
        """Whether `open(qb, hit, namespace)` then `extend(table, num_tokens)` would succeed.
        Read-only: O(tail blocks) when the free list is short."""
        B = self.block_size
        need = (hit % B != 0) + max(0, -(-num_tokens // B) - -(-hit // B))
        if need <= self.pool.num_free:
            return True
        held = self._tails[tail_key(namespace, qb, hit)].blocks if hit else ()
        pool, refs = self.pool, self._tail_refs
        pinned = sum(pool.ref_count(b) == refs[b] for b in held)  # the table's refs pin them
        return need <= pool.num_free + self.num_evictable_blocks() - pinned

    def lower_hit(self, keys: PromptKeys | None, num_matched: int, above: int) -> LowerHit | None:
        """The deepest block boundary e, `above` < e <= `num_matched`, of the prompt `keys`
        name (the full group's lookup's: its blocks are not hashed again here) whose window
        blocks (first_live_index(e) .. e // B - 1) are all in the lower tiers (None: none, or
        no tiers). Mutates nothing (the disk is probed, not read)."""
        tiers, B = self.tiers, self.block_size
        k_max, k_min = num_matched // B, above // B + 1
        if tiers is None or k_max < k_min or (not tiers.entries and tiers.disk is None):
            return None
        assert keys is not None, "a group with lower tiers names its blocks"
        k = k_max
        while k >= k_min:
            first = first_live_index(k * B, self.window, B)
            found = tiers.lookup(first, keys.span(first, k))
            if found.end_block == k:
                return found
            k = found.end_block  # that block is not found: every boundary above it needs it
        return None

    def fits_lower(self, hit: LowerHit, num_tokens: int) -> bool:
        """Whether `open_lower(hit, ...)` then `extend(table, num_tokens)` would succeed."""
        need = len(hit.keys) + max(0, -(-num_tokens // self.block_size) - hit.end_block)
        return need <= self.pool.num_free + self.num_evictable_blocks()

    def open_lower(self, hit: LowerHit, namespace: str | None) -> WindowTable | None:
        """A table resuming at block boundary `hit.end_block` from the lower tiers: new blocks
        for its window, the loads into them planned (`tiers.take_moves()`). None, nothing
        changed, if the blocks are not there (`fits_lower` says so beforehand)."""
        hit.pin()  # before the allocation demotes tails into the tiers
        new = self._allocate(len(hit.keys))
        if new is None:
            hit.unpin()
            return None
        hit.load(new)
        table = WindowTable((None,) * hit.first + tuple(new), namespace)
        self._open.add(table)
        return table

    def persist(self) -> None:
        """Demote every tail's full blocks to the lower tiers (they stay on the device too),
        then the host tier to disk. Nothing to do without a disk tier."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None:
            return
        for key in (*self._speculative, *self._proven):
            tail = self._tails[key]
            if tail.keys:
                tiers.demote(tail.keys, tail.blocks[: len(tail.keys)])
        tiers.write_to_disk()

    def take_moves(self) -> list[Move]:
        """The tier moves planned since the last call, in order, over this group's blocks ([]
        without lower tiers)."""
        return [] if self.tiers is None else self.tiers.take_moves()

    def forget(self, host_blocks: Sequence[int]) -> None:
        """A move failed and left these host blocks holding garbage: their entries go."""
        if self.tiers is not None:
            self.tiers.forget(host_blocks)

    def take_copies(self) -> list[tuple[int, int, int]]:
        """A window group's only copies are its admissions' (`WindowTable.copy`)."""
        return []

    def step_failed(self) -> None:
        """Its copies write private blocks of the failed step's own requests: nothing kept is
        at stake."""

    def row_blocks(self, table: WindowTable, num_blocks: int) -> tuple[int, ...]:
        """Entries [0, num_blocks), 0 where released: no query of a row reads those (a window
        layer reads from its window's start on)."""
        return tuple(b or 0 for b in table.blocks[:num_blocks])

    # ----------------------------------------------------------------- tables
    def open(self, qb: bytes, hit: int, namespace: str | None) -> WindowTable | None:
        """A table resuming at `hit` (0, or a point `hit()` returned for `qb`): references to
        the tail's blocks and a private copy of its partial last block (`WindowTable.copy`, to
        run before the request writes). None if the copy's block is not there (`fits` says so
        beforehand, read-only)."""
        if not hit:
            table = WindowTable((), namespace)
            self._open.add(table)
            return table
        key = tail_key(namespace, qb, hit)
        tail = self._tails[key]
        partial = hit % self.block_size
        shared = tail.blocks[:-1] if partial else tail.blocks
        held = (*shared, tail.blocks[-1]) if partial else shared
        for b in held:  # before any eviction: what the table reads must stay
            self.pool.add_owner(b)
        self._place(key, proven=True)  # used now: the copy's allocation evicts others first
        new: list[int] = []
        if partial:
            got = self._allocate(1)
            if got is None:
                self.pool.release(held)
                return None
            new = got
        table = WindowTable((None,) * tail.first + (*shared, *new), namespace, last_tail=key)
        if partial:
            table.copy = (tail.blocks[-1], new[0], partial)
            table.pinned = tail.blocks[-1]
        self._open.add(table)
        return table

    def chunk_end(self, table: WindowTable, start: int, end: int) -> int:
        """A tail is kept at any commit point: no chunk must end early."""
        return end

    def extend(self, table: WindowTable, num_tokens: int) -> bool:
        """Blocks for every index up to `num_tokens` tokens (allocated, evicting tails on
        demand); False, nothing changed, if they are not there."""
        assert table in self._open, "extend an open table"
        need = -(-num_tokens // self.block_size) - len(table.blocks)
        if need <= 0:
            return True
        new = self._allocate(need)
        if new is None:
            return False
        table.blocks += tuple(new)
        return True

    def slide(self, table: WindowTable, num_written: int) -> None:
        """Tokens [0, num_written) are written: keep the tail at the table's branch point once
        reached, then release the entries no query at position `num_written` or later reads,
        and the pinned copy source (the copy ran with the step that wrote the tokens before
        `num_written`)."""
        assert table in self._open, "slide an open table"
        branch = table.branch
        if branch is not None and branch <= num_written:
            self.keep_tail(table, table.prompt, branch, branch=True)
            table.branch = None
        self._unpin(table)
        live = first_live_index(num_written, self.window, self.block_size) - self.margin
        live = min(max(0, live), len(table.blocks))
        dead = [b for b in table.blocks[:live] if b is not None]
        if dead:
            self.pool.release(dead)
            table.blocks = (None,) * live + table.blocks[live:]

    def commit(self, table: WindowTable, tokens: PackedTokens, *, prompt_end: bool = False) -> None:
        """Tokens [0, n) are written: keep their tail. `prompt_end`: they are a whole prompt, so
        a tail one token short of it too, where a repeat of the prompt resumes (a hit stops
        short of a prompt's last token, which is always computed)."""
        qb, n = tokens.tobytes(), len(tokens)
        self.keep_tail(table, qb, n)
        if prompt_end and n > 1:
            self.keep_tail(table, qb, n - 1)

    def keep_tail(
        self, table: WindowTable, qb: bytes, num_tokens: int, *, branch: bool = False
    ) -> None:
        """Keep a tail at `num_tokens` (the KV of tokens [0, num_tokens) of `qb` is written): a
        later request can resume there. `branch`: the tree's paths branch there (the tail is
        proven at once). An existing tail at the same prefix is refreshed instead. A tail kept
        at a request's end supersedes the one it last resumed from or kept, if that one was not
        a branch point: it goes first."""
        assert table in self._open, "commit an open table"
        if not num_tokens:
            return
        key = tail_key(table.namespace, qb, num_tokens)
        tail = self._tails.get(key)
        if tail is not None:
            self._place(key, proven=tail.proven or branch)
            return
        first = first_live_index(num_tokens, self.window, self.block_size)
        held_from = len(table.blocks) - table.num_live_blocks  # its blocks are one run
        first = max(first - self.margin, min(first, held_from))
        blocks = table.blocks[first : -(-num_tokens // self.block_size)]
        assert None not in blocks, f"the window of {num_tokens} tokens was released: {blocks}"
        for b in blocks:
            self.pool.add_owner(b)  # type: ignore[arg-type]
        self._tail_refs.update(blocks)  # type: ignore[arg-type]
        prefix = qb[: TOKEN_BYTES * num_tokens]
        tail = _Tail(num_tokens, prefix, first, blocks, branch, branch)  # type: ignore[arg-type]
        if self._keys is not None:
            known = self._tails.get(table.last_tail) if table.last_tail is not None else None
            tail.keys = self._full_keys(table.namespace, prefix, first, known)
        if self._events is not None:
            self._announce(table.namespace, tail.keys)
        if self._write_through and tail.keys:
            self.tiers.demote(tail.keys, tail.blocks[: len(tail.keys)])  # type: ignore[union-attr]
        self._tails[key] = tail
        (self._proven if branch else self._speculative)[key] = None
        self._ends.add(table.namespace, num_tokens)
        if not branch:
            old = self._tails.get(table.last_tail) if table.last_tail is not None else None
            if old is not None and not old.branch:
                self._place(table.last_tail, proven=False, first=True)  # type: ignore[arg-type]
            table.last_tail = key

    def _full_keys(
        self, namespace: str | None, prefix: bytes, first: int, known: _Tail | None = None
    ) -> tuple[BlockKey, ...]:
        """The keys of the full blocks [first, len(prefix) // B) of the packed `prefix`. `known`:
        a tail on a prefix of `prefix` (the one its table resumed from or kept last), whose keys
        the chain continues when they reach `first`: a request's next tail hashes only its new
        blocks, not its whole prefix again."""
        assert self._keys is not None
        nbytes = TOKEN_BYTES * self.block_size
        num_full = len(prefix) // nbytes
        if known is not None and known.keys and known.end <= len(prefix) // TOKEN_BYTES:
            lo, hi = known.first, known.first + len(known.keys)
            if lo <= first <= hi:
                assert prefix.startswith(known.prefix), "a known tail is on this prefix"
                new = token_bytes_le(prefix[hi * nbytes : num_full * nbytes])
                after = known.keys[-1]
                return (*known.keys[first - lo :], *self._keys.chain(namespace, new, after))
        full = prefix[: nbytes * num_full]
        return tuple(self._keys.chain(namespace, token_bytes_le(full))[first:])

    def _announce(self, namespace: str | None, keys: tuple[BlockKey, ...]) -> None:
        """Store events for a new tail's full blocks that no other tail holds, one per
        consecutive run."""
        assert self._events is not None
        run: list[BlockKey] = []
        for key in keys:
            if not self._announced[key.block_hash]:
                run.append(key)
            elif run:
                self._events.stored(run, namespace, group=self.index, window=self.window)
                run = []
            self._announced[key.block_hash] += 1
        self._events.stored(run, namespace, group=self.index, window=self.window)

    def _place(self, key: TailKey, *, proven: bool, first: bool = False) -> None:
        """Move a tail to the recent end (`first`: the front) of a segment."""
        tail = self._tails[key]
        (self._proven if tail.proven else self._speculative).pop(key)
        tail.proven = proven
        segment = self._proven if proven else self._speculative
        segment[key] = None
        if first:
            segment.move_to_end(key, last=False)

    def close(self, table: WindowTable) -> None:
        """Release every block the table lists or pins; the table is left empty."""
        assert table in self._open, "a table is closed once, by the group that issued it"
        self._open.remove(table)
        self._unpin(table)
        self.pool.release([b for b in table.blocks if b is not None])
        table.blocks, table.copy = (), None

    @property
    def num_open_tables(self) -> int:
        return len(self._open)

    def is_open(self, table: WindowTable) -> bool:
        return table in self._open

    def _unpin(self, table: WindowTable) -> None:
        if table.pinned is not None:
            self.pool.release([table.pinned])
            table.pinned = None

    # ----------------------------------------------------------------- eviction
    def num_evictable_blocks(self) -> int:
        """Blocks that dropping every tail would free (those only tails hold). O(tail blocks)."""
        pool = self.pool
        return sum(pool.ref_count(b) == n for b, n in self._tail_refs.items())

    def evict(self, num_blocks: int) -> list[int]:
        """Drop least recently used tails until `num_blocks` blocks are free or no tail is left;
        returns the blocks freed. A tail whose blocks a table still lists frees none of them."""
        freed: list[int] = []
        while len(freed) < num_blocks and self._tails:
            key, _ = (self._speculative or self._proven).popitem(last=False)
            tail = self._tails.pop(key)
            if self.tiers is not None and tail.keys:  # before its blocks can be reused
                self.tiers.demote(tail.keys, tail.blocks[: len(tail.keys)])
            self._ends.remove(key[0], tail.end)
            self._tail_refs.subtract(tail.blocks)
            for b in tail.blocks:
                if not self._tail_refs[b]:
                    del self._tail_refs[b]
            freed += self.pool.release(tail.blocks)
            self.num_evicted_tails += 1
            if self._events is not None:
                gone = self._unannounce(tail.hashes)
                self._events.removed(gone, group=self.index)
        return freed

    def clear(self) -> None:
        """Drop every tail and every lower-tier entry (open tables keep their blocks); tails
        go without events (the full group's `AllBlocksCleared` covers the device)."""
        for tail in self._tails.values():
            self.pool.release(tail.blocks)
        for index in (self._tails, self._speculative, self._proven, self._ends):
            index.clear()
        self._tail_refs.clear()
        self._announced.clear()
        if self.tiers is not None:
            self.tiers.clear()

    def _unannounce(self, hashes: tuple[int, ...]) -> list[int]:
        """A tail holding `hashes` went: those no other tail holds, deepest first."""
        gone = []
        for h in reversed(hashes):
            self._announced[h] -= 1
            if not self._announced[h]:
                del self._announced[h]
                gone.append(h)
        return gone

    def _allocate(self, num_blocks: int) -> list[int] | None:
        short = num_blocks - self.pool.num_free
        if short > 0:
            if short > self.num_evictable_blocks():
                return None
            self.evict(short)
        return self.pool.allocate(num_blocks)

    # ----------------------------------------------------------------- checks
    def check_table(
        self, table: WindowTable, num_written: int, num_tokens: int, chunk: int
    ) -> None:
        """A running request's table covers its written tokens and lists at most
        `window_budget` blocks for rows of at most `chunk` tokens."""
        assert len(table.blocks) >= -(-num_written // self.block_size), (table, num_written)
        limit = window_budget(self.window, self.block_size, chunk, self.margin)
        assert table.num_live_blocks <= limit, (table, limit)

    def check_integrity(self) -> None:
        """Recompute the invariants in the class docstring; raise AssertionError on a violation."""
        B = self.block_size
        owners: Counter[int] = Counter()
        ends: dict[str | None, list[int]] = {}
        segments = {**dict.fromkeys(self._speculative, False), **dict.fromkeys(self._proven, True)}
        if len(segments) != len(self._speculative) + len(self._proven) or segments != {
            k: t.proven for k, t in self._tails.items()
        }:
            raise AssertionError("the eviction segments do not list every tail once, as marked")
        for key, tail in self._tails.items():
            namespace, end = key[0], tail.end
            first = first_live_index(end, self.window, B)
            if key != tail_key(namespace, tail.prefix, len(tail.prefix) // TOKEN_BYTES) or (
                key[1] != end
                or not first - self.margin <= tail.first <= first
                or len(tail.blocks) != -(-end // B) - tail.first
            ):
                raise AssertionError(f"tail at {end} holds {tail} (first index {first})")
            owners.update(tail.blocks)
            ends.setdefault(namespace, []).append(end)
        self._check_announced()
        if owners != self._tail_refs:
            raise AssertionError(f"tail references {self._tail_refs} != tails' blocks {owners}")
        if {ns: sorted(e) for ns, e in ends.items()} != self._ends.as_dict():
            raise AssertionError(f"tail ends {self._ends.as_dict()} != tails' ends {ends}")
        for table in self._open:
            listed = [b for b in table.blocks if b is not None]
            run = table.blocks[len(table.blocks) - len(listed) :]
            if None in run:
                raise AssertionError(f"a table's blocks {table.blocks} are not one run")
            owners.update(listed)
            if table.pinned is not None:
                owners[table.pinned] += 1
        self.pool.check_integrity(dict(owners))
        if self.tiers is not None:
            self.tiers.check_integrity()

    def _check_announced(self) -> None:
        held: Counter[int] = Counter()
        for tail in self._tails.values():
            if self._keys is not None:
                num_full = max(0, tail.end // self.block_size - tail.first)
                if len(tail.keys) != num_full:
                    raise AssertionError(f"tail at {tail.end} keys {tail.hashes}")
            if self._events is not None:
                held.update(tail.hashes)
        if held != self._announced:
            raise AssertionError(f"announced {self._announced} != tails' full blocks {held}")
