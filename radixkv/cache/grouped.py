"""GroupedCache: the prefix cache of a model whose layers fall into groups, one list of them.

    groups[0]     the tree's group (`PrefixCache`): the layers that keep every token's KV, the
                  radix tree, GDSF, the KV events' queue and the block keys every tier reads
    groups[1:]    every other group (`radixkv.cache.group.CacheGroup`), resuming at points on
                  the tree's paths (the window group: where it kept the last W tokens' KV)

vLLM's hybrid manager has the same shape (a tuple of groups, a coordinator that intersects their
hits); SGLang 0.5.23 registers components in one tree. A request holds one `GroupedTable`: a
table per group, in group order, and the hit they share. Its life:

    match(tokens, max_tokens)        read-only: the deepest point every group can resume from
                                     (the tree's match, cut back by each other group in turn
                                     until none cuts it further)
    t = admit(tokens, max_hit, ...)  None: does not fit now, nothing changed; else a table per
                                     group resuming at that point: the tree's covers every token
                                     (admission is a reservation), the others at least the hit
                                     and `first_chunk` tokens past it
    chunk_end(t, start, end)         where the row from `start` must stop (at most `end`): the
                                     nearest point some group needs a chunk to end at
    extend(t, n)                     every group's blocks up to n tokens (the next chunk)
    slide(t, num_written)            every group lets go of what no later query reads
    commit(t, tokens, prompt_end=)   tokens [0, n) are written: the tree inserts them, the
                                     others keep what a later request resumes from
    close(t)
    row_tables(t, k)                 one block table per group for a step's row
    take_copies()                    one list of planned copies per group (besides admissions')
    step_failed()                    the step that carried the copies last taken failed
    take_moves()                     one list of planned tier moves per group
    reset(), persist(), stats(), group_stats(), check_integrity()

A model without window layers has one group: then `match` and `admit` are the tree's own, and
the other calls loop over a list of one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from radixkv.cache.events import KVEvent
from radixkv.cache.group import CacheGroup, GroupHit, Probe
from radixkv.cache.moves import Move
from radixkv.cache.prefix_cache import CacheStats, MatchResult, NodeView, PrefixCache
from radixkv.cache.summary import TreeSummary
from radixkv.cache.tokens import PackedTokens, check_size


@dataclass(slots=True, eq=False)
class GroupedTable:
    """One request's tables, one per group in group order (each issued by its group), and the
    hit they resume at."""

    tables: tuple[Any, ...]
    num_cached_tokens: int  # the hit: every group holds the KV of tokens [0, hit)
    locked: bool  # admitted with the cache: the tree's table locks its hit's path
    # What the tree matched at admission (its lower tiers' continuation included): more than
    # the hit when another group's KV ended earlier (a hit resumes only where every group's does)
    num_matched_tokens: int = 0


class GroupedCache:
    """A tree's group and the groups beside it (see the module docstring).

    Invariants (recomputed by `check_integrity`): every group's own; each open table holds one
    open table of every group, and no group has an open table that none holds.
    """

    def __init__(self, groups: Sequence[Any]) -> None:
        assert groups and isinstance(groups[0], PrefixCache), "the tree's group comes first"
        self.groups: tuple[Any, ...] = tuple(groups)
        self.tree: PrefixCache = groups[0]
        self._others: tuple[CacheGroup, ...] = self.groups[1:]
        self.block_size = self.tree.block_size
        self.num_blocks = self.tree.num_blocks  # the tree's pool: what a request can fill
        self._open: set[GroupedTable] = set()
        self.num_cut_hit_tokens = 0  # total since start: matched by the tree past the hits

    # ----------------------------------------------------------------- the door
    def match(
        self, tokens: Sequence[int], *, max_tokens: int | None = None, namespace: str | None = None
    ) -> MatchResult:
        """How much of `tokens` a request could resume after now, at most `max_tokens`: the
        tree's `MatchResult` cut back to the deepest point every group serves. Mutates nothing;
        raises like `PrefixCache.match`."""
        if not self._others:
            return self.tree.match(tokens, max_tokens=max_tokens, namespace=namespace)
        packed = _packed(tokens)
        m, probe = self._probe(packed, max_tokens, namespace)
        hit, _ = self._resume(probe)
        B, lower = self.block_size, m.num_host_blocks or m.num_disk_blocks
        tree = len(m.block_ids) * B if lower else m.num_cached_tokens
        if hit <= tree:
            return MatchResult(len(packed), hit, m.block_ids[: -(-hit // B)], hit % B, namespace)
        past = hit // B - len(m.block_ids)  # whole blocks in the tree group's lower tiers
        host = min(past, m.num_host_blocks)
        return MatchResult(len(packed), hit, m.block_ids, 0, namespace, host, past - host)

    def admit(
        self,
        tokens: Sequence[int],
        *,
        max_hit: int | None,
        namespace: str | None = None,
        first_chunk: int | None = None,
    ) -> GroupedTable | None:
        """Tables for `tokens` resuming at the deepest point every group serves, at most
        `max_hit` tokens (None: no match and no lock, as `PrefixCache.admit`); the tree's
        covers every token, the others' the hit and at most `first_chunk` tokens past it (None:
        every token). None, nothing changed, if the blocks are not there. Raises like
        `PrefixCache.admit`."""
        packed = _packed(tokens)
        locked = max_hit is not None
        if not self._others:
            tree = self.tree.admit(packed, max_hit=max_hit, namespace=namespace)
            if tree is None:
                return None
            hit = tree.num_cached_tokens
            return self._opened((tree,), hit, locked, hit)
        if max_hit is None:
            probe = Probe(packed.tobytes(), namespace, 0, None)
        else:
            _, probe = self._probe(packed, check_size(max_hit, "max_hit", low=0), namespace)
        hit, found = self._resume(probe)
        n = len(packed) if first_chunk is None else min(len(packed), hit + first_chunk)
        if not all(g.fits(probe, f, n) for g, f in zip(self._others, found, strict=True)):
            return None
        tree = self.tree.admit(
            packed, max_hit=hit if locked else None, namespace=namespace, keys=probe.keys
        )
        if tree is None:
            return None
        assert tree.num_cached_tokens == hit, "the tree serves every point up to its match"
        tables = [tree]
        try:
            for group, f in zip(self._others, found, strict=True):
                table = group.admit(probe, f, n)
                assert table is not None, "fits() said it would"
                tables.append(table)
        except BaseException:  # a fault (e.g. an interrupt) leaks no block or lock
            for group, table in zip(self.groups, tables, strict=False):
                group.close(table)
            raise
        self.num_cut_hit_tokens += probe.num_matched - hit
        return self._opened(tuple(tables), hit, locked, probe.num_matched)

    # ------------------------------------------------------------- block tables
    def chunk_end(self, table: GroupedTable, start: int, end: int) -> int:
        """Where a row of the table's request computing from `start` must stop, at most `end`:
        the nearest point past `start` some group needs a chunk to end at (the state group's
        snapshot points), else `end`. Read-only."""
        for group, t in zip(self._others, table.tables[1:], strict=True):
            end = group.chunk_end(t, start, end)
        return end

    def extend(self, table: GroupedTable, num_tokens: int) -> bool:
        """Every group's blocks for every position up to `num_tokens`; False if some group's
        are not there (what the groups before it got stays with the table)."""
        for group, t in zip(self.groups, table.tables, strict=True):
            if not group.extend(t, num_tokens):
                return False
        return True

    def slide(self, table: GroupedTable, num_written: int) -> None:
        """Tokens [0, num_written) are written: each group lets go of what no query at
        `num_written` or later reads (and keeps what it resumes from first). The tree's group
        lets go of nothing (every later query reads every earlier token): it is not asked."""
        for group, t in zip(self._others, table.tables[1:], strict=True):
            group.slide(t, num_written)

    def commit(
        self, table: GroupedTable, tokens: Sequence[int], *, prompt_end: bool = False
    ) -> None:
        """Tokens [0, n) of `tokens` are written in every group: the tree inserts them, the
        others keep what a later request resumes from. `prompt_end`: they are the request's
        whole prompt, and it goes on writing (a repeat of the prompt resumes one token short of
        its end: its last token is always computed)."""
        packed = _packed(tokens)
        for group, t in zip(self.groups, table.tables, strict=True):
            group.commit(t, packed, prompt_end=prompt_end)

    def close(self, table: GroupedTable) -> None:
        """Every group's table closed: locks released, blocks given back. After a fault half
        way, closing again closes the rest."""
        assert table in self._open, "a table is closed once, by the cache that issued it"
        for group, t in zip(self.groups, table.tables, strict=True):
            if group.is_open(t):
                group.close(t)
        self._open.remove(table)

    def row_tables(self, table: GroupedTable, num_blocks: int) -> tuple[tuple[int, ...], ...]:
        """The block ids of entries [0, num_blocks) of each group's table, for a step's row."""
        if not self._others:  # every row of every step: the tree's tuple itself, no copy
            return (table.tables[0].blocks[:num_blocks],)
        return tuple(
            group.row_blocks(t, num_blocks)
            for group, t in zip(self.groups, table.tables, strict=True)
        )

    @property
    def open_tables(self) -> frozenset[GroupedTable]:
        return frozenset(self._open)

    # ------------------------------------------------------------------ plans
    def take_copies(self) -> tuple[list[tuple[int, int, int]], ...]:
        """Each group's copies planned since the last call besides its admissions' (the state
        group's snapshots: (source, target, slots) as a copy-on-write names them), in order;
        they run before the step's admission copies."""
        return tuple(group.take_copies() for group in self.groups)

    def step_failed(self) -> None:
        """The step whose plan carried the copies last taken failed before its forward, maybe
        before they ran: what they were to fill is dropped."""
        for group in self.groups:
            group.step_failed()

    def take_moves(self) -> tuple[list[Move], ...]:
        """Each group's tier moves planned since the last call, in order (`radixkv.cache.moves`):
        each runs over its own group's blocks."""
        return tuple(group.take_moves() for group in self.groups)

    def forget(self, group: int, host_blocks: Sequence[int]) -> None:
        """A move of group `group` failed and left these host blocks holding garbage."""
        self.groups[group].forget(host_blocks)

    def persist(self) -> None:
        """Every group plans copies of what it keeps down to its disk tier (nothing to do
        without one): what a process started later over the same directory finds."""
        for group in self.groups:
            group.persist()

    def reset(self) -> bool:
        """Drop everything every group keeps, lower tiers included (`PrefixCache.reset`);
        False, changing nothing, while a table holds a lock."""
        if not self.tree.reset():
            return False
        for group in self._others:
            group.clear()
        return True

    # ------------------------------------------------------------------ reports
    def stats(self) -> CacheStats:
        """The tree group's figures: its pool and tree, and every hit (a hit is counted once,
        where the tree serves it). Each group's own: `group_stats()`."""
        return self.tree.stats()

    def group_stats(self) -> tuple[Any, ...]:
        return tuple(group.stats() for group in self.groups)

    def take_events(self) -> list[KVEvent]:
        """Every group's KV events since the last call, in one queue (each names its group)."""
        return self.tree.take_events()

    def nodes(self) -> Iterator[NodeView]:
        return self.tree.nodes()

    def summary(self, **kwargs: Any) -> TreeSummary:
        return self.tree.summary(**kwargs)

    def snapshot_nodes(self, namespace: str | None = None) -> dict[int, int]:
        """Tree node id -> the recurrent-state snapshots on the device ending in it (a hybrid
        model's state group; none for other models), for the views that mark them."""
        prefixes = [
            qb
            for group in self._others
            for qb in getattr(group, "snapshot_prefixes", lambda _: [])(namespace)
        ]
        return dict(self.tree.nodes_ending(prefixes, namespace)) if prefixes else {}

    def check_table(
        self, table: GroupedTable, num_written: int, num_tokens: int, chunk: int
    ) -> None:
        """Each group's rule for a running request's table: it covers the `num_written` tokens
        written of `num_tokens`, and holds no more than the group allows it for rows of at most
        `chunk` tokens. Raises AssertionError."""
        assert table in self._open, "a running request's table is open"
        for group, t in zip(self.groups, table.tables, strict=True):
            group.check_table(t, num_written, num_tokens, chunk)

    def check_integrity(self) -> None:
        for group in self.groups:
            group.check_integrity()
        for g, group in enumerate(self.groups):
            parts = [table.tables[g] for table in self._open]
            if group.num_open_tables != len(parts) or not all(map(group.is_open, parts)):
                raise AssertionError(f"group {g}'s open tables are not those of the open tables")

    # ---------------------------------------------------------------- internals
    def _probe(
        self, packed: PackedTokens, max_tokens: int | None, namespace: str | None
    ) -> tuple[MatchResult, Probe]:
        m, keys = self.tree.lookup(packed, max_tokens=max_tokens, namespace=namespace)
        return m, Probe(packed.tobytes(), namespace, m.num_cached_tokens, keys)

    def _resume(self, probe: Probe) -> tuple[int, list[GroupHit]]:
        """The deepest point <= the tree's match every other group serves, and each one's hit
        there: each cuts the point back in turn until a pass cuts nothing (one pass with one
        group: the tree serves every point up to its match)."""
        others, hit = self._others, probe.num_matched
        found: list[GroupHit] = []
        while True:
            start, found = hit, []
            for group in others:
                found.append(group.find(probe, hit))
                hit = found[-1].end
            if hit == start or len(others) == 1:
                return hit, found

    def _opened(
        self, tables: tuple[Any, ...], hit: int, locked: bool, matched: int
    ) -> GroupedTable:
        table = GroupedTable(tables, hit, locked, matched)
        self._open.add(table)
        return table


def _packed(tokens: Sequence[int]) -> PackedTokens:
    """Tokens validated once for every group (raises like `PrefixCache.match`)."""
    return tokens if type(tokens) is PackedTokens else PackedTokens(tokens)
