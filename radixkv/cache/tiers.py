"""The tiers below the device pool: a host pool of full KV blocks and, optionally, the disk tier.

Both lower tiers hold FULL blocks named by their `BlockKey` (the chained, namespace-salted block
hash of the KV events, plus the prefix digest that rules out hash collisions), so a tenant's block
is never found under another's key. The radix tree holds the device blocks; what it evicts is
demoted here (write-back), and a lookup past what the tree holds goes on by hashing the prompt's
next full blocks and probing the host index, then the disk store (`lookup`).

The host tier is a `BlockPool` of host block ids (one owner each: its index entry) ordered by the
LRU index of the lower tiers (`LruEntries`, on a logical clock). A host block evicted for room is
written to the disk store first when there is one (`DiskWrite`), else dropped.

Nothing here touches KV: every decision is appended to `moves` (`radixkv.cache.moves`) in the
order it was taken, and the engine runs them in that order before the step's forward. That order
is what makes reuse safe: a block a move reads may be freed and become the destination of a LATER
move only. Entries a planned load still reads are pinned (out of the LRU order) until the load is
planned, so planning the device blocks it goes to cannot evict them.

Invariants (`check_integrity`): each host block is free or held by exactly one entry; the LRU index
holds exactly the unpinned entries under their current keys; no tick is ahead of the clock; the
disk store's own invariants.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixkv.cache.events import EventRecorder
from radixkv.cache.eviction import LruEntries, LruEntry
from radixkv.cache.keys import BlockKey
from radixkv.cache.moves import DiskRead, DiskWrite, Load, Move, Offload
from radixkv.cache.pool import BlockPool

HOST_MEDIUM = "CPU"  # vLLM's name of the host tier in KV events
DISK_MEDIUM = "DISK"  # vLLM names no disk tier: this name is ours


class DiskIndex(Protocol):
    """What the cache plans with of the disk tier: which files there are, and which a planned
    read still needs. The engine's `DiskStore` is one; it reads and writes the files (the cache
    holds no file handle) and tells the cache which blocks it indexes and forgets."""

    block_size: int
    on_stored: Callable[[BlockKey], None] | None
    on_removed: Callable[[int], None] | None

    def probe(self, keys: Sequence[BlockKey]) -> int: ...

    def contains(self, block_hash: int) -> bool: ...

    def heads(self) -> Iterator[tuple[int, int | None, bytes]]: ...

    def pin(self, block_hashes: Sequence[int]) -> None: ...

    def unpin(self, block_hashes: Sequence[int]) -> None: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LowerHit:
    """Full blocks of a prompt that a hit reads from the lower tiers (`LowerTiers.lookup`):
    block indices `first .. first + len(keys) - 1`, named by `keys`, the first `h` on the host,
    the rest on disk. `pin` keeps them there while the device blocks they go to are allocated
    (an allocation may demote other blocks into the host tier); then `load` plans their copies
    into those blocks, or `unpin` lets them go."""

    tiers: LowerTiers = field(repr=False, compare=False)
    first: int
    keys: tuple[BlockKey, ...]
    h: int

    @property
    def d(self) -> int:
        """Blocks read from disk (staged through new host entries)."""
        return len(self.keys) - self.h

    @property
    def end_block(self) -> int:
        """The block index past the last block it reads."""
        return self.first + len(self.keys)

    def cut(self, num_blocks: int) -> LowerHit:
        """The first `num_blocks` of its blocks (host ones first, as they come)."""
        return LowerHit(self.tiers, self.first, self.keys[:num_blocks], min(self.h, num_blocks))

    def pin(self) -> None:
        self.tiers.pin(self.keys, self.h, self.d)

    def unpin(self) -> None:
        self.tiers.unpin(self.keys, self.h, self.d)

    def load(self, device: Sequence[int]) -> None:
        """Plan the copies into the device blocks `device[i]` (pinned first) and unpin."""
        self.tiers.load(self.keys, self.h, self.d, device)


@dataclass(slots=True, eq=False)
class HostEntry(LruEntry):
    """One full block in the host tier."""

    key: BlockKey = field(kw_only=True)
    block: int = field(kw_only=True)  # host block id


class LowerTiers:
    """The host tier (`num_host_blocks` blocks of `block_size` tokens) and the disk store (None:
    no disk tier), planned by the cache, run by the engine (see the module docstring). One per
    KV cache group: `group` is its index (its events' group), `window` its sliding window (None:
    its layers read every token), `kind` the kind its events name (None: an attention group's,
    which they leave out); every group's blocks go under the same keys."""

    def __init__(
        self,
        num_host_blocks: int,
        block_size: int,
        disk: DiskIndex | None,
        events: EventRecorder | None,
        *,
        group: int = 0,
        window: int | None = None,
        kind: str | None = None,
    ) -> None:
        self.pool = BlockPool(num_host_blocks, block_size)
        self.block_size = block_size
        self.disk = disk
        self.events = events
        self.group, self.window, self.kind = group, window, kind
        if disk is not None and events is not None:
            disk.on_stored = lambda key: events.stored(
                [key], medium=DISK_MEDIUM, group=group, window=window, kind=kind
            )
            disk.on_removed = lambda h: events.removed([h], DISK_MEDIUM, group=group)
        self.entries = LruEntries()  # block hash -> HostEntry
        self.moves: list[Move] = []
        self.counts = dict.fromkeys(
            ("num_offloaded_blocks", "num_loaded_blocks", "num_disk_reads", "num_disk_writes"), 0
        )

    @property
    def num_host_blocks(self) -> int:
        return self.pool.num_blocks

    def stats(self) -> dict[str, int]:
        """The lower tiers' fields of a group's stats (`CacheStats`, `WindowStats`): the host
        tier's size, the blocks it holds, and the moves planned since start."""
        return {
            "num_host_blocks": self.num_host_blocks,
            "num_host_cached_blocks": len(self.entries),
            **self.counts,
        }

    # ------------------------------------------------------------------ reading
    def holds(self, key: BlockKey) -> bool:
        """Whether the host tier holds the block `key` names (not just one of its hash)."""
        entry = self.entries.get(key.block_hash)
        return entry is not None and entry.key == key

    def lookup(self, first: int, keys: Sequence[BlockKey]) -> LowerHit:
        """The run of `keys` (the blocks from index `first` on) found here from the first on:
        keys[:h] on the host, then keys[h:h+d] on disk. The disk run is capped so that it can
        be staged through the host blocks not holding keys[:h], and it stops before a block
        whose hash the host holds (staging that one would give the host two entries of one
        hash; a later lookup starts from it). Changes nothing."""
        h = 0
        while h < len(keys) and self.holds(keys[h]):
            h += 1
        d = 0
        if self.disk is not None:
            end, cap = h, min(len(keys), self.num_host_blocks)
            while end < cap and keys[end].block_hash not in self.entries:
                end += 1
            d = self.disk.probe(keys[h:end])
        return LowerHit(self, first, tuple(keys[: h + d]), h)

    # ------------------------------------------------------------------ planning
    # The verbs of a `LowerHit`, over the keys it names: keys[:h] on the host, keys[h:h+d] on disk.
    def pin(self, keys: Sequence[BlockKey], h: int, d: int) -> None:
        """Keep keys[:h] on the host and keys[h:h+d] on disk until `load` is planned."""
        for key in keys[:h]:
            self.entries.pin(self.entries[key.block_hash])
        if d:
            assert self.disk is not None
            self.disk.pin([key.block_hash for key in keys[h : h + d]])

    def unpin(self, keys: Sequence[BlockKey], h: int, d: int) -> None:
        """Undo `pin` (the load will not be planned, or failed half way)."""
        for key in keys[:h]:
            entry = self.entries.get(key.block_hash)
            if entry is not None:
                self.entries.touch(entry)
        if d:
            assert self.disk is not None
            self.disk.unpin([key.block_hash for key in keys[h : h + d]])

    def load(self, keys: Sequence[BlockKey], h: int, d: int, device: Sequence[int]) -> None:
        """Plan the loads of pinned keys[:h] (host) and keys[h:h+d] (disk, staged through new host
        entries) into the device blocks `device`, and unpin them."""
        hosts = [self.entries.touch(self.entries[key.block_hash]).block for key in keys[:h]]
        if h:
            self.moves.append(Load(tuple(hosts), tuple(device[:h])))
        if d:
            disk_keys = tuple(keys[h : h + d])
            for key in disk_keys:  # entered the host since the lookup: the staged copy replaces it
                entry = self.entries.get(key.block_hash)
                if entry is not None:
                    assert entry.evict_key is not None, "a pinned entry is one of keys[:h]"
                    self._remove(entry)
            staged = self._allocate(d)
            assert len(staged) == d, "the disk run is capped by the host blocks not pinned"
            self.moves.append(DiskRead(disk_keys, tuple(staged)))
            for key, b in zip(disk_keys, staged, strict=True):
                self._add(key, b)
            self.moves.append(Load(tuple(staged), tuple(device[h : h + d])))
            self.counts["num_disk_reads"] += d
        self.counts["num_loaded_blocks"] += h + d

    def demote(self, keys: Sequence[BlockKey], device: Sequence[int]) -> None:
        """The device blocks `device` (holding `keys`) leave the device: copy those the host
        lacks into host blocks (as many as the host can take, evicting its least recently used
        entries), refresh those it has."""
        missing = []
        for key, b in zip(keys, device, strict=True):
            entry = self.entries.get(key.block_hash)
            if entry is None:
                missing.append((key, b))
            elif entry.key == key and entry.evict_key is not None:
                self.entries.touch(entry)
        hosts = self._allocate(len(missing))
        if hosts:
            missing = missing[: len(hosts)]
            self.moves.append(Offload(tuple(b for _, b in missing), tuple(hosts)))
            for (key, _), host in zip(missing, hosts, strict=True):
                self._add(key, host)
            self.counts["num_offloaded_blocks"] += len(hosts)

    def write_to_disk(self) -> None:
        """Plan writing every host entry to disk (those already there are only refreshed)."""
        entries = list(self.entries.values())
        if self.disk is not None and entries:
            keys = tuple(e.key for e in entries)
            self.moves.append(DiskWrite(tuple(e.block for e in entries), keys))
            self.counts["num_disk_writes"] += len(entries)

    def forget(self, host_blocks: Sequence[int]) -> None:
        """These host blocks hold garbage (a move failed): drop their entries."""
        bad = set(host_blocks)
        for entry in [e for e in self.entries.values() if e.block in bad]:
            self._remove(entry)

    def clear(self) -> None:
        """Drop every host entry (the disk keeps its files)."""
        for entry in list(self.entries.values()):
            self._remove(entry)

    def take_moves(self) -> list[Move]:
        moves, self.moves = self.moves, []
        return moves

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Recompute the invariants in the module docstring; AssertionError names the first."""
        self.entries.check_integrity("host")
        owners = {}
        for entry in self.entries.values():
            if entry.key.block_hash != entry.block_hash or entry.block in owners:
                raise AssertionError(f"host entry {entry.block_hash:016x} is malformed or shared")
            owners[entry.block] = 1
        self.pool.check_integrity(owners)
        if self.disk is not None:
            self.disk.check_integrity()

    # ---------------------------------------------------------------- internals
    def _allocate(self, n: int) -> list[int]:
        """Up to `n` host blocks, evicting the least recently used unpinned entries (each
        written to disk first, with a disk tier)."""
        short = min(n - self.pool.num_free, len(self.entries.order))
        if short > 0:
            victims = list(itertools.islice(self.entries.order, short))
            if self.disk is not None:
                self.moves.append(
                    DiskWrite(tuple(e.block for e in victims), tuple(e.key for e in victims))
                )
                self.counts["num_disk_writes"] += len(victims)
            for entry in victims:
                self._remove(entry)
        return self.pool.allocate(min(n, self.pool.num_free)) or []

    def _add(self, key: BlockKey, block: int) -> None:
        self.entries.add(HostEntry(key.block_hash, key=key, block=block))
        if self.events is not None:
            self.events.stored(
                [key], medium=HOST_MEDIUM, group=self.group, window=self.window, kind=self.kind
            )

    def _remove(self, entry: HostEntry) -> None:
        self.entries.remove(entry.block_hash)
        self.pool.release([entry.block])
        if self.events is not None:
            self.events.removed([entry.key.block_hash], HOST_MEDIUM, group=self.group)
