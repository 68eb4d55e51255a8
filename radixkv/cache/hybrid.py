"""HybridCache: the prefix cache of a model whose layers are full causal or windowed (window W).

Two block groups, each with its own pool and a table per request (vLLM's hybrid manager and
SGLang's full + SWA pools have the same shape):

    full group     `PrefixCache`: the full layers' KV of every token, the radix tree, GDSF
    window group   `WindowGroup`: the window layers' KV of the last W tokens only (window.py)

A request's life, as `PrefixCache`'s with a window table beside the block table:

    match(tokens, max_tokens)          the full match, cut back to the deepest point that has
                                       the window KV of the W tokens before it (a tail on the
                                       device, or at a block boundary in the lower tiers)
    t = admit(tokens, max_hit, ...)    None: does not fit now, nothing changed; `t.full` covers
                                       every token, `t.window` the hit and at most
                                       `window_chunk` tokens past it
    extend(t, num_tokens)              window blocks up to `num_tokens` (the next chunk)
    slide(t, num_written)              window blocks no later query reads go back to the pool;
                                       the window KV before the point where the request's
                                       tokens left the full tree's path is kept first
    commit(t, tokens)                  the full group inserts, the window group keeps a tail
    keep_tail(t, tokens)               one more tail, at a point short of the last commit
    close(t)
    reset()                            both groups emptied, tails and lower-tier entries too

KV events (`kv_events`): one queue, the full group's, drained by `full.take_events()`; the full
group announces as a `PrefixCache` does (group 0), the window group the blocks its tails keep
(group 1, `radixkv.cache.window`).

Lower tiers (`host_blocks`, `disk` for the full group; `window_host_blocks`, `window_disk` for
the window group, both or neither): the window KV a hit resumes from follows its prefix down.
The window group's blocks are named by the full chain's keys (a window layer's KV at a position
depends on the prefix up to it, as a full layer's does), so an evicted tail's full blocks are
demoted under those keys to a host pool of their own (then disk; with `write_through`, copied
there when the tail is kept, as the full group's committed blocks are), and a lookup past the
device's tails takes the deepest block boundary e where the full layers' blocks up to e are
cached in some tier and the window blocks first_live_index(e) .. e // B - 1 are in the window
group's lower tiers (`WindowGroup.lower_hit`). The prompt's keys are hashed once per lookup:
the full group's (`PrefixCache.lookup`) hands its `PromptKeys` to the window group's and to its
own admission, which read them instead of hashing again. The moves of each group are drained apart
(`take_moves`, `take_window_moves`): each runs over its own tensors.

A model without window layers uses `PrefixCache` alone: none of this runs for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from radixkv.cache.keys import BlockHasher
from radixkv.cache.moves import Move
from radixkv.cache.prefix_cache import BlockTable, CacheStats, MatchResult, PrefixCache
from radixkv.cache.tiers import DiskIndex, LowerTiers
from radixkv.cache.tokens import PackedTokens, check_size
from radixkv.cache.window import LowerHit, WindowGroup, WindowStats, WindowTable


@dataclass(slots=True, eq=False)
class HybridTable:
    """One request's tables: the full layers' and the window layers' (same block indices)."""

    full: BlockTable
    window: WindowTable
    tokens: bytes = field(repr=False)  # packed, as admitted
    # Where the request's tokens leave the full tree's cached path, past the hit: a point a
    # later request can resume from (the next question about the same document), whose window
    # KV is kept once written (`HybridCache.slide`). None: none, or kept already.
    branch: int | None = None
    # What the full tree matched at admission (with lower tiers' continuation): more than the
    # hit when the window KV ended earlier (a hit resumes only where the window layers' is).
    num_matched_tokens: int = 0

    # What a scheduler reads of a table is the full half's (its window half travels apart).
    @property
    def num_cached_tokens(self) -> int:
        return self.full.num_cached_tokens

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.full.blocks

    @property
    def copy(self) -> tuple[int, int, int] | None:
        return self.full.copy

    @property
    def locked(self) -> bool:
        return self.full.locked

    @property
    def private(self) -> set[int]:
        return self.full.private


