"""BlockPool: free list, ref counts; its caller is trusted, misuse is an assert."""

from __future__ import annotations

import pytest

from radixkv import BlockPool


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(num_blocks=8, block_size=16)


def test_fresh_pool_hands_out_ids_in_order(pool: BlockPool) -> None:
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert [pool.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free == 3
    pool.check_integrity()


def test_allocate_too_many_returns_none_and_changes_nothing(pool: BlockPool) -> None:
    pool.allocate(6)
    before = (pool.num_free, [pool.ref_count(b) for b in range(8)])
    assert pool.allocate(3) is None
    assert (pool.num_free, [pool.ref_count(b) for b in range(8)]) == before
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_blocks_freed_together_come_back_in_the_same_order(pool: BlockPool) -> None:
    ids = pool.allocate(5)
    pool.release([3, 1, 4])
    assert pool.allocate(3) == [3, 1, 4]
    assert ids == [0, 1, 2, 3, 4]
    pool.check_integrity()


def test_block_returns_to_free_list_only_when_last_owner_goes(pool: BlockPool) -> None:
    (b,) = pool.allocate(1)
    pool.add_owner(b)
    pool.add_owner(b)
    assert pool.ref_count(b) == 3
    assert pool.release([b]) == []
    assert pool.release([b]) == []
    assert pool.num_free == 7
    assert pool.release([b]) == [b]
    assert pool.num_free == 8 and pool.ref_count(b) == 0
    pool.check_integrity()


def test_double_free_and_incref_of_free_block_are_asserts(pool: BlockPool) -> None:
    a, b = pool.allocate(2)
    pool.release([a])
    with pytest.raises(AssertionError, match="already free"):
        pool.release([a])
    with pytest.raises(AssertionError, match="cannot gain an owner"):
        pool.add_owner(a)
    with pytest.raises(AssertionError):
        pool.allocate(-1)
    pool.check_integrity()
    with pytest.raises(AssertionError, match="already free"):
        pool.release([b, b])  # the second release of b finds it free


@pytest.mark.parametrize(
    ("args", "exc", "msg"),
    [
        ((0, 16), ValueError, "num_blocks must be >= 1"),
        ((-3, 16), ValueError, "num_blocks must be >= 1"),
        ((8, 0), ValueError, "block_size must be >= 1"),
        ((8.0, 16), TypeError, "num_blocks must be an int"),
        ((8, True), TypeError, "block_size must be an int, got bool"),
    ],
)
def test_bad_sizes_raise(args: tuple[object, object], exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        BlockPool(*args)  # type: ignore[arg-type]


def test_counts_follow_traffic(pool: BlockPool) -> None:
    ids = pool.allocate(4)
    pool.release(ids[:3])
    assert (pool.num_blocks, pool.block_size, pool.num_free) == (8, 16, 7)
    assert [pool.ref_count(b) for b in ids] == [0, 0, 0, 1]
    pool.check_integrity({ids[3]: 1})


def test_check_integrity_catches_corruption(pool: BlockPool) -> None:
    pool.allocate(2)
    pool._refs[5] = 1  # used, yet still on the free list
    with pytest.raises(AssertionError, match="block 5"):
        pool.check_integrity()
    pool._refs[5] = 0
    pool._free.append(0)  # a used block on the free list, and twice in total
    with pytest.raises(AssertionError):
        pool.check_integrity()
