"""The state group: recurrent layers' state in slots, one per running request, and snapshots of it
at points of the tree's paths where later requests resume.

A recurrent layer (Gated DeltaNet, Mamba, a short convolution) keeps one fixed-size state per
request instead of KV per token. The group's pool is a set of *slots*, each of which holds one
whole state of every recurrent layer (the engine's tensors; the cache sees slot ids):

    a running request   holds one slot, whatever its length (`StateTable.slot`); the step's
                        recurrent layers read it at the request's first token and write it
                        after its last
    a snapshot          holds one slot: the state after exactly `end` tokens of one prefix,
                        kept where the policy says a later request will resume
                        (`radixkv.cache.snapshots.SnapshotPolicy`)

A hit resumes at the deepest snapshot on the prompt whose prefix KV the tree holds (`find`: the
deepest point <= the tree's match); the admission plans a copy of the snapshot's slot into the
request's new slot (`StateTable.copy`, run before the forward; the snapshot pinned until it
ran). A miss past it recomputes from there; with no snapshot the request starts from a zero
state (no copy: the step's metadata says it has no initial state).

Where snapshots are taken (`SnapshotPolicy`), each copied in the same step that computed it:

    divergence   where the prompt leaves the tree (the tree's match at admission): required, so
                 the prompt's chunk ends there (`chunk_end`) and the copy of the running slot
                 into a new snapshot slot runs before the next step's forward (`take_copies`)
    chunk ends   at other prefill chunk ends, only into a free slot
    the end      when the request leaves (finished, or preempted: its recompute resumes there),
                 its state after its last committed tokens: the running slot itself becomes the
                 snapshot, no copy at all

none closer than the policy's gap after the point its state came from or its previous snapshot.
The state in a slot is the state after the tokens the request's rows computed: the scheduler
commits what a row computed before it slides (`Scheduler._record_row`) and slides one token
short of it, so a commit past the last slide is a row's end, and a final commit short of it
(an overlapped step's stop: a later row computed the stop token) has no state to keep.

Eviction (`SnapshotLedger`, under the tree's logical clock): a slot a running request needs
comes first; a required snapshot evicts others; the order is orphans (a snapshot whose prefix KV
is gone from every tier of the tree: checked when a victim is chosen), then superseded ones (the
request that resumed from or took a snapshot took a deeper one on the same path, as a chat's next
turn does; a divergence snapshot, where paths branch, is never superseded), then GDSF (or LRU).
A snapshot resumed from is no longer superseded.

Where this differs from the anchors: vLLM keeps states on its block grid (528 tokens for
Qwen3.5, no hit below it); SGLang one per inserted node (prompt and request ends). Here they sit
where the tree says prompts diverge and where a conversation's next turn resumes, token-granular.

Compact snapshots (`StateSpec.snapshot_bytes`: the engine stores kept states smaller than a
running one, `snapshot_dtype` bf16 or int8): the slots split in two pools, slots [0,
`num_running`) for running requests at the running state's format and the rest for snapshots,
as SGLang keeps its checkpoints apart from its active states. A snapshot is then always a copy
(the engine compacts it as it copies), a leaving request's too: its slot is freed at once and
the copy runs first in the next step, before anything can write the slot again; a resume copy
expands one back. Snapshots then never take a running slot, nor running requests theirs.

Lower tiers (`tiers`, `radixkv.cache.state_tiers.SnapshotTiers`): a snapshot evicted for room
is demoted to the host tier (one host slot: an `Offload` of its slot, planned before the slot is
reused, so it runs before that step's copies and forward), under the chained key of its prefix
(the KV blocks' chain, its tail after the last full block hashed on); the host tier evicts to the
disk tier, and `persist` writes every snapshot down. `find` goes on past the device's deepest
snapshot to the lower tiers' (up to the tree's match, which counts the tree's own lower tiers),
and `admit` plans the load of such a hit straight into the request's running slot: one no
planned copy still reads (a leaving request's slot, compact, is the source of its snapshot's
copy, and a load is a move: it runs before the copies). A snapshot whose copy has not run yet
(planned, or in a step that may still fail) is never demoted. A lower tier holds a snapshot as
the device's snapshot slot holds it (`snapshot_bytes` a unit, compact or not); the engine's
load into a running slot expands a compact one as a resume copy does.

KV events (with a recorder): a snapshot is announced as the state group's (its index, vLLM's
kind "mamba") when taken and when dropped, one key each; its tiers announce theirs likewise.

A step whose copies may not have run (it failed before its forward) loses the snapshots those
copies were to fill (`step_failed`). Pure Python; the slots' contents are the engine's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from radixkv.cache.events import EventRecorder
from radixkv.cache.group import GroupSetup, GroupSpec, PoolConfig, Probe
from radixkv.cache.keys import BlockKey, KeyChain
from radixkv.cache.moves import Move
from radixkv.cache.points import PointEnds, PointKey, point_key
from radixkv.cache.pool import BlockPool
from radixkv.cache.snapshots import SnapshotLedger, SnapshotPolicy
from radixkv.cache.state_tiers import SNAPSHOT_KIND, SnapshotTiers, prefix_snapshot_key
from radixkv.cache.tiers import LowerHit
from radixkv.cache.tokens import TOKEN_BYTES, PackedTokens, check_size

# A snapshot copy: (running slot, snapshot slot, 1), as a copy-on-write names (source, target,
# slots): the whole state of every recurrent layer.
SlotCopy = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class StateSpec(GroupSpec):
    """The recurrent layers of a model: `slot_bytes` is one request's state over all of them;
    `snapshot_bytes` a kept snapshot's where the engine stores snapshots compact, in a pool of
    their own (None: at the running state's format, in the one pool)."""

    kind: ClassVar[str] = "state"
    slot_bytes: int
    snapshot_bytes: int | None = None


class StatePoolConfig(PoolConfig, Protocol):
    @property
    def num_snapshots(self) -> int | None: ...  # None: `snapshot_share` of a byte budget
    @property
    def snapshot_share(self) -> float: ...
    @property
    def snapshot_min_gap_tokens(self) -> int: ...


DEFAULT_SNAPSHOTS_PER_SEQ = 2  # snapshots per running request when the pools are counted out


class StateKind:
    """The state group's entry in the registry (`radixkv.cache.kinds`)."""

    name = "state"

    def plan_blocks(
        self, spec: StateSpec, config: StatePoolConfig, bytes_per_block: int, budget: int | None
    ) -> int:
        """Slots: one per running request (`max_num_seqs`, `bytes_per_block` each) and
        `num_snapshots` more, or `snapshot_share` of a `budget` in bytes (in snapshots of the
        spec's `snapshot_bytes`, where it has them), or (the pools counted out in blocks)
        DEFAULT_SNAPSHOTS_PER_SEQ per running request. ValueError for a budget that holds not
        the running requests' slots."""
        running = config.max_num_seqs
        snapshot_bytes = spec.snapshot_bytes or bytes_per_block
        if config.num_snapshots is not None:
            return running + config.num_snapshots
        if budget is None:
            return running * (1 + DEFAULT_SNAPSHOTS_PER_SEQ)
        if running * bytes_per_block > budget:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds not the recurrent states of "
                f"max_num_seqs={running} requests ({bytes_per_block} bytes each)"
            )
        return running + int(config.snapshot_share * budget) // snapshot_bytes

    def build(self, spec: StateSpec, setup: GroupSetup) -> StateGroup:
        config = setup.config
        policy = SnapshotPolicy() if config is None else _policy_of(config)
        eviction = setup.eviction if setup.eviction in ("gdsf", "lru") else "gdsf"
        compact = spec.snapshot_bytes is not None
        assert not compact or config is not None, "compact snapshots need max_num_seqs"
        tiers = None
        if setup.host_blocks:
            assert setup.keys is not None, "the lower tiers name snapshots by the tree's chain"
            tiers = SnapshotTiers(
                setup.host_blocks, setup.keys, setup.disk, setup.events, group=setup.index
            )
        return StateGroup(
            setup.num_blocks,
            setup.block_size,
            spec.slot_bytes,
            policy=policy,
            tree=setup.tree,
            eviction=eviction,
            index=setup.index,
            num_running=config.max_num_seqs if compact else None,
            snapshot_bytes=spec.snapshot_bytes,
            events=setup.events,
            keys=setup.keys,
            tiers=tiers,
        )


