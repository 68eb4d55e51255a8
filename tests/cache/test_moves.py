"""Tier moves and the blocks a failed move leaves holding garbage, against a simulation of the
blocks' contents (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cache.keys import chain_keys
from radixkv.cache.moves import DiskRead, DiskWrite, Load, Move, Offload, Poisoned

NUM = 6  # device blocks, host blocks and files
KEYS = chain_keys("t", np.arange(NUM * 2, dtype="<u4").tobytes(), 2)
GARBAGE = "garbage"  # what a fault leaves in a block
MISSED = "missed"  # what a block file that could not be used leaves


def poisoned(moves: list[Move], failed: list[int]) -> Poisoned:
    """The blocks holding garbage after `moves` ran in order, the moves at `failed` failing."""
    result = Poisoned()
    for i, t in enumerate(moves):
        result.record(t, i not in failed)
    return result


def test_a_failed_offload_poisons_its_host_blocks_and_what_is_loaded_from_them() -> None:
    moves = [Offload((1, 2), (5, 6)), Load((6, 0), (3, 4)), Offload((3,), (0,))]
    assert not poisoned(moves, [])
    bad = poisoned(moves, [0])
    assert (bad.host, bad.device) == ({5, 6, 0}, {3})
    # A sound move over a garbage block cures it.
    cured = poisoned([*moves, Load((1,), (3,))], [0])
    assert cured.device == set() and cured.host == {5, 6, 0}


def test_a_disk_read_fails_block_by_block_and_a_disk_write_skips_garbage() -> None:
    bad = Poisoned()
    bad.record(DiskRead(KEYS[:3], (0, 1, 2)), [True, False, True])
    assert bad.host == {1}
    assert bad.sound(DiskWrite((2, 1, 0), KEYS[:3])) == [True, False, True]
    bad.record(Load((0, 1), (4, 5)))
    assert bad.device == {5} and bad.faulty == {5}


def test_a_missed_block_file_is_a_miss_downstream_and_a_failed_copy_a_fault() -> None:
    bad = Poisoned()
    bad.record(DiskRead(KEYS[:3], (0, 1, 2)), [None, True, None])
    bad.record(Load((0, 1, 2), (3, 4, 5)), [True, True, False])
    assert bad.device == {3, 5} and bad.missed == {3} and bad.faulty == {5}
    bad.record(Offload((3,), (1,)))  # a miss copied on stays a miss
    bad.record(Load((1,), (0,)))
    assert bad.missed == {0, 3}


moves = st.lists(
    st.tuples(
        st.sampled_from(["offload", "load", "write", "read"]),
        st.lists(st.tuples(st.integers(0, NUM - 1), st.integers(0, NUM - 1)), min_size=1),
        # per-block outcome; None: a block file missed (a read's only)
        st.lists(st.sampled_from([True, False, None]), min_size=NUM, max_size=NUM),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(moves)
def test_poison_follows_garbage_through_any_sequence_of_moves(plan) -> None:
    """Blocks start sound (their own ids as content); a failed block copy writes garbage, a missed
    block file leaves its own kind of garbage, a sound move copies its source (garbage included);
    a disk write skips garbage. `Poisoned` names exactly the blocks that end up holding garbage,
    and of the device's, those whose garbage comes from missed files alone."""
    device: list[object] = [("d", i) for i in range(NUM)]
    host: list[object] = [("h", i) for i in range(NUM)]
    files: list[object] = [("f", i) for i in range(NUM)]
    tracker = Poisoned()
    for kind, pairs, outcome in plan:
        by_src = dict(pairs)  # one move never names a block twice on either side
        srcs, dsts = tuple(by_src), tuple(by_src.values())
        if len(set(dsts)) != len(dsts):
            continue
        oks = [ok if ok is not None or kind == "read" else False for ok in outcome[: len(dsts)]]
        if kind == "offload":
            move, src, dst = Offload(srcs, dsts), device, host
        elif kind == "load":
            move, src, dst = Load(srcs, dsts), host, device
        elif kind == "read":
            move, src, dst = DiskRead(tuple(KEYS[i] for i in srcs), dsts), files, host
        else:
            move = DiskWrite(srcs, tuple(KEYS[i] for i in dsts))
            for h, f, ok in zip(srcs, dsts, tracker.sound(move), strict=True):
                assert ok == (host[h] not in (GARBAGE, MISSED))
                if ok:
                    files[f] = host[h]
            tracker.record(move)
            continue
        snapshot = list(src)
        for s, d, ok in zip(srcs, dsts, oks, strict=True):
            dst[d] = snapshot[s] if ok else MISSED if ok is None else GARBAGE
        tracker.record(move, oks)
    spoilt = (GARBAGE, MISSED)
    assert tracker.device == {i for i in range(NUM) if device[i] in spoilt}
    assert tracker.host == {i for i in range(NUM) if host[i] in spoilt}
    assert tracker.missed == {i for i in range(NUM) if device[i] == MISSED}
    assert tracker.faulty == {i for i in range(NUM) if device[i] == GARBAGE}
