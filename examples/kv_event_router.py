"""A cache-aware router's view of one radixkv replica, rebuilt from its KV events alone.

Runs in well under a second on any machine: no model, no torch. A router in front of several
replicas keeps, per replica, the set of full-block hashes the replica announced
(`BlockHashIndex`, the reference consumer of radixkv's events) and scores a prompt by how many of
its leading full blocks are in that set. Here one cache records its events, its owner drains them
after each request, as an engine does after each step, and the router's score of each prompt
equals what the cache itself holds of it, in full blocks.

The tests use `BlockHashIndex` as the strict reference for every stream of events radixkv makes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixkv import PrefixCache
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from radixkv.cache.keys import chain_hashes

BLOCK = 4


class BlockHashIndex:
    """What a router knows of one replica: the set of full-block hashes, from events alone.

    The full-attention group's (group 0) blocks score prompts; a hybrid model's window group
    (group 1) is kept apart in `window_hashes`: its blocks hold only the window layers' KV.
    Strict: a `BlockStored` whose parent is unknown (group 0: a window run's parent is the full
    chain's block before it, which the window group need not hold), a hash stored twice in its
    group, or a removal of an unknown hash raises ValueError, naming the hash (a router would
    re-sync; a test wants to know).
    Invariant: `parents[h]` is the parent hash of every stored full-group `h` (None for a first
    block).
    """

    def __init__(self) -> None:
        self.parents: dict[int, int | None] = {}
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.window_hashes: set[int] = set()

    @property
    def hashes(self) -> set[int]:
        return set(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.parents

    def apply(self, event: KVEvent) -> None:
        """Update the index with one event (usable directly as a subscriber callback)."""
        if isinstance(event, (BlockStored, BlockRemoved)) and event.group_idx:
            self._apply_window(event)
        elif isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            missing = [h for h in event.block_hashes if h not in self.parents]
            if missing:
                raise ValueError(f"BlockRemoved of unknown block hashes {missing}")
            for h in event.block_hashes:
                del self.parents[h]
                del self.tokens[h]
        elif isinstance(event, AllBlocksCleared):
            self.parents.clear()
            self.tokens.clear()
            self.window_hashes.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def _apply_window(self, event: BlockStored | BlockRemoved) -> None:
        hashes = set(event.block_hashes)
        if len(hashes) != len(event.block_hashes):
            raise ValueError(f"window block hashes repeat in {event.block_hashes}")
        if isinstance(event, BlockStored):
            if event.sliding_window is None:
                raise ValueError("a window group's BlockStored names no window")
            if hashes & self.window_hashes:
                raise ValueError(f"window block hashes {hashes & self.window_hashes} stored twice")
            self.window_hashes |= hashes
        else:
            if hashes - self.window_hashes:
                raise ValueError(
                    f"BlockRemoved of unknown window blocks {hashes - self.window_hashes}"
                )
            self.window_hashes -= hashes

    def _store(self, event: BlockStored) -> None:
        B = event.block_size
        if len(event.token_ids) != B * len(event.block_hashes):
            raise ValueError(
                f"BlockStored carries {len(event.token_ids)} token ids for"
                f" {len(event.block_hashes)} blocks of {B}"
            )
        parent = event.parent_block_hash
        if parent is not None and parent not in self.parents:
            raise ValueError(f"BlockStored under unknown parent hash {parent}")
        for i, h in enumerate(event.block_hashes):
            if h in self.parents:
                raise ValueError(f"block hash {h} stored twice")
            self.parents[h] = parent
            self.tokens[h] = event.token_ids[i * B : (i + 1) * B]
            parent = h

    def longest_prefix_blocks(self, token_ids: Iterable[int], block_size: int) -> int:
        """Full blocks of `token_ids` (default namespace) the replica holds: what a router scores.
        Mutates nothing."""
        ids = np.asarray(list(token_ids), dtype="<u4")
        tokens_le = ids[: len(ids) // block_size * block_size].tobytes()
        n = 0
        for h in chain_hashes(None, tokens_le, block_size):
            if h not in self.parents:
                break
            n += 1
        return n


def serve(cache: PrefixCache, prompt: list[int], reply: list[int]) -> None:
    """One request's life through the cache's contract (the model's work left out)."""
    table = cache.admit(prompt, max_hit=len(prompt) - 1)
    if table is None:
        raise RuntimeError("cache too small for this request")
    cache.grow(table, -(-(len(prompt) + len(reply)) // BLOCK) - len(table.blocks))
    cache.commit(table, prompt + reply)
    cache.close(table)


def main() -> None:
    cache = PrefixCache(num_blocks=12, block_size=BLOCK, kv_events=True)
    router = BlockHashIndex()
    system = [1, 2, 3, 4, 5, 6]
    for k in range(6):  # the pool is small: later requests evict earlier ones
        serve(cache, [*system, *range(100 * k, 100 * k + 5)], [7, 8, 9])
        for event in cache.take_events():
            router.apply(event)
    for k in range(6):
        prompt = [*system, *range(100 * k, 100 * k + 5), 7, 8, 9]
        held = cache.match(prompt).num_cached_tokens // BLOCK
        score = router.longest_prefix_blocks(prompt, BLOCK)
        print(f"request {k}: the router scores {score} full blocks, the cache holds {held}")
        assert score == held
    print(f"{len(router)} block hashes known, {cache.stats().num_evicted_blocks} blocks evicted")


if __name__ == "__main__":
    main()
