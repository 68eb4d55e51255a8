"""FlatHashCache: the comparator of the cache benchmark, a flat chained-hash block map.

The prefix cache of nano-vllm's `BlockManager` and vLLM v1's `KVCacheManager`, reduced to the cache
calls and written to be as fast as that design allows in Python:

* Only FULL blocks are cached. Block i of a sequence is keyed by a 64-bit chain hash
  `h_i = xxh64(token bytes of block i, seed=h_{i-1})` (h_{-1} = 0), so a key names the whole prefix
  ending at that block. Like vLLM the tokens are not stored and a hash hit is trusted (64 bits).
* A hit is block-aligned: a match of `k` blocks serves `k * B` tokens, and at most `len - 1` tokens
  are served so the last prompt token is computed. A partial tail block is never cached.
* `hash_to_block: dict[hash, block id]`; each block has a ref count (the requests using it) and its
  hash, or None when it holds nothing reusable.
* Free blocks (ref count 0) are kept in two pools, which together are vLLM's free queue: blocks
  holding nothing reusable on a stack (taken first), cached blocks in an LRU queue (an
  `OrderedDict`: O(1) append, pop from the head and removal from the middle, the job of vLLM's
  doubly-linked `FreeKVCacheBlockQueue`; nano-vllm's `deque.remove` is O(n)). A block whose ref
  count drops to zero joins the LRU tail, still cached; allocation past the stack pops the LRU head
  and drops its hash (an eviction). A hit on a cached free block takes it back out of the queue.

Request lifecycle (what the benchmark drives):
```
m = cache.match(tokens, max_tokens=len(prompt) - 1)   # read-only; computes chain hashes
cache.acquire(m.block_ids)                            # ref +1 on hit blocks
ids = cache.allocate(n)                               # None if too few blocks are free
... compute ...
cache.cache_full_blocks(tokens, table, m.block_hashes)  # register the written full blocks
cache.release(table)                                   # ref -1, chain tail first into the LRU
```

Invariants (`check_integrity` recomputes them):
* a block is free (on the stack or in the LRU queue, not both) iff its ref count is 0; ref counts
  are never negative; a free block is in the LRU queue iff it holds a hash;
* `hash_to_block[h] == b` iff `block_hash[b] == h` (one block per hash, one hash per block).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

_xxh64 = xxhash.xxh64_intdigest


def token_bytes(tokens: np.ndarray | Sequence[int]) -> bytes:
    """Tokens as little-endian int32 bytes, the input of the chain hash."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


