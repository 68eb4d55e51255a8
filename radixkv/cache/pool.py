"""BlockPool: a fixed set of physical KV blocks with reference counts and a free list.

The pool knows nothing about tokens or trees. A block is either *free* (ref count 0, on the free
list exactly once) or *used* (ref count >= 1). Who the owners are (tree nodes, requests) is the
business of `PrefixCache`; the pool only counts them and recycles a block when the count reaches
zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixkv.cache.validation import check_size


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int  # ref count >= 1
    num_allocated_total: int  # blocks handed out by allocate() since construction
    num_freed_total: int  # blocks returned to the free list since construction


class BlockPool:
    """`num_blocks` physical blocks of `block_size` token slots, ids `0 .. num_blocks-1`.

    Invariants (recomputed by `check_integrity`):
    * every id is on the free list exactly once iff its ref count is 0;
    * `num_free + num_used == num_blocks`;
    * ref counts never go negative; a block returns to the free list when its count reaches zero,
      never earlier and never twice.

    `allocate`/`free` are O(1) per block: the free list is a stack. A freshly constructed pool hands
    out ids in increasing order, and blocks freed together come back in the order they were given,
    which keeps tests readable and the whole thing deterministic.
    """

    __slots__ = ("_free", "_num_allocated", "_num_freed", "_refs", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks: int = check_size(num_blocks, "num_blocks", low=1)
        self.block_size: int = check_size(block_size, "block_size", low=1)
        self._refs: list[int] = [0] * self.num_blocks
        # Stack: the next block handed out is the last element.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._num_allocated = 0
        self._num_freed = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current number of owners of `block_id` (0 = free). ValueError if out of range."""
        self._check_id(block_id)
        return self._refs[block_id]

    def is_free(self, block_id: int) -> bool:
        return self.ref_count(block_id) == 0

    # ---------------------------------------------------------------- mutation
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks, each with ref count 1.

        Returns None, with nothing changed, when fewer are free. Raises TypeError/ValueError for a
        count that is not an int >= 0.
        """
        return self.take(check_size(num_blocks, "num_blocks", low=0))

    def take(self, n: int) -> list[int] | None:
        """`allocate` for a caller that has validated `n` (an int >= 0) already."""
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        ids = free[-n:]
        del free[-n:]
        ids.reverse()
        refs = self._refs
        for b in ids:
            refs[b] = 1
        self._num_allocated += n
        return ids

    def incref(self, block_id: int) -> None:
        """Add an owner to a used block. ValueError if the block is free (allocate it instead) or
        out of range."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        refs = self._refs
        if refs[block_id] <= 0:
            raise ValueError(f"block {block_id} is free: a free block cannot gain an owner")
        refs[block_id] += 1

    def decref(self, block_id: int) -> bool:
        """Drop one owner; returns True when that was the last and the block went back to the free
        list. ValueError if the block is already free or out of range."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        refs = self._refs
        r = refs[block_id]
        if r <= 0:
            raise ValueError(f"block {block_id} is already free")
        if r == 1:
            refs[block_id] = 0
            self._free.append(block_id)
            self._num_freed += 1
            return True
        refs[block_id] = r - 1
        return False

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one owner of each block (blocks reaching zero return to the free list).

        Validates everything first: ValueError (nothing changed) if an id is out of range, repeated,
        or already free.
        """
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
        if len(set(ids)) != len(ids):
            raise ValueError(f"block_ids contains a repeated id: {ids}")
        for b in ids:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is already free")
        # Reversed so that blocks freed together are handed out again in the order given.
        self.drop_refs(ids[::-1])

    def drop_refs(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one owner of each block; returns the blocks that reached zero (now free), in order.

        The hot path of eviction and of `PrefixCache.free`: ids are trusted (in range, each with a
        ref count >= 1, no repeats) because the caller has validated them; an internal mistake still
        trips the assertion rather than corrupting the free list.
        """
        refs = self._refs
        freed = []
        for b in block_ids:
            r = refs[b]
            assert r > 0, f"block {b} is already free"
            refs[b] = r - 1
            if r == 1:
                freed.append(b)
        if freed:
            self._free.extend(freed)
            self._num_freed += len(freed)
        return freed

    # ------------------------------------------------------------------ checks
    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free_blocks=len(self._free),
            num_used_blocks=self.num_used,
            num_allocated_total=self._num_allocated,
            num_freed_total=self._num_freed,
        )

    def check_integrity(self) -> None:
        """Recompute the invariants; raises AssertionError naming the first violation."""
        free = self._free
        seen = set(free)
        if len(seen) != len(free):
            raise AssertionError("free list holds a block twice")
        for b in free:
            if not 0 <= b < self.num_blocks:
                raise AssertionError(f"free list holds out-of-range id {b}")
        for b, r in enumerate(self._refs):
            if r < 0:
                raise AssertionError(f"block {b} has negative ref count {r}")
            if (r == 0) != (b in seen):
                state = "on" if b in seen else "not on"
                raise AssertionError(f"block {b} has ref count {r} but is {state} the free list")

    def _check_id(self, block_id: object) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise TypeError(f"block id must be an int, got {type(block_id).__name__}")
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
