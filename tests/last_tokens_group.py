"""A test-only kind of KV cache group: each request keeps the blocks of its last N tokens and
nothing outlives it (no tail, no lower tier), so it resumes a prompt only at its start.

It exists to show that a new kind plugs in by a module of its own and a registry entry
(`radixkv.cache.kinds.GROUP_KINDS`) alone: registered under the window layers' kind, it caches
their KV through the scheduler, the runner and the tier movers with no file above the cache
changed (`tests/engine/test_new_group_kind.py`). Written against the protocol of
`radixkv.cache.group`, nothing else of the cache but its pool and the window spec.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.cache.group import GroupSetup, PoolConfig, Probe
from radixkv.cache.moves import Move
from radixkv.cache.pool import BlockPool
from radixkv.cache.tokens import PackedTokens
from radixkv.cache.window import WindowSpec


@dataclass(frozen=True, slots=True)
class StartHit:
    end: int = 0  # a prompt resumes at its start, nowhere else


@dataclass(slots=True, eq=False)
class LastTokensTable:
    blocks: tuple[int | None, ...] = ()
    copy: tuple[int, int, int] | None = field(default=None, repr=False)  # never: no hit


@dataclass(frozen=True, slots=True)
class LastTokensStats:
    num_blocks: int
    num_free_blocks: int
    num_open_tables: int
    num_host_cached_blocks: int = 0  # no lower tiers


class LastTokensGroup:
    """`num_blocks` blocks of `block_size` tokens; a request's table lists the blocks of the
    last `window` tokens before the query at its written end (the window its layers read).

    Invariants (`check_integrity`): every block's ref count is the open tables listing it; a
    table's listed blocks are one run that reaches its last entry."""

    name = "last-tokens"

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size, self.num_blocks, self.window = block_size, num_blocks, window
        self.tiers = None
        self._open: set[LastTokensTable] = set()

    # the group protocol
    def find(self, probe: Probe, upto: int) -> StartHit:
        return StartHit()

    def fits(self, probe: Probe, hit: StartHit, num_tokens: int) -> bool:
        return -(-num_tokens // self.block_size) <= self.pool.num_free

    def admit(self, probe: Probe, hit: StartHit, num_tokens: int) -> LastTokensTable | None:
        table = LastTokensTable()
        self._open.add(table)
        if not self.extend(table, num_tokens):
            self.close(table)
            return None
        return table

    def chunk_end(self, table: LastTokensTable, start: int, end: int) -> int:
        return end

    def extend(self, table: LastTokensTable, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(table.blocks)
        if need <= 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        table.blocks += tuple(new)
        return True

    def slide(self, table: LastTokensTable, num_written: int) -> None:
        live = min(self._first_read(num_written), len(table.blocks))
        dead = [b for b in table.blocks[:live] if b is not None]
        if dead:
            self.pool.release(dead)
            table.blocks = (None,) * live + table.blocks[live:]

    def commit(self, table: Any, tokens: PackedTokens, *, prompt_end: bool = False) -> None:
        """Nothing to keep: no later request resumes here."""

    def close(self, table: LastTokensTable) -> None:
        self._open.remove(table)
        self.pool.release([b for b in table.blocks if b is not None])
        table.blocks = ()

    def row_blocks(self, table: LastTokensTable, num_blocks: int) -> tuple[int, ...]:
        return tuple(b or 0 for b in table.blocks[:num_blocks])

    def take_moves(self) -> list[Move]:
        return []

    def take_copies(self) -> list[tuple[int, int, int]]:
        return []

    def step_failed(self) -> None:
        """No copies: nothing to drop."""

    def forget(self, host_blocks: Sequence[int]) -> None:
        raise AssertionError("no lower tiers: no move of this group can fail")

    def persist(self) -> None:
        """Nothing kept, nothing to write."""

    def clear(self) -> None:
        """Nothing kept."""

    def stats(self) -> LastTokensStats:
        return LastTokensStats(self.num_blocks, self.pool.num_free, len(self._open))

    @property
    def num_open_tables(self) -> int:
        return len(self._open)

    def is_open(self, table: LastTokensTable) -> bool:
        return table in self._open

    def check_table(self, table: LastTokensTable, num_written: int, num_tokens: int, chunk: int):
        assert len(table.blocks) >= -(-num_written // self.block_size), (table, num_written)
        assert sum(b is not None for b in table.blocks) <= self.blocks_per_request(chunk), table

    def check_integrity(self) -> None:
        owners: Counter[int] = Counter()
        for table in self._open:
            listed = [b for b in table.blocks if b is not None]
            assert None not in table.blocks[len(table.blocks) - len(listed) :], table
            owners.update(listed)
        self.pool.check_integrity(dict(owners))

    def blocks_per_request(self, chunk: int) -> int:
        """What one running request lists at most: its window and its next chunk, one more
        where they straddle a block, one for the token the scheduler keeps back per slide."""
        return -(-(self.window + chunk) // self.block_size) + 2

    def _first_read(self, num_written: int) -> int:
        return max(0, num_written - self.window + 1) // self.block_size


class LastTokensKind:
    """Its registry entry: it takes over the window layers (`WindowSpec`)."""

    name = LastTokensGroup.name

    def plan_blocks(
        self, spec: WindowSpec, config: PoolConfig, bytes_per_block: int, budget: int | None
    ) -> int:
        chunk = min(config.chunked_prefill_size, config.max_num_batched_tokens)
        per_request = -(-(spec.window + chunk) // config.block_size) + 2
        return config.max_num_seqs * per_request

    def build(self, spec: WindowSpec, setup: GroupSetup) -> LastTokensGroup:
        return LastTokensGroup(setup.num_blocks, setup.block_size, spec.window)
