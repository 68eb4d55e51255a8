"""Cache groups: what one kind of per-layer cache promises the grouped cache that coordinates it.

A model's layers fall into groups by what they cache: the layers that attend to every token keep
the KV of every token (the tree's group, `PrefixCache`), window-W layers only the last W
(`radixkv.cache.window`); a recurrent layer would keep one state per request and snapshots at
chosen points, a latent-attention layer one compressed vector per token. Each group has its own
pool of blocks and one table per request, indexed like the others' (entry i: positions
[i*B, (i+1)*B)), and every group speaks the one protocol below, so that the scheduler, the step
output, the runner and the tier movers hold lists indexed by group and never ask what kind a
group is (`GroupedCache`, `radixkv.cache.grouped`). A kind is named in its own module and in the
registry (`radixkv.cache.kinds`), nowhere above the cache.

A request's life in one group (the grouped cache calls these for every group, in group order):

    find(probe, upto)             read-only: the deepest point <= upto this group can resume
                                  the prompt from (the tree's group found the probe)
    fits / admit(probe, hit, n)   a table resuming at the hit, blocks up to n tokens; `fits`
                                  says beforehand, read-only, whether `admit` succeeds
    chunk_end(table, start, end)  read-only: where a row from `start` must stop, at most `end`
                                  (the state group ends a prompt's chunk where it snapshots)
    extend(table, n)              blocks for every position up to n (False: not there now)
    slide(table, num_written)     let go of what no later query reads
    commit(table, tokens)         tokens [0, n) are written: keep what a later request resumes
                                  from
    close(table)                  give everything back
    row_blocks(table, k)          the block ids of entries [0, k) a step's row hands the kernels
    table.copy                    a copy-on-write the admission planned (before the forward)
    take_copies()                 copies planned since the last call, besides admissions' (the
                                  state group's snapshots): before the admissions' copies
    step_failed()                 the step that carried the copies last taken failed before its
                                  forward, maybe before they ran
    take_moves()                  tier moves planned since the last call (before the forward)
    forget(host_blocks)           a move failed: those host blocks hold garbage
    persist()                     plan copies of everything kept down to the disk tier
    clear()                       drop everything kept (open tables keep their blocks)
    stats(), check_table(...), check_integrity()

The tree's group (`PrefixCache`) is the first of every grouped cache: it finds the prompt on its
paths (the probe) and serves every point up to its match, token-granular; the others resume at
points on those paths. What a group keeps is its business: the window group keeps tails of W
tokens at commit points, the state group snapshots of its slots at points of the tree's paths
(`radixkv.cache.state`), a latent group is the tree's kind with another tensor layout (the
engine's; the cache sees blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from radixkv.cache.moves import Move

if TYPE_CHECKING:
    from radixkv.cache.events import EventRecorder
    from radixkv.cache.keys import BlockHasher, KeyChain, PromptKeys
    from radixkv.cache.tiers import DiskIndex, LowerTiers
    from radixkv.cache.tokens import PackedTokens


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A group of layers as the cache sees it: `kind` names its class in the registry
    (`radixkv.cache.kinds.GROUP_KINDS`). A kind with parameters has a spec of its own (the
    window group's carries its window)."""

    kind: ClassVar[str] = "full"


@dataclass(frozen=True, slots=True)
class Probe:
    """What the tree's group read of a prompt, for the other groups to find their resume
    points: valid until the cache next changes."""

    tokens: bytes  # the prompt, packed
    namespace: str | None
    num_matched: int  # the tree's match (every tier): no group resumes past it
    keys: PromptKeys | None  # the prompt's block keys (None: the tree keeps none)


class GroupHit(Protocol):
    """Where one group can resume a prompt (`CacheGroup.find`): at `end` tokens, by a plan of
    the group's own (the window group's: a kept tail, or blocks to load from its tiers)."""

    @property
    def end(self) -> int: ...


class GroupTable(Protocol):
    """A request's table in one group: `blocks[i]` is the block of index i (None where the
    group let it go), `copy` the (source, target, slots) copy-on-write its admission planned."""

    @property
    def blocks(self) -> tuple[int | None, ...]: ...

    @property
    def copy(self) -> tuple[int, int, int] | None: ...


class CacheGroup(Protocol):
    """The protocol every group but the tree's speaks (the tree's group finds the prompt
    instead of `find` / `fits` / `admit`: `radixkv.cache.grouped`). Its tables are its own:
    callers hand back what it issued. Trusted callers: preconditions are asserts."""

    name: str  # the kind's display name
    block_size: int
    num_blocks: int
    tiers: LowerTiers | None

    def find(self, probe: Probe, upto: int) -> GroupHit: ...

    def fits(self, probe: Probe, hit: GroupHit, num_tokens: int) -> bool: ...

    def admit(self, probe: Probe, hit: GroupHit, num_tokens: int) -> GroupTable | None: ...

    def chunk_end(self, table: Any, start: int, end: int) -> int: ...

    def extend(self, table: Any, num_tokens: int) -> bool: ...

    def slide(self, table: Any, num_written: int) -> None: ...

    def commit(self, table: Any, tokens: PackedTokens, *, prompt_end: bool = False) -> None: ...

    def close(self, table: Any) -> None: ...

    def row_blocks(self, table: Any, num_blocks: int) -> tuple[int, ...]: ...

    def take_copies(self) -> list[tuple[int, int, int]]: ...

    def step_failed(self) -> None: ...

    def take_moves(self) -> list[Move]: ...

    def forget(self, host_blocks: Sequence[int]) -> None: ...

    def persist(self) -> None: ...

    def clear(self) -> None: ...

    def stats(self) -> Any: ...

    def check_table(self, table: Any, num_written: int, num_tokens: int, chunk: int) -> None: ...

    def check_integrity(self) -> None: ...


@dataclass(frozen=True, slots=True)
class GroupSetup:
    """What a kind's `build` is given besides its spec: its place, its pool and its tiers, the
    tree group's event queue and key chain (None for the tree's group itself, which makes
    them), which every group's events and tiers name blocks by, the tree's group itself (for a
    group that asks it what it holds) and the engine's settings (a kind with settings of its
    own reads them there; None: its defaults)."""

    index: int  # its place in the grouped cache (KV events' group_idx)
    num_blocks: int
    block_size: int
    eviction: str = "gdsf"
    kv_events: bool | BlockHasher = False
    host_blocks: int = 0  # its host tier's blocks (0: none)
    disk: DiskIndex | None = None
    write_through: bool = False
    events: EventRecorder | None = None
    keys: KeyChain | None = None
    tree: Any = None  # the tree's group (a `PrefixCache`); None for the tree's group itself
    config: Any = None  # a `PoolConfig`, or None


class PoolConfig(Protocol):
    """The settings a kind sizes its pool from (`radixkv.engine.EngineConfig` is one; a kind
    with a setting of its own reads that too)."""

    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int | None: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def chunked_prefill_size(self) -> int: ...
    @property
    def host_cache_bytes(self) -> int: ...


class GroupKind(Protocol):
    """A kind of group, as the registry holds it: its display name, how many blocks its pool
    takes, and how one is built."""

    name: str

    def plan_blocks(
        self, spec: Any, config: PoolConfig, bytes_per_block: int, budget: int | None
    ) -> int | None:
        """The pool's blocks, `bytes_per_block` each, out of a byte `budget` (None: the pools are
        counted out in blocks); None: what the budget leaves after the other pools (the tree's
        group). ValueError for settings that hold not one request's blocks."""
        ...

    def build(self, spec: Any, setup: GroupSetup) -> Any: ...
