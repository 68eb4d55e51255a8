"""Damage done to a disk tier's block files behind the engine's back, as a restore under the wrong
name, a hostile co-writer or a failing disk does it."""

from __future__ import annotations

import os
from pathlib import Path


def damage_every_other_file(root: Path) -> int:
    """Spoil every other block file under `root` in turn: flipped, truncated, swapped for another
    block's file, a folder, a FIFO or a link in its place; returns how many."""
    files = sorted(root.rglob("*.kv"))
    for i, path in enumerate(files[::2]):
        kind, other = i % 6, files[(2 * i + 1) % len(files)]
        data = bytearray(path.read_bytes())
        path.unlink()
        if kind == 0:
            data[len(data) // 2] ^= 0x01
            path.write_bytes(data)
        elif kind == 1:
            path.write_bytes(data[:-9])
        elif kind == 2:
            path.write_bytes(other.read_bytes())
        elif kind == 3:
            path.mkdir()
        elif kind == 4:
            os.mkfifo(path)
        else:
            path.symlink_to(other)
    return len(files[::2])