def _policy_of(config: Any) -> SnapshotPolicy:
    return SnapshotPolicy(min_gap_tokens=config.snapshot_min_gap_tokens)


@dataclass(frozen=True, slots=True)
class StateHit:
    """Where the state group resumes a prompt: after `end` tokens, from the snapshot in slot
    `slot`, or (`lower`) from the host or disk tier's snapshot there (neither: from a zero
    state at 0)."""

    end: int
    slot: int | None = None
    lower: LowerHit | None = None


@dataclass(slots=True, eq=False)
class StateTable:
    """A running request's state: issued by `StateGroup.admit`, changed by the group's methods
    only, given back by `close`."""

    slot: int  # the running slot
    namespace: str | None
    prompt: bytes = field(repr=False)  # packed, as admitted
    copy: SlotCopy | None = None  # (snapshot slot, running slot, 1): the resume, before writing
    pinned: int | None = field(default=None, repr=False)  # the copy's source, until it ran
    state_end: int = 0  # the state in the slot is after this many tokens
    last_point: int = 0  # the deepest point its state came from or was snapshotted at
    last_snapshot: int | None = field(default=None, repr=False)  # that snapshot's slot
    required: tuple[int, ...] = ()  # required points still ahead (where a chunk must end)
    leaving: int | None = None  # a commit's end whose state the slot holds, until a new row
    committed: bytes = field(default=b"", repr=False)  # packed: the tokens of that commit

    @property
    def blocks(self) -> tuple[int, ...]:
        return (self.slot,)


