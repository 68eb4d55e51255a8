"""Using radixkv's PrefixCache on its own, as the block manager of another engine.

Runs in well under a second on any machine: no model, no torch. The story: two requests share a
37-token system prompt; with 16-token blocks the second one gets all 37 tokens from the cache (a
flat block-hash map would give it 32), copies the 5 valid slots of the partial block into a fresh
block, and computes only its own suffix.
"""

from __future__ import annotations

import math

from radixkv import PrefixCache

BLOCK = 16


def blocks_for(num_tokens: int) -> int:
    return math.ceil(num_tokens / BLOCK)


def serve(cache: PrefixCache, prompt: list[int], reply: list[int]) -> None:
    """One request's life: match, lock, copy-on-write, allocate, (compute), insert, release."""
    # NOTE: the last prompt token is always computed, so there are logits to sample from.
    match = cache.match(prompt, max_tokens=len(prompt) - 1)  # read-only: safe for scoring
    handle = cache.acquire(match)  # lock the path before allocating (allocation may evict)
    table = list(match.block_ids)
    copies = []
    if match.last_block_partial:
        # Never write into a shared block: copy its valid slots into a private one.
        (fresh,) = cache.allocate(1) or []
        copies.append((table[-1], fresh, match.num_partial_slots))
        table[-1] = fresh
    written = prompt + reply[:-1]  # the last sampled token has no KV yet
    new = cache.allocate(blocks_for(len(written)) - len(table))
    if new is None:
        raise RuntimeError("cache too small for this request")
    table += new
    print(
        f"prompt {len(prompt):3d} tokens: {match.num_cached_tokens:3d} cached,"
        f" {len(prompt) - match.num_cached_tokens:3d} computed, copy-on-write {copies or 'none'}"
    )
    # ... a model would now write KV for positions [num_cached_tokens, len(written)) into `table`
    result = cache.insert(written, table, handle=handle)  # adopt blocks, free duplicates
    cache.release(result.handle)
    cache.free(result.owned_block_ids)  # whatever the tree did not adopt
    cache.check_integrity()


def main() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BLOCK)
    system = list(range(1000, 1037))  # 37 shared tokens: two full blocks and 5 slots of a third
    serve(cache, system + [1, 2, 3, 4], [7, 8, 9])
    serve(cache, system + [5, 6, 7, 8, 9, 10], [11, 12])
    serve(cache, system + [1, 2, 3, 4, 7, 8, 42], [43])  # extends the first conversation
    stats = cache.stats()
    print(
        f"hit rate {stats.hit_rate:.0%}, {stats.num_nodes} tree nodes,"
        f" blocks: {stats.num_free_blocks} free, {stats.num_evictable_blocks} cached,"
        f" {stats.num_in_use_blocks} in use"
    )
    freed = cache.evict(4)
    print(f"evicted least-recently-used blocks {freed}")
    cache.check_integrity()


if __name__ == "__main__":
    main()