@dataclass(frozen=True, slots=True)
class FlatMatch:
    """Result of `FlatHashCache.match`. Valid only until the cache next mutates."""

    num_query_tokens: int
    block_ids: tuple[int, ...]  # hit blocks, all full: num_cached_tokens = len(block_ids) * B
    # Chain hashes computed by the match: those of the hit blocks, plus the first missed block's
    # when it was computed. The request keeps them so that caching its blocks later does not rehash.
    block_hashes: tuple[int, ...]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class FlatStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int  # ref count 0 (cached or not)
    num_cached_blocks: int  # blocks holding a hash
    num_in_use_blocks: int  # ref count > 0
    num_queries: int  # acquire() calls with the query size recorded by match()
    num_query_tokens: int
    num_hit_tokens: int
    num_evicted_blocks: int  # hashed blocks reallocated or evicted

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class FlatHashCache:
    """Block-granular prefix cache: chained hashes of full blocks -> block ids, LRU free queue."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive: {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_count: list[int] = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Free blocks holding no hash: a stack, taken first (block 0 on top).
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks holding a hash, least recently used first. Values unused.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._num_queries = 0
        self._num_query_tokens = 0
        self._num_hit_tokens = 0
        self._num_evicted_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return len(self._free_uncached) + len(self._free_cached) >= num_blocks

    def match(
        self, tokens: np.ndarray | Sequence[int], *, max_tokens: int | None = None
    ) -> FlatMatch:
        """Longest run of cached full blocks starting tokens[:max_tokens]. Mutates nothing."""
        n = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        nbytes = 4 * self.block_size
        buf = token_bytes(tokens[: n - n % self.block_size])
        lookup = self._hash_to_block.get
        ids: list[int] = []
        hashes: list[int] = []
        h = 0
        for start in range(0, len(buf), nbytes):
            h = _xxh64(buf[start : start + nbytes], h)
            hashes.append(h)
            block_id = lookup(h)
            if block_id is None:
                break
            ids.append(block_id)
        return FlatMatch(len(tokens), tuple(ids), tuple(hashes), len(ids) * self.block_size)

    def acquire(self, match: FlatMatch) -> None:
        """Take a reference on the hit blocks (out of the free queue if they were there)."""
        ref = self._ref_count
        free_cached = self._free_cached
        for block_id in match.block_ids:
            if ref[block_id] == 0:
                del free_cached[block_id]
            ref[block_id] += 1
        self._num_queries += 1
        self._num_query_tokens += match.num_query_tokens
        self._num_hit_tokens += match.num_cached_tokens

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Blocks with ref count 1: uncached free blocks first, then the least recently used
        cached ones, whose hashes are dropped (evicted). None, nothing changed, if too few are free.
        """
        uncached = self._free_uncached
        num_evict = num_blocks - len(uncached)
        if num_evict <= 0:
            ids = uncached[len(uncached) - num_blocks :]
            del uncached[len(uncached) - num_blocks :]
        else:
            free_cached = self._free_cached
            if num_evict > len(free_cached):
                return None
            ids = uncached[:]
            uncached.clear()
            block_hash = self._block_hash
            hash_to_block = self._hash_to_block
            for _ in range(num_evict):
                block_id = free_cached.popitem(last=False)[0]
                del hash_to_block[block_hash[block_id]]
                block_hash[block_id] = None
                ids.append(block_id)
            self._num_evicted_blocks += num_evict
        ref = self._ref_count
        for block_id in ids:
            ref[block_id] = 1
        return ids

    def cache_full_blocks(
        self,
        tokens: np.ndarray | Sequence[int],
        block_ids: Sequence[int],
        block_hashes: Sequence[int] = (),
        *,
        num_cached_blocks: int = 0,
    ) -> list[int]:
        """Register the full blocks of tokens (whose KV is in block_ids) in the hash map.

        `block_hashes` are already-known chain hashes of the first blocks (from match); the rest are
        computed. The first `num_cached_blocks` blocks are known to be registered (the hit). A block
        whose hash is already cached in another block stays unregistered (the request computed a
        duplicate; it is recycled first once released). Returns all chain hashes.
        """
        block_size = self.block_size
        num_full = len(tokens) // block_size
        hashes = list(block_hashes[:num_full])
        if len(hashes) < num_full:
            nbytes = 4 * block_size
            h = hashes[-1] if hashes else 0
            buf = token_bytes(tokens[len(hashes) * block_size : num_full * block_size])
            append = hashes.append
            for start in range(0, len(buf), nbytes):
                h = _xxh64(buf[start : start + nbytes], h)
                append(h)
        register = self._hash_to_block.setdefault
        block_hash = self._block_hash
        for i in range(num_cached_blocks, num_full):
            block_id = block_ids[i]
            h = hashes[i]
            if register(h, block_id) == block_id:
                block_hash[block_id] = h
        return hashes

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Blocks reaching zero become free, cached ones at the
        LRU tail in reverse order so that the tail of a chain is evicted before its head."""
        ref = self._ref_count
        block_hash = self._block_hash
        free_cached = self._free_cached
        uncached = self._free_uncached
        for block_id in reversed(block_ids):
            count = ref[block_id] - 1
            if count:
                if count < 0:
                    raise ValueError(f"block {block_id} released more often than acquired")
                ref[block_id] = count
                continue
            ref[block_id] = 0
            if block_hash[block_id] is None:
                uncached.append(block_id)
            else:
                free_cached[block_id] = None

    def evict(self, num_blocks: int) -> list[int]:
        """Drop the hashes of up to num_blocks cached free blocks, LRU first; returns their ids."""
        free_cached = self._free_cached
        block_hash = self._block_hash
        hash_to_block = self._hash_to_block
        evicted = []
        for _ in range(min(num_blocks, len(free_cached))):
            block_id = free_cached.popitem(last=False)[0]
            del hash_to_block[block_hash[block_id]]
            block_hash[block_id] = None
            evicted.append(block_id)
        self._free_uncached.extend(evicted)
        self._num_evicted_blocks += len(evicted)
        return evicted

    def stats(self) -> FlatStats:
        num_free = self.num_free_blocks
        return FlatStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=num_free,
            num_cached_blocks=len(self._hash_to_block),
            num_in_use_blocks=self.num_blocks - num_free,
            num_queries=self._num_queries,
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evicted_blocks=self._num_evicted_blocks,
        )

    def check_integrity(self) -> None:
        ref = self._ref_count
        assert all(c >= 0 for c in ref), "negative ref count"
        uncached = set(self._free_uncached)
        cached = set(self._free_cached)
        assert len(uncached) == len(self._free_uncached), "a block is twice on the free stack"
        assert not uncached & cached, "a block is in both free pools"
        zero = {b for b, c in enumerate(ref) if c == 0}
        assert uncached | cached == zero, (
            f"free pools != blocks with ref 0: {sorted((uncached | cached) ^ zero)[:8]}"
        )
        assert all(self._block_hash[b] is None for b in uncached), (
            "a cached block on the free stack"
        )
        assert all(self._block_hash[b] is not None for b in cached), "an uncached block in the LRU"
        for h, block_id in self._hash_to_block.items():
            assert self._block_hash[block_id] == h, f"block {block_id} lost its hash"
        num_hashed = sum(h is not None for h in self._block_hash)
        assert num_hashed == len(self._hash_to_block), "hashed blocks missing from the map"