@dataclass(slots=True, eq=False)
class _Snapshot:
    key: PointKey
    prefix: bytes = field(repr=False)  # the packed tokens [0, end)
    slot: int
    divergence: bool  # taken where a prompt left the tree: never superseded
    lower_key: BlockKey | None = field(default=None, repr=False)  # with events or tiers

    @property
    def end(self) -> int:
        return self.key[1]


@dataclass(frozen=True, slots=True)
class StateStats:
    """The state group's figures (`StateGroup.stats`). Its pool:
    `num_running_slots + num_snapshots + num_free_slots == num_slots`."""

    num_slots: int
    slot_bytes: int  # one state of every recurrent layer (a running request's)
    num_free_slots: int
    num_running_slots: int  # held by running requests
    num_snapshots: int
    num_snapshot_bytes: int
    num_taken: int  # snapshots taken since start
    num_evicted: int  # dropped for room
    num_refused: int  # not taken: no room (an optional one without a free slot)
    num_hits: int  # admissions that resumed from a snapshot
    num_hit_tokens: int  # the tokens those resumed past
    num_copies: int  # slot copies planned (snapshots taken mid-prompt, resumes)
    snapshot_bytes: int = 0  # one kept snapshot (slot_bytes, unless they are stored compact)
    num_lower_hits: int = 0  # of `num_hits`: resumed from the host or disk tier's snapshot
    # The lower tiers (`LowerTiers.stats`, a block is a snapshot of `snapshot_bytes`); zeros
    # without them.
    num_host_blocks: int = 0  # the host tier's snapshots at most
    num_host_cached_blocks: int = 0  # snapshots the host tier holds
    num_offloaded_blocks: int = 0  # snapshots copied device -> host (evicted, or persisted)
    num_loaded_blocks: int = 0  # host -> running slot copies planned (disk reads included)
    num_disk_reads: int = 0
    num_disk_writes: int = 0


