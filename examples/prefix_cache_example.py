"""Using radixkv's PrefixCache on its own, as the block manager of another engine.

Runs in well under a second on any machine: no model, no torch. The story: two requests share a
37-token system prompt; with 16-token blocks the second one gets all 37 tokens from the cache (a
flat block-hash map would give it 32), copies the 5 valid slots of the partial block into a fresh
block, and computes only its own suffix. Each request lives in one `BlockTable`: admit, grow,
commit, close.
"""

from __future__ import annotations

import math

from radixkv import PrefixCache

BLOCK = 16


def serve(cache: PrefixCache, prompt: list[int], reply: list[int]) -> None:
    """One request's life: admit (match, lock, copy-on-write, allocate), grow, commit, close."""
    # NOTE: the last prompt token is always computed, so there are logits to sample from.
    table = cache.admit(prompt, max_hit=len(prompt) - 1)
    if table is None:
        raise RuntimeError("cache too small for this request")  # or wait for others to finish
    copies = [table.copy] if table.copy else []  # never write into a shared block: copy first
    print(
        f"prompt {len(prompt):3d} tokens: {table.num_cached_tokens:3d} cached,"
        f" {len(prompt) - table.num_cached_tokens:3d} computed, copy-on-write {copies or 'none'}"
    )
    # ... a model would now copy, then write KV for the prompt from num_cached_tokens on into
    # table.blocks, and decode the reply, growing the table as it goes:
    written = prompt + reply[:-1]  # the last sampled token has no KV yet
    if not cache.grow(table, math.ceil(len(written) / BLOCK) - len(table.blocks)):
        raise RuntimeError("cache too small for this reply")  # or preempt
    cache.commit(table, written)  # the tree adopts the blocks, frees duplicates
    cache.close(table)  # unlock, free whatever the tree did not adopt
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
    print(f"evicted blocks {freed} (GDSF: fewest hit tokens lost per block, aged by recency)")
    cache.check_integrity()


if __name__ == "__main__":
    main()