class HybridCache:
    """A `PrefixCache` of `num_blocks` full-layer blocks and a `WindowGroup` of
    `num_window_blocks` window-layer blocks of window `window`, one block size.

    Invariants (recomputed by `check_integrity`): both groups' own (a table's two halves are
    counted there, each by its group) and the window group's lower tiers'.
    """

    def __init__(
        self,
        num_blocks: int,
        num_window_blocks: int,
        block_size: int,
        window: int,
        *,
        eviction: str = "gdsf",
        kv_events: bool | BlockHasher = False,
        host_blocks: int = 0,
        disk: DiskIndex | None = None,
        write_through: bool = False,
        window_host_blocks: int = 0,
        window_disk: DiskIndex | None = None,
    ) -> None:
        """`kv_events`, `host_blocks`, `disk`: as `PrefixCache`'s (the full group's); both
        groups record into the full group's queue. `window_host_blocks` / `window_disk`: the
        window group's lower tiers, which go with the full group's. `write_through`: both
        groups copy what they keep to their host tier at once (the full group its committed
        blocks, the window group its tails' full blocks), not when the device evicts it."""
        if bool(host_blocks) != bool(window_host_blocks) or (disk is None) != (window_disk is None):
            raise ValueError("the window group has lower tiers exactly when the full group has")
        self.full = PrefixCache(
            num_blocks,
            block_size,
            eviction=eviction,
            kv_events=kv_events,
            host_blocks=host_blocks,
            disk=disk,
            write_through=write_through,
        )
        self._num_cut_tokens = 0  # matched by the full tree past the hits (`stats`)
        events, keys = self.full.event_recorder, self.full.key_chain
        tiers = None
        if window_host_blocks:
            tiers = LowerTiers(window_host_blocks, block_size, window_disk, events, window=window)
        self.window = WindowGroup(
            num_window_blocks,
            block_size,
            window,
            events=events,
            keys=keys,
            tiers=tiers,
            write_through=write_through,
        )
        self.block_size = self.full.block_size
        self._open: set[HybridTable] = set()

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    def match(
        self, tokens: Sequence[int], *, max_tokens: int | None = None, namespace: str | None = None
    ) -> MatchResult:
        """What a request can resume after: the full match, cut back to the deepest point whose
        window KV is kept. Mutates nothing; raises like `PrefixCache.match`."""
        packed = _packed(tokens)
        qb = packed.tobytes()
        m, keys = self.full.lookup(packed, max_tokens=max_tokens, namespace=namespace)
        hit = self.window.hit(qb, m.num_cached_tokens, namespace)
        lower = self.window.lower_hit(keys, m.num_cached_tokens, hit)
        B = self.block_size
        if lower is not None:
            hit = lower.end
        tree = (
            len(m.block_ids) * B if m.num_host_blocks or m.num_disk_blocks else m.num_cached_tokens
        )
        if hit <= tree:
            return MatchResult(len(packed), hit, m.block_ids[: -(-hit // B)], hit % B, namespace)
        past = hit // B - len(m.block_ids)  # whole blocks in the full group's lower tiers
        host = min(past, m.num_host_blocks)
        return MatchResult(len(packed), hit, m.block_ids, 0, namespace, host, past - host)

    def admit(
        self,
        tokens: Sequence[int],
        *,
        max_hit: int | None,
        namespace: str | None = None,
        window_chunk: int | None = None,
    ) -> HybridTable | None:
        """Tables for `tokens`: the hit (at most `max_hit` tokens, at a point with window KV;
        None: no match and no lock, as `PrefixCache.admit`), full blocks for every token, window
        blocks for the hit and at most `window_chunk` tokens past it (the first prefill chunk;
        None: every token). None, nothing changed, if the blocks are not there."""
        packed = _packed(tokens)
        qb = packed.tobytes()
        hit, branch, lower, keys = 0, 0, None, None
        if max_hit is not None:
            max_hit = check_size(max_hit, "max_hit", low=0)
            m, keys = self.full.lookup(packed, max_tokens=max_hit, namespace=namespace)
            branch = m.num_cached_tokens
            hit = self.window.hit(qb, branch, namespace)
            lower = self.window.lower_hit(keys, branch, hit)
        if lower is not None:
            hit = lower.end
        n = len(packed) if window_chunk is None else min(len(packed), hit + window_chunk)
        if not self._window_fits(qb, hit, lower, namespace, n):
            return None
        full = self.full.admit(
            packed, max_hit=None if max_hit is None else hit, namespace=namespace, keys=keys
        )
        if full is None:
            return None
        assert full.num_cached_tokens == hit, "the full path up to a window hit is cached"
        if lower is None:
            window = self.window.open(qb, hit, namespace)
        else:
            window = self.window.open_lower(lower, namespace)
        assert window is not None and self.window.extend(window, n), "checked by fits()"
        matched = max(branch, hit)
        table = HybridTable(full, window, qb, branch if branch > hit else None, matched)
        self._num_cut_tokens += matched - hit
        self._open.add(table)
        return table

    def _window_fits(
        self, qb: bytes, hit: int, lower: LowerHit | None, namespace: str | None, n: int
    ) -> bool:
        if lower is None:
            return self.window.fits(qb, hit, namespace, n)
        return self.window.fits_lower(lower, n)

    def extend(self, table: HybridTable, num_tokens: int) -> bool:
        """Full and window blocks for every token up to `num_tokens`; False if the window
        blocks are not there (full blocks got meanwhile stay with the table)."""
        B = self.block_size
        need = -(-num_tokens // B) - len(table.full.blocks)
        if need > 0 and not self.full.grow(table.full, need):
            return False
        return self.window.extend(table.window, num_tokens)

    def slide(self, table: HybridTable, num_written: int) -> None:
        """Tokens [0, num_written) are written in both groups: keep the window tail at the
        table's branch point once reached, then release what no later query reads."""
        branch = table.branch
        if branch is not None and branch <= num_written:
            self.window.commit(table.window, table.tokens, branch, branch=True)
            table.branch = None
        self.window.slide(table.window, num_written)

    def commit(self, table: HybridTable, tokens: Sequence[int]) -> None:
        """Insert `tokens` (their KV written in both groups) and keep their window tail."""
        packed = _packed(tokens)
        self.full.commit(table.full, packed)
        self.window.commit(table.window, packed.tobytes(), len(packed))

    def keep_tail(self, table: HybridTable, tokens: Sequence[int]) -> None:
        """Keep a window tail at `len(tokens)` as well (their KV written and committed, their
        window not yet slid past): a point a request can resume from that is not a commit
        point, e.g. one token short of a prompt's end, where a repeat of the prompt resumes
        (the last prompt token is always computed)."""
        packed = _packed(tokens)
        self.window.commit(table.window, packed.tobytes(), len(packed))

    def close(self, table: HybridTable) -> None:
        self._open.remove(table)
        self.full.close(table.full)
        self.window.close(table.window)

    def reset(self) -> bool:
        """`PrefixCache.reset` for both groups: every tail and lower-tier entry goes too.
        False, changing nothing, while a table holds a lock."""
        if not self.full.reset():
            return False
        self.window.clear()
        return True

    def stats(self) -> CacheStats:
        """The full group's (the window group's pool is `window.pool`)."""
        return self.full.stats()

    def window_stats(self) -> WindowStats:
        """The window group's, with the tokens its KV cut from the full group's hits."""
        return replace(self.window.stats(), num_cut_hit_tokens=self._num_cut_tokens)

    def take_moves(self) -> list[Move]:
        """The full group's tier moves (`PrefixCache.take_moves`)."""
        return self.full.take_moves()

    def take_window_moves(self) -> list[Move]:
        """The window group's tier moves since the last call, in order, over the window
        layers' blocks ([] without lower tiers)."""
        tiers = self.window.tiers
        return [] if tiers is None else tiers.take_moves()

    def forget_window_host_blocks(self, host_blocks: Sequence[int]) -> None:
        """A window move failed and left these window host blocks holding garbage."""
        if self.window.tiers is not None:
            self.window.tiers.forget(host_blocks)

    def persist(self) -> None:
        """`PrefixCache.persist` for both groups: every cached block, full and window (the
        tails' full blocks), planned down to the disk tier. Nothing to do without one."""
        tiers = self.window.tiers
        if tiers is None or tiers.disk is None:
            return
        self.full.persist()
        self.window.persist()
        tiers.write_to_disk()

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.window.check_integrity()
        if self.window.tiers is not None:
            self.window.tiers.check_integrity()


def _packed(tokens: Sequence[int]) -> PackedTokens:
    """Tokens validated once for both groups (raises like `PrefixCache.match`)."""
    return tokens if type(tokens) is PackedTokens else PackedTokens(tokens)
