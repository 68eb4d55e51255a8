"""The real `PrefixCache` over a real `DiskStore` under random traffic while block files are
damaged behind its back: vanished (another process evicted them), truncated, flipped, swapped
for another block's file (a restore under the wrong name, a hostile co-writer), or replaced by
something that cannot be read (a folder, a FIFO). A restart opens a new cache over the folder.

The engine's side is played as `TierIO` and `LLM` play it: moves run in order, a block file the
store cannot use leaves its host block holding garbage (`Poisoned`), the cache forgets those
host copies, and a request whose table reads a garbage device block is admitted again. Checked
after every step: every invariant of the cache and the store (`CheckedCache`), every slot a
request reads holds its own prefix's KV, a damaged file is only ever a miss (never a fault),
and a request admitted again finishes within a few tries (a file that failed is not offered
again).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tiers import BASES, Sim

from radixkv.cache.moves import DiskRead, DiskWrite, Load, Offload, Poisoned

B = 4
DAMAGES = ("vanish", "truncate", "flip", "swap", "folder", "fifo")


class DamagedSim(Sim):
    """`Sim`, with disk reads that may miss (see the module docstring)."""

    def run_moves(self) -> Poisoned:  # type: ignore[override]
        poisoned = Poisoned()
        for move in self.cache.take_moves():
            oks: list[bool | None] = [True] * len(move.host)
            if isinstance(move, Offload):
                self.host[list(move.host)] = self.device[list(move.device)]
            elif isinstance(move, Load):
                self.device[list(move.device)] = self.host[list(move.host)]
            elif isinstance(move, DiskWrite):
                assert self.disk is not None
                for h, key, sound in zip(move.host, move.keys, poisoned.sound(move), strict=True):
                    if sound:
                        self.disk.put(key, self.host[h])  # may fail: a folder in its place
            else:
                assert isinstance(move, DiskRead) and self.disk is not None
                pairs = zip(move.keys, move.host, strict=True)
                oks = [self.disk.get(key, self.host[h]) or None for key, h in pairs]
            poisoned.record(move, oks)
        assert not poisoned.faulty, "a damaged file is a miss, never a fault"
        self.cache.forget(sorted(poisoned.host))
        return poisoned

    def serve(self, prompt: list[int], reply: list[int], namespace: str | None = None) -> int:
        """One request's life; admitted again while a block file it was to read is missed."""
        for _ in range(len(prompt) + 2):
            table = self.admit(prompt, namespace)
            if not self.run_moves().device.intersection(table.blocks):
                return self.compute(table, prompt, reply, namespace)
            self.cache.close(table)  # requeued: nothing was written
        raise AssertionError("a request was admitted again and again")


def damage(root: Path, kind: str, pick: int) -> None:
    """Damage one of the block files under `root` (chosen by `pick`), if there is one."""
    files = sorted(p for p in root.rglob("*.kv") if p.is_file() and p.stat().st_size)
    if not files:
        return
    path, other = files[pick % len(files)], files[(pick + 1) % len(files)]
    data = bytearray(path.read_bytes())
    at = pick % len(data)
    if kind == "vanish":
        path.unlink()
    elif kind == "truncate":
        path.write_bytes(data[:at])
    elif kind == "flip":
        data[at] ^= 0x10
        path.write_bytes(data)
    elif kind == "swap":
        path.write_bytes(other.read_bytes())
    else:
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.mkdir()


def open_sim(root: Path) -> DamagedSim:
    # A device of two requests (one beside another's locked path), a host of 5 blocks and a
    # disk of 14: blocks go down every tier.
    return DamagedSim(2 * -(-29 // B) + 1, B, host_blocks=5, disk_dir=root, disk_files=14)


serve = st.tuples(
    st.just("serve"),
    st.sampled_from([None, "t"]),  # namespace
    st.integers(0, 2),  # which conversation
    st.sampled_from([26, 21, 17, 13, 9, 5]),  # prompt length
    st.integers(0, 3),  # reply length
)
spoil = st.tuples(st.just("damage"), st.sampled_from(DAMAGES), st.integers(0, 10**6))
step = st.one_of(serve, serve, serve, spoil, spoil, st.just(("restart",)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=8, max_size=30))
def test_damaged_block_files_are_misses_and_never_break_the_cache(
    tmp_path_factory: Any, steps: list[tuple[Any, ...]]
) -> None:
    root = tmp_path_factory.mktemp("kv")
    sim = open_sim(root)
    for op, *args in steps:
        if op == "serve":
            ns, base, n, r = args
            prompt = [int(t) for t in BASES[base][:n]]
            sim.serve(prompt, [int(t) for t in BASES[base][n : n + r]], ns)
        elif op == "damage":
            damage(root, *args)
        else:  # a stopping engine writes what it holds; the next one finds it
            sim.cache.persist()
            sim.run_moves()
            sim = open_sim(root)
        assert sim.disk is not None and sim.disk.num_bytes <= sim.disk.budget_bytes
