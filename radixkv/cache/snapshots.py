"""Recurrent-state snapshots: where the state group takes them, and which it drops first.

A hybrid model's recurrent layers (Gated DeltaNet, Mamba) keep one fixed-size state per request
instead of KV per token. A later request can resume at a prefix only where a snapshot of that
state exists *and* the full-attention layers' KV of the prefix is cached. A snapshot is large
(Qwen3.5-4B: ~25 MiB, the KV of ~780 tokens of its 8 full layers), so where they are kept decides
the hits:

- vLLM keeps states on its block grid (528 tokens for Qwen3.5): no hit below one block, and a hit
  resumes at a grid line;
- SGLang keeps one per inserted node (each prefill's end, each finished request), LRU;
- radixkv takes them where the tree says the next hits will resume (`SnapshotPolicy`):
    * the end of a finished request's written tokens: where its next turn resumes;
    * the point where a new prompt leaves the tree (its divergence): the prefix it shares with
      the prompts before it, which the prompts after it will share too (a system prompt, a
      document asked about again);
    * prefill chunk ends, only into free budget (one never evicts another for them);
  none closer than `min_gap_tokens` after the point the request resumed from or its previous
  snapshot: a state costs the same bytes whatever it saves.

`SnapshotLedger` holds the snapshots' byte budget and their eviction order, beside the KV's and
under the cache's one logical clock:

1. orphans: a snapshot whose prefix KV is gone (it serves nothing until that KV comes back from
   a lower tier);
2. superseded ones: a snapshot with a deeper one below it on an unbranched path (a chat's earlier
   turn end once the next turn finished: every prompt through it reaches the deeper one, unless
   it diverges in between, as a regenerated reply does);
3. the rest by GDSF (Greedy-Dual-Size-Frequency, the tree's KV order): a snapshot's priority is
   the inflation at its last use plus its uses (taken, then each request that resumed from it),
   the inflation rising to each victim's priority, so a document's junction that many questions
   resumed from outlives a one-off request's end, and every snapshot ages; or LRU on request.
   Ties: the older tick, then the smaller key.

The tree says which snapshots are orphaned or superseded (`set_orphan`, `set_superseded`); a
pinned snapshot (being copied into a request's state slot) is never a victim.

Pure Python: the state group (radixkv/cache) and the model-free simulation
(benchmarks/snapshot_bench.py) run this same code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from sortedcontainers import SortedList

__all__ = ["SnapshotLedger", "SnapshotPoint", "SnapshotPolicy", "SnapshotStats"]

Reason = Literal["divergence", "chunk", "finished"]


@dataclass(frozen=True, slots=True)
class SnapshotPoint:
    """Take a snapshot of the state after `position` tokens of the request's sequence."""

    position: int
    required: bool  # False: only into free budget, never evicting another snapshot
    reason: Reason


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    """Where a request's snapshots are taken (see the module docstring)."""

    min_gap_tokens: int = 64  # a snapshot saves at least this many tokens over the one before it
    chunk_snapshots: bool = True  # opportunistic snapshots at prefill chunk ends

    def __post_init__(self) -> None:
        if self.min_gap_tokens < 1:
            raise ValueError(f"min_gap_tokens must be >= 1, got {self.min_gap_tokens}")

    def prefill_points(
        self,
        *,
        resume: int,
        divergence: int,
        num_prompt_tokens: int,
        chunk_ends: Iterable[int] = (),
    ) -> tuple[SnapshotPoint, ...]:
        """The snapshots to take while computing a prompt from `resume` (the hit: where its state
        came from) to `num_prompt_tokens`, in position order. `divergence` is where the prompt
        leaves the tree (the full-attention match, resume <= divergence); `chunk_ends` are the
        positions where the scheduler's prefill chunks end. The scheduler ends a chunk at every
        required point, so each is copied in the step that computes it."""
        assert 0 <= resume <= divergence <= num_prompt_tokens, (resume, divergence)
        candidates: list[SnapshotPoint] = []
        if divergence > resume:
            candidates.append(SnapshotPoint(divergence, True, "divergence"))
        if self.chunk_snapshots:
            candidates += [
                SnapshotPoint(end, False, "chunk")
                for end in chunk_ends
                if resume < end < num_prompt_tokens and end != divergence
            ]
        candidates.sort(key=lambda p: p.position)
        points: list[SnapshotPoint] = []
        last = resume
        for point in candidates:
            if point.position - last >= self.min_gap_tokens:
                points.append(point)
                last = point.position
        return tuple(points)

    def finish_point(self, *, last_point: int, num_written: int) -> SnapshotPoint | None:
        """The snapshot at a finished request's end (its written tokens: prompt + reply minus
        the last sampled token), where its next turn resumes; `last_point` is the deepest point
        its state came from or was snapshotted at. None when too close to it."""
        assert 0 <= last_point <= num_written, (last_point, num_written)
        if num_written - last_point < self.min_gap_tokens:
            return None
        return SnapshotPoint(num_written, True, "finished")


