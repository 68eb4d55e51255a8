"""BlockPool: a fixed set of physical KV blocks with owner counts and a free list.

The pool knows nothing about tokens or trees. A block is either *free* (no owner, on the free list
exactly once) or *used* (one owner or more). Who the owners are (tree nodes, requests) is the
business of `PrefixCache`; the pool only counts them and recycles a block when the last one goes.
Its caller (the cache) is trusted: ids and counts are its own, so preconditions are asserts and
`check_integrity()` recomputes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.cache.tokens import check_size


class BlockPool:
    """`num_blocks` physical blocks of `block_size` token slots, ids `0 .. num_blocks-1`.

    Three verbs: `allocate` (free blocks, one owner each), `add_owner`, `release` (drop one owner
    each; a block whose last owner goes returns to the free list).

    Invariants (recomputed by `check_integrity`):
    * every id is on the free list exactly once iff it has no owner;
    * `num_free + num_used == num_blocks`;
    * owner counts never go negative; a block returns to the free list when its count reaches
      zero, never earlier and never twice.

    The free list is a stack, so a fresh pool hands out ids in increasing order and blocks released
    together are handed out again in the order given: tests stay readable and runs deterministic.
    """

    __slots__ = ("_free", "_refs", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """Raises TypeError/ValueError for a size that is not an int >= 1."""
        self.num_blocks: int = check_size(num_blocks, "num_blocks", low=1)
        self.block_size: int = check_size(block_size, "block_size", low=1)
        self._refs: list[int] = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))  # next out: the last

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        """Current number of owners of `block_id` (0 = free)."""
        return self._refs[block_id]

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks, one owner each; None, nothing changed, when fewer are
        free."""
        assert num_blocks >= 0, num_blocks
        free = self._free
        if num_blocks > len(free):
            return None
        ids = free[len(free) - num_blocks :]
        del free[len(free) - num_blocks :]
        ids.reverse()
        for b in ids:
            self._refs[b] = 1
        return ids

    def add_owner(self, block_id: int) -> None:
        """One more owner of a used block (a free one is allocated, not owned)."""
        assert self._refs[block_id] > 0, f"block {block_id} is free: it cannot gain an owner"
        self._refs[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one owner of each block, last first, so that blocks freed together are handed out
        again in the order given and a table's tail is freed before its head. Returns the blocks
        that became free, in the order freed."""
        refs = self._refs
        freed = []
        for b in reversed(block_ids):
            assert refs[b] > 0, f"block {b} is already free"
            refs[b] -= 1
            if refs[b] == 0:
                freed.append(b)
        self._free += freed
        return freed

    def check_integrity(self, owners: dict[int, int] | None = None) -> None:
        """Recompute the invariants; raises AssertionError naming the first violation. With
        `owners` (block id -> expected owner count, absent = 0), also that every count matches."""
        seen = set(self._free)
        if len(seen) != len(self._free) or not seen.issubset(range(self.num_blocks)):
            raise AssertionError(f"free list holds a block twice or out of range: {self._free}")
        for b, r in enumerate(self._refs):
            if r < 0:
                raise AssertionError(f"block {b} has negative ref count {r}")
            if (r == 0) != (b in seen):
                state = "on" if b in seen else "not on"
                raise AssertionError(f"block {b} has ref count {r} but is {state} the free list")
            if owners is not None and r != owners.get(b, 0):
                raise AssertionError(f"block {b} ref count {r} != {owners.get(b, 0)} owners")