class StateGroup:
    """`num_slots` slots of `slot_bytes` each (see the module docstring).

    Invariants (recomputed by `check_integrity`):
    * every slot has at most one owner, an open table (its running slot) or a snapshot, and
      the pool's counts say so; with compact snapshots, the open tables' slots lie below
      `num_running` and the snapshots' at or above it;
    * each snapshot is listed under its key, its end in `PointEnds`, its slot in the ledger;
      the ledger holds exactly the snapshots' slots, pinned once per open table whose resume
      copy reads it;
    * a table's required points lie past its state and after its last point.
    """

    def __init__(
        self,
        num_slots: int,
        block_size: int,
        slot_bytes: int,
        *,
        policy: SnapshotPolicy | None = None,
        tree: Any = None,
        eviction: str = "gdsf",
        index: int = 1,
        num_running: int | None = None,
        snapshot_bytes: int | None = None,
        events: EventRecorder | None = None,
        keys: KeyChain | None = None,
        tiers: SnapshotTiers | None = None,
    ) -> None:
        """`tree`: the tree's group (a `PrefixCache`), whose clock stamps the snapshots and
        whose match says which have lost their prefix KV (None: none ever does).
        `num_running` / `snapshot_bytes`: compact snapshots (see the module docstring), the
        first `num_running` slots for running requests, the rest for snapshots of
        `snapshot_bytes` each (None: one pool, a snapshot's size a slot's). `events`: the
        recorder snapshots are announced to (group `index`, kind "mamba"); `tiers`: where a
        snapshot evicted for room goes and a hit past the device's snapshots comes from; both
        name snapshots by `keys` (the tree's chain, `radixkv.cache.state_tiers`)."""
        assert (num_running is None) == (snapshot_bytes is None), (num_running, snapshot_bytes)
        assert (events is None and tiers is None) or keys is not None, "snapshots need keys"
        self.name = StateKind.name
        self.index = index
        self.block_size = check_size(block_size, "block_size", low=1)
        self.slot_bytes = check_size(slot_bytes, "slot_bytes", low=1)
        self.snapshot_bytes = check_size(snapshot_bytes or slot_bytes, "snapshot_bytes", low=1)
        self.num_running = num_running
        if num_running is None:  # one pool: snapshots in any slot
            self.pool = BlockPool(num_slots, 1)
            self.snapshot_pool: BlockPool | None = self.pool
            num_snapshot_slots = num_slots
        else:
            assert 1 <= num_running <= num_slots, (num_running, num_slots)
            self.pool = BlockPool(num_running, 1)
            num_snapshot_slots = num_slots - num_running
            self.snapshot_pool = BlockPool(num_snapshot_slots, 1) if num_snapshot_slots else None
        self.num_blocks = num_slots
        self.policy = policy or SnapshotPolicy()
        self.tiers = tiers
        self._events, self._keys = events, keys
        self._tree = tree
        self.ledger = SnapshotLedger(
            num_snapshot_slots * self.snapshot_bytes,
            self.snapshot_bytes,
            eviction,  # type: ignore[arg-type]
        )
        self._snapshots: dict[PointKey, _Snapshot] = {}
        self._by_slot: dict[int, _Snapshot] = {}
        self._ends = PointEnds()
        self._open: set[StateTable] = set()
        # snapshot copies planned since `take_copies`, each with the snapshot it fills
        self._copies: list[tuple[SlotCopy, _Snapshot]] = []
        self._in_flight: list[_Snapshot] = []  # the snapshots of the copies last handed out
        self._ticks = 0  # without a tree: a clock of its own
        self.num_hit_tokens = self.num_copies = self.num_lower_hits = 0

    # ------------------------------------------------------------------ reading
    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def snapshot_prefixes(self, namespace: str | None = None) -> list[bytes]:
        """The packed prefix of every snapshot of `namespace` on the device, by slot."""
        return [s.prefix for _, s in sorted(self._by_slot.items()) if s.key[0] == namespace]

    def snapshot_ends(self) -> list[tuple[str | None, int]]:
        """(namespace, end) of every snapshot, by slot."""
        return [(s.key[0], s.end) for _, s in sorted(self._by_slot.items())]

    def stats(self) -> StateStats:
        ledger = self.ledger.stats()
        running = len(self._open)
        return StateStats(
            num_slots=self.num_blocks,
            slot_bytes=self.slot_bytes,
            num_free_slots=self._num_free(),
            num_running_slots=running,
            num_snapshots=len(self._snapshots),
            num_snapshot_bytes=ledger.num_bytes,
            num_taken=ledger.num_taken,
            num_evicted=ledger.num_evicted,
            num_refused=ledger.num_refused,
            num_hits=ledger.num_hits + self.num_lower_hits,
            num_hit_tokens=self.num_hit_tokens,
            num_copies=self.num_copies,
            snapshot_bytes=self.snapshot_bytes,
            num_lower_hits=self.num_lower_hits,
            **({} if self.tiers is None else self.tiers.stats()),
        )

    # ---------------------------------------------------- the group protocol's admission
    def find(self, probe: Probe, upto: int) -> StateHit:
        """The deepest snapshot on the probed prompt at or below `upto` (the tree's match): on
        the device, or deeper in the lower tiers. Read-only (the disk is probed, not read)."""
        hit = StateHit(0)
        for key in self._ends.keys_upto(probe.tokens, upto, probe.namespace):
            snap = self._snapshots.get(key)
            if snap is not None and probe.tokens.startswith(snap.prefix):
                hit = StateHit(snap.end, snap.slot)
                break
        if self.tiers is not None and probe.keys is not None:
            found = self.tiers.find(probe.keys, probe.tokens, probe.namespace, hit.end, upto)
            if found is not None:
                return StateHit(found[0], lower=found[1])
        return hit

    def fits(self, probe: Probe, hit: StateHit, num_tokens: int) -> bool:
        """Whether `admit` would find a running slot: a free one, or a snapshot it may evict
        (unpinned, not the one it resumes from; compact snapshots: a free running slot); for a
        hit in a lower tier, one no planned copy reads. Read-only."""
        unread = hit.lower is not None  # a load: into a slot no planned copy reads
        if self._num_free(self.pool, unread=unread):
            return True
        if self.num_running is not None:
            return False
        movable = set(self.ledger.victims()) - {hit.slot}
        return bool(movable - self._copy_sources() if unread else movable)

    def admit(self, probe: Probe, hit: StateHit, num_tokens: int) -> StateTable | None:
        """A table resuming at `hit`: a running slot (evicting a snapshot if none is free) and,
        past 0, the copy of the hit's snapshot into it. Required points: where the prompt
        leaves the tree, when the policy wants one there. None, nothing changed, if no slot can
        be had (`fits` says so beforehand)."""
        if hit.slot is not None:
            self.ledger.pin(hit.slot)  # before the slot's allocation evicts
        if hit.lower is not None:
            hit.lower.pin()  # before an eviction demotes snapshots into the host tier
        slot = self._allocate(required=True, running=True, unread=hit.lower is not None)
        if slot is None:
            if hit.slot is not None:
                self.ledger.unpin(hit.slot)
            if hit.lower is not None:
                hit.lower.unpin()
            return None
        table = StateTable(slot, probe.namespace, probe.tokens, state_end=hit.end)
        table.last_point = hit.end
        if hit.lower is not None:  # loaded straight into the running slot, before the forward
            hit.lower.load([slot])
            self.num_lower_hits += 1
            self.num_hit_tokens += hit.end
        if hit.slot is not None:
            table.copy, table.pinned = (hit.slot, slot, 1), hit.slot
            table.last_snapshot = hit.slot
            self.ledger.touch(hit.slot, self._tick(), hit=True)
            self.ledger.set_superseded(hit.slot, False)  # resumed from: it serves a path
            self.num_hit_tokens += hit.end
            self.num_copies += 1
        num_prompt = len(probe.tokens) // TOKEN_BYTES
        divergence = max(hit.end, min(probe.num_matched, num_prompt))
        points = self.policy.prefill_points(
            resume=hit.end, divergence=divergence, num_prompt_tokens=num_prompt
        )
        table.required = tuple(p.position for p in points if p.required)
        self._open.add(table)
        return table

    # ------------------------------------------------------------------ a request's rows
    def chunk_end(self, table: StateTable, start: int, end: int) -> int:
        """Where a row computing from `start` to at most `end` must stop: at the first required
        point past `start` (its state is copied there), else `end`. Read-only."""
        for point in table.required:
            if start < point < end:
                return point
        return end

    def extend(self, table: StateTable, num_tokens: int) -> bool:
        """A new row is scheduled: the slot's state will move past its last commit."""
        assert table in self._open, "extend an open table"
        table.leaving = None
        return True

    def slide(self, table: StateTable, num_written: int) -> None:
        """A row was recorded: the scheduler slides one token short of what its rows computed,
        so the state is after `num_written + 1` tokens; the resume copy has run."""
        assert table in self._open, "slide an open table"
        table.state_end = max(table.state_end, num_written + 1)
        self._unpin(table)

    def commit(self, table: StateTable, tokens: PackedTokens, *, prompt_end: bool = False) -> None:
        """Tokens [0, n) are in the tree. A commit past the state's last known end is the end of
        the row just computed: the state is after n tokens; one short of it has no state to
        keep (a later row moved it on). At a prompt's chunk end, a required point or a chunk
        end the policy's gap allows takes a snapshot (a copy, next step)."""
        assert table in self._open, "commit an open table"
        n = len(tokens)
        table.state_end = max(table.state_end, n)
        table.leaving = n if n == table.state_end else None
        if table.leaving is None:
            return
        table.committed = qb = tokens.tobytes()
        if n >= len(table.prompt) // TOKEN_BYTES:
            return
        required = n in table.required
        table.required = tuple(p for p in table.required if p > n)
        gap = n - table.last_point >= self.policy.min_gap_tokens
        if required or (gap and self.policy.chunk_snapshots):
            self._take_copy(table, qb, n, required=required)

    def close(self, table: StateTable) -> None:
        """The request leaves: its slot becomes the snapshot of its state after its last commit
        when the policy wants one there (a finished request's end, a preempted one's point),
        else it is freed; a pinned resume source is let go."""
        assert table in self._open, "a table is closed once, by the group that issued it"
        self._open.remove(table)
        self._unpin(table)
        point = None
        if table.leaving is not None:
            point = self.policy.finish_point(last_point=table.last_point, num_written=table.leaving)
        kept = point is not None and self._keep(table, point.position)
        if not kept or self.num_running is not None:  # compact: the copy reads it first
            self._release(table.slot)
        table.copy = None

    def row_blocks(self, table: StateTable, num_blocks: int) -> tuple[int, ...]:
        """The running slot (one entry, whatever the row's length)."""
        return (table.slot,)

    # ------------------------------------------------------------------ plans
    def take_copies(self) -> list[SlotCopy]:
        """The snapshot copies planned since the last call, in order: run them before the
        step's resume copies and forward. The copies handed out before these have run."""
        planned, self._copies = self._copies, []
        live = [(c, snap) for c, snap in planned if self._by_slot.get(snap.slot) is snap]
        self._in_flight = [snap for _, snap in live]
        return [c for c, _ in live]  # a snapshot evicted before its copy ran needs none

    def step_failed(self) -> None:
        """The step that carried the copies last handed out failed, maybe before they ran: the
        snapshots they were to fill are dropped."""
        for snap in self._in_flight:
            if self._by_slot.get(snap.slot) is snap:
                self._drop(snap)
                self._release(snap.slot)
        self._in_flight = []

    def take_moves(self) -> list[Move]:
        """The tier moves planned since the last call, in order, over the state slots ([]
        without lower tiers)."""
        return [] if self.tiers is None else self.tiers.take_moves()

    def forget(self, host_blocks: Sequence[int]) -> None:
        """A move failed and left these host blocks holding garbage: their entries go."""
        if self.tiers is not None:
            self.tiers.forget(host_blocks)

    def persist(self) -> None:
        """Copy every snapshot whose slot holds its state down to the host tier (they stay on
        the device too), then the host tier to disk. Nothing to do without a disk tier."""
        tiers = self.tiers
        if tiers is None or tiers.disk is None:
            return
        unsettled = self._unsettled_slots()
        for snap in self._by_slot.values():
            if snap.slot not in unsettled:
                tiers.demote([self._lower_key(snap)], [snap.slot])
        tiers.write_to_disk()

    def clear(self) -> None:
        """Drop every snapshot not pinned by an open table's resume, and every lower-tier entry
        (the disk keeps its files)."""
        for snap in list(self._by_slot.values()):
            if snap.slot not in self._pinned_slots():
                self._drop(snap)
                self._release(snap.slot)
        if self.tiers is not None:
            self.tiers.clear()

    @property
    def num_open_tables(self) -> int:
        return len(self._open)

    def is_open(self, table: StateTable) -> bool:
        return table in self._open

    # ---------------------------------------------------------------- internals
    def _tick(self) -> int:
        if self._tree is not None:
            return self._tree.clock
        self._ticks += 1
        return self._ticks

    def _take_copy(
        self, table: StateTable, qb: bytes, n: int, *, required: bool, divergence: bool = True
    ) -> None:
        """A snapshot at n of the table's running state, by a copy into a new slot (a required
        one is where a prompt leaves the tree, unless not a `divergence`: a leaving request's
        end, compact)."""
        key = point_key(table.namespace, qb, n)
        if key in self._snapshots:
            self._refresh(table, self._snapshots[key])
            return
        slot = self._allocate(required=required, running=False)
        if slot is None:
            self.ledger.refused()
            return
        divergence = required and divergence
        snap = self._add(key, qb[: TOKEN_BYTES * n], slot, divergence=divergence, table=table)
        self._copies.append(((table.slot, snap.slot, 1), snap))
        self.num_copies += 1

    def _keep(self, table: StateTable, n: int) -> bool:
        """The leaving table's running slot becomes the snapshot at n (no copy; compact
        snapshots: a copy into a snapshot slot, which may evict another); False if one is there
        already (then only refreshed) or, compact, none could be had."""
        qb = table.committed
        key = point_key(table.namespace, qb, n)
        if key in self._snapshots:
            self._refresh(table, self._snapshots[key])
            return False
        if self.num_running is not None:
            self._take_copy(table, qb, n, required=True, divergence=False)
            return key in self._snapshots
        self._add(key, qb[: TOKEN_BYTES * n], table.slot, divergence=False, table=table)
        return True

    def _add(
        self, key: PointKey, prefix: bytes, slot: int, *, divergence: bool, table: StateTable
    ) -> _Snapshot:
        snap = _Snapshot(key, prefix, slot, divergence)
        taken = self.ledger.take(slot, self._tick(), required=True)
        assert taken == [], "the slot was made free first"
        self._snapshots[key] = snap
        self._by_slot[slot] = snap
        self._ends.add(key[0], key[1])
        if self._events is not None:
            self._events.stored(
                [self._lower_key(snap)], snap.key[0], group=self.index, kind=SNAPSHOT_KIND
            )
        self._supersede(table)
        table.last_point, table.last_snapshot = key[1], slot
        return snap

    def _refresh(self, table: StateTable, snap: _Snapshot) -> None:
        self.ledger.touch(snap.slot, self._tick())
        self._supersede(table)
        table.last_point, table.last_snapshot = snap.end, snap.slot

    def _supersede(self, table: StateTable) -> None:
        """The table's previous snapshot (resumed from or taken) is superseded by a deeper one
        on its path, unless it is a divergence point."""
        old = self._by_slot.get(table.last_snapshot) if table.last_snapshot is not None else None
        if old is not None and not old.divergence:
            self.ledger.set_superseded(old.slot, True)

    def _allocate(self, *, required: bool, running: bool, unread: bool = False) -> int | None:
        """A free slot for a running request or a snapshot (`unread`: one no planned copy
        reads); a required one evicts snapshots while none is free (orphans first), unless
        compact snapshots keep their slots apart from the running ones (then a running slot
        never comes from a snapshot)."""
        split = self.num_running is not None
        pool = self.pool if running or not split else self.snapshot_pool
        if pool is None:  # compact, and no slot for snapshots at all
            return None
        while not self._num_free(pool, unread=unread):
            if (split and running) or not required or not self.ledger.victims():
                return None
            self._mark_orphans()
            for slot in self.ledger.evict(1):
                snap = self._by_slot[slot]
                self._demote(snap)
                self._drop(snap, ledger=False)
                self._release(slot)
        got = self._take_unread(pool) if unread else pool.allocate(1)
        if got is None:
            return None
        return got[0] + (self.num_running if split and not running else 0)  # type: ignore[operator]

    def _take_unread(self, pool: BlockPool) -> list[int] | None:
        """One free slot of `pool` that no planned copy reads (a load into it runs before the
        copies), the free list's order kept; None if there is none."""
        reading = self._copy_sources()
        passed: list[int] = []
        got = pool.allocate(1)
        while got is not None and got[0] in reading:
            passed += got
            got = pool.allocate(1)
        pool.release(passed)  # back on the free list as they were, the first on top
        return got

    def _copy_sources(self) -> set[int]:
        """The slots the planned snapshot copies read (running slots)."""
        return {src for (src, _, _), _ in self._copies}

    def _release(self, slot: int) -> None:
        """Free `slot` in the pool it came from."""
        if self.num_running is None or slot < self.num_running:
            self.pool.release([slot])
        else:
            assert self.snapshot_pool is not None, slot
            self.snapshot_pool.release([slot - self.num_running])

    def _num_free(self, pool: BlockPool | None = None, *, unread: bool = False) -> int:
        """Free slots of `pool` (None: of both pools), `unread`: of them those no planned copy
        reads."""
        if pool is None:
            both = self.snapshot_pool not in (None, self.pool)
            return self.pool.num_free + (self.snapshot_pool.num_free if both else 0)  # type: ignore[union-attr]
        if not unread:
            return pool.num_free
        return pool.num_free - sum(pool.ref_count(s) == 0 for s in self._copy_sources())

    def _mark_orphans(self) -> None:
        """Mark each unpinned snapshot orphaned or not by whether the tree (any tier) still
        holds its prefix's KV. O(snapshots x their prefixes' walks): done only when a victim is
        chosen."""
        if self._tree is None:
            return
        pinned = self._pinned_slots()
        for snap in self._by_slot.values():
            if snap.slot in pinned:
                continue
            held = self._tree.match(PackedTokens.frombytes(snap.prefix), namespace=snap.key[0])
            self.ledger.set_orphan(snap.slot, held.num_cached_tokens < snap.end)

    def _pinned_slots(self) -> set[int]:
        return {t.pinned for t in self._open if t.pinned is not None}

    def _unsettled_slots(self) -> set[int]:
        """Slots of snapshots whose copy is planned or in flight (the step carrying it may
        fail): what they hold is not their state yet, so they never go to a lower tier."""
        return {snap.slot for _, snap in self._copies} | {s.slot for s in self._in_flight}

    def _lower_key(self, snap: _Snapshot) -> BlockKey:
        """The snapshot's key in the events and the lower tiers (hashed once, O(its prefix))."""
        if snap.lower_key is None:
            assert self._keys is not None
            snap.lower_key = prefix_snapshot_key(self._keys, snap.key[0], snap.prefix, snap.end)
        return snap.lower_key

    def _demote(self, snap: _Snapshot) -> None:
        """A snapshot evicted for room goes down to the host tier (planned before the slot's
        next use: the move runs before that step's copies and forward)."""
        if self.tiers is not None and snap.slot not in self._unsettled_slots():
            self.tiers.demote([self._lower_key(snap)], [snap.slot])

    def _drop(self, snap: _Snapshot, *, ledger: bool = True) -> None:
        del self._snapshots[snap.key]
        del self._by_slot[snap.slot]
        self._ends.remove(snap.key[0], snap.end)
        if ledger:
            self.ledger.drop(snap.slot)
        if self._events is not None:
            self._events.removed([self._lower_key(snap).block_hash], group=self.index)

    def _unpin(self, table: StateTable) -> None:
        if table.pinned is not None:
            self.ledger.unpin(table.pinned)
            table.pinned = None

    # ----------------------------------------------------------------- checks
    def check_table(self, table: StateTable, num_written: int, num_tokens: int, chunk: int) -> None:
        """A running request holds one slot, its state at or past what it wrote."""
        assert table in self._open and self.pool.ref_count(table.slot) == 1, table
        assert table.state_end >= num_written, (table, num_written)

    def check_integrity(self) -> None:
        """Recompute the invariants in the class docstring; raise AssertionError on a violation."""
        owners: Counter[int] = Counter(t.slot for t in self._open)
        owners.update(list(self._by_slot))
        if any(n > 1 for n in owners.values()):
            raise AssertionError(f"a slot has two owners: {owners}")
        split = self.num_running
        if split is None:
            self.pool.check_integrity(dict(owners))
        else:
            if any(t.slot >= split for t in self._open) or any(s < split for s in self._by_slot):
                raise AssertionError(f"a slot in the wrong pool: {owners} (split at {split})")
            self.pool.check_integrity({s: n for s, n in owners.items() if s < split})
            if self.snapshot_pool is not None:
                snaps = {s - split: n for s, n in owners.items() if s >= split}
                self.snapshot_pool.check_integrity(snaps)
        ends: dict[str | None, list[int]] = {}
        for key, snap in self._snapshots.items():
            if self._by_slot.get(snap.slot) is not snap or snap.key != key:
                raise AssertionError(f"snapshot {key} is not listed by its slot")
            if key != point_key(key[0], snap.prefix, len(snap.prefix) // TOKEN_BYTES):
                raise AssertionError(f"snapshot {key} holds another prefix")
            kept = snap.lower_key
            if kept is not None and kept != self._lower_key(_Snapshot(key, snap.prefix, 0, False)):
                raise AssertionError(f"snapshot {key} keeps a stale lower-tier key")
            ends.setdefault(key[0], []).append(key[1])
        if {ns: sorted(e) for ns, e in ends.items()} != self._ends.as_dict():
            raise AssertionError(f"snapshot ends {self._ends.as_dict()} != {ends}")
        if len(self._by_slot) != len(self._snapshots):
            raise AssertionError("a slot lists a snapshot its key does not")
        if set(self.ledger.keys()) != set(self._by_slot):
            raise AssertionError(
                f"ledger {self.ledger.keys()} != snapshots {sorted(self._by_slot)}"
            )
        pins = Counter(t.pinned for t in self._open if t.pinned is not None)
        unpinned = set(self.ledger.victims())
        for slot in self._by_slot:
            if (slot in pins) == (slot in unpinned):
                raise AssertionError(f"snapshot slot {slot}: pinned {pins[slot]} times")
        self.ledger.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        for table in self._open:
            if any(p <= max(table.state_end, table.last_point) for p in table.required):
                raise AssertionError(f"a required point of {table} lies behind its state")