@dataclass(frozen=True, slots=True)
class SnapshotStats:
    num_snapshots: int
    num_bytes: int
    budget_bytes: int
    num_taken: int
    num_evicted: int  # dropped to make room for another
    num_refused: int  # not taken: no room (optional ones without free budget, or all pinned)
    num_hits: int  # requests that resumed from a snapshot


@dataclass(slots=True)
class _Entry:
    tick: int
    priority: int  # GDSF: the inflation at its last use + its uses (LRU: unused)
    uses: int = 1  # taken, then once per request that resumed from it
    orphan: bool = False
    superseded: bool = False
    pins: int = 0


class SnapshotLedger:
    """The snapshots a cache holds (by key: the tree node whose end they are at), their byte
    budget and the order they go in.

    Invariants (`check_integrity`): every snapshot takes `snapshot_bytes`; their bytes never
    exceed `budget_bytes`; the eviction order holds exactly the unpinned snapshots, keyed
    (not orphan, not superseded, GDSF priority (0 under LRU), tick, key): orphans first, then
    superseded ones, then the lowest priority, the least recently used, the smaller key.
    """

    def __init__(
        self, budget_bytes: int, snapshot_bytes: int, eviction: Literal["gdsf", "lru"] = "gdsf"
    ) -> None:
        if eviction not in ("gdsf", "lru"):
            raise ValueError(f"eviction must be 'gdsf' or 'lru', got {eviction!r}")
        if snapshot_bytes < 1:
            raise ValueError(f"snapshot_bytes must be >= 1, got {snapshot_bytes}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.snapshot_bytes = snapshot_bytes
        self.eviction = eviction
        self._inflation = 0  # GDSF's L: the priority of the last snapshot evicted
        self._entries: dict[int, _Entry] = {}
        self._order: SortedList = SortedList()  # `_order_key`s of the unpinned entries
        self._taken = self._evicted = self._refused = self._hits = 0

    # --- reading

    @property
    def capacity(self) -> int:
        """How many snapshots the budget holds."""
        return self.budget_bytes // self.snapshot_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def keys(self) -> list[int]:
        return sorted(self._entries)

    def num_free(self) -> int:
        return self.capacity - len(self._entries)

    def victims(self) -> list[int]:
        """The unpinned snapshots in the order they would go (read-only)."""
        return [order[-1] for order in self._order]

    def stats(self) -> SnapshotStats:
        return SnapshotStats(
            num_snapshots=len(self._entries),
            num_bytes=len(self._entries) * self.snapshot_bytes,
            budget_bytes=self.budget_bytes,
            num_taken=self._taken,
            num_evicted=self._evicted,
            num_refused=self._refused,
            num_hits=self._hits,
        )

    # --- changing

    def take(self, key: int, tick: int, *, required: bool) -> list[int] | None:
        """Hold a new snapshot at `key`. An optional one is taken only into free budget; a
        required one evicts in order until it fits. Returns the keys evicted for it (the caller
        frees their states), or None, changing nothing, if it was not taken."""
        assert key not in self._entries, f"snapshot {key} taken twice"
        need = 1 - self.num_free()
        if need > 0 and (not required or need > len(self._order)):
            self.refused()
            return None
        evicted = self.evict(max(need, 0))
        self._entries[key] = _Entry(tick, self._inflation + 1)
        self._order.add(self._order_key(key))
        self._taken += 1
        return evicted

    def evict(self, num: int) -> list[int]:
        """Drop up to `num` unpinned snapshots in the eviction order, GDSF's inflation rising to
        each one's priority; returns their keys (the caller frees their states)."""
        evicted = [order[-1] for order in self._order[:num]]
        for victim in evicted:
            self._inflation = max(self._inflation, self._entries[victim].priority)
            self.drop(victim)
        self._evicted += len(evicted)
        return evicted

    def refused(self) -> None:
        """Count a snapshot its caller did not take for want of room."""
        self._refused += 1

    def touch(self, key: int, tick: int, *, hit: bool = False) -> None:
        """A request used the snapshot at `tick` (`hit`: it resumed from it)."""
        entry = self._entries[key]
        assert tick >= entry.tick, "the clock does not go back"
        self._unlist(key)
        entry.tick = tick
        entry.uses += hit
        entry.priority = self._inflation + entry.uses
        self._list(key)
        self._hits += hit

    def set_orphan(self, key: int, orphan: bool) -> None:
        """The snapshot's prefix KV left every tier (True) or came back (False)."""
        self._unlist(key)
        self._entries[key].orphan = orphan
        self._list(key)

    def set_superseded(self, key: int, superseded: bool) -> None:
        """A deeper snapshot lies below this one on an unbranched path (True), or no longer."""
        self._unlist(key)
        self._entries[key].superseded = superseded
        self._list(key)

    def is_superseded(self, key: int) -> bool:
        return self._entries[key].superseded

    def pin(self, key: int) -> None:
        """Keep the snapshot until `unpin` (a copy into a request's slot is planned)."""
        entry = self._entries[key]
        if entry.pins == 0:
            self._order.remove(self._order_key(key))
        entry.pins += 1

    def unpin(self, key: int) -> None:
        entry = self._entries[key]
        assert entry.pins > 0, f"snapshot {key} unpinned more often than pinned"
        entry.pins -= 1
        if entry.pins == 0:
            self._order.add(self._order_key(key))

    def drop(self, key: int) -> None:
        """Forget the snapshot (evicted, or its node left the tree). Not while pinned."""
        assert self._entries[key].pins == 0, f"snapshot {key} dropped while pinned"
        self._order.remove(self._order_key(key))
        del self._entries[key]

    def clear(self) -> None:
        assert all(e.pins == 0 for e in self._entries.values()), "clear while pinned"
        self._entries.clear()
        self._order.clear()

    def _order_key(self, key: int) -> tuple[bool, bool, int, int, int]:
        entry = self._entries[key]
        priority = entry.priority if self.eviction == "gdsf" else 0
        return (not entry.orphan, not entry.superseded, priority, entry.tick, key)

    # A pinned snapshot is out of the order; these two keep it so while a key's fields change.
    def _unlist(self, key: int) -> None:
        if self._entries[key].pins == 0:
            self._order.remove(self._order_key(key))

    def _list(self, key: int) -> None:
        if self._entries[key].pins == 0:
            self._order.add(self._order_key(key))

    def check_integrity(self) -> None:
        assert len(self._entries) * self.snapshot_bytes <= self.budget_bytes, "over budget"
        unpinned = {k for k, e in self._entries.items() if e.pins == 0}
        assert {order[-1] for order in self._order} == unpinned, "order != unpinned snapshots"
        assert len(self._order) == len(unpinned), "a snapshot listed twice"
        for order in self._order:
            assert order == self._order_key(order[-1]), f"stale order key of {order[-1]}"
