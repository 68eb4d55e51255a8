"""Moves of KV between tiers: planned by the cache, run by the engine before the step's forward.

The cache plans a move whenever it decides that blocks change tier; the engine runs the moves of
a step in the order they were planned, before that step's forward:

    Offload(device, host)   device blocks -> host blocks: a demotion, or a write-through copy
    Load(host, device)      host blocks -> device blocks: a hit in the host tier
    DiskWrite(host, keys)   host blocks -> block files: a demotion from the host tier
    DiskRead(keys, host)    block files -> host blocks: a hit in the disk tier (a Load follows)

The order is what makes a list safe: a block whose content one move reads may be freed and become
the destination of a LATER move in the same list, never of an earlier one (the cache plans the
reading move first, then frees the block).

A move that fails leaves its destination blocks holding garbage, and so does every later move
that reads them (`Poisoned`); the engine recomputes the requests whose tables hold a poisoned device
block (a block file that could not be read is only a miss; a second failed copy fails the
request), and the cache forgets every copy held in a poisoned block. A DiskWrite of a poisoned host
block is not made (garbage never reaches the disk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from radixkv.cache.keys import BlockKey


@dataclass(frozen=True, slots=True)
class Offload:
    """Copy device blocks `device[i]` into host blocks `host[i]`."""

    device: tuple[int, ...]
    host: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Load:
    """Copy host blocks `host[i]` into device blocks `device[i]`."""

    host: tuple[int, ...]
    device: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DiskWrite:
    """Write host blocks `host[i]` to the disk tier as the files `keys[i]` name."""

    host: tuple[int, ...]
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class DiskRead:
    """Read the files `keys[i]` name into host blocks `host[i]`."""

    keys: tuple[BlockKey, ...]
    host: tuple[int, ...]


Move = Offload | Load | DiskWrite | DiskRead


class Poisoned:
    """Which blocks hold garbage so far, while a step's moves run in order: `record` each move
    as it ran (all its blocks, or block by block). A destination block is garbage iff its move
    failed or its source block was garbage; a sound move over a garbage block cures it. A
    DiskWrite changes no block (the engine skips its garbage blocks: `sound`).

    Garbage has a cause: a block file that could not be used is a cache miss (another process
    evicted it, or it is damaged, unreadable or another prefix's), anything else that failed is
    a fault. `missed` holds the garbage device blocks whose garbage comes from misses alone: a
    request reading only those is recomputed, not held to account."""

    def __init__(self) -> None:
        self.device: set[int] = set()
        self.host: set[int] = set()
        self.missed: set[int] = set()  # of `device`: garbage from missed block files alone
        self._missed_host: set[int] = set()  # of `host`: likewise

    def __bool__(self) -> bool:
        return bool(self.device or self.host)

    @property
    def faulty(self) -> set[int]:
        """The garbage device blocks that a fault made (not only a missed block file)."""
        return self.device - self.missed

    def sound(self, t: DiskWrite) -> list[bool]:
        """Per block of `t`: whether its host block holds what the cache thinks it does."""
        return [h not in self.host for h in t.host]

    def record(self, t: Move, ok: bool | Sequence[bool | None] = True) -> None:
        """`t` ran: `ok` says whether it worked, as a whole or block by block (None: that block's
        file was missed, see the class docstring)."""
        oks = [ok] * len(t.host) if isinstance(ok, bool) else list(ok)
        assert len(oks) == len(t.host), "one outcome per block"
        device = (self.device, self.missed)
        host = (self.host, self._missed_host)
        if isinstance(t, Offload):
            _flow(oks, t.device, device, t.host, host)
        elif isinstance(t, Load):
            _flow(oks, t.host, host, t.device, device)
        elif isinstance(t, DiskRead):
            _flow(oks, None, (set(), set()), t.host, host)


def _flow(
    oks: Sequence[bool | None],
    src: Sequence[int] | None,
    src_bad: tuple[set[int], set[int]],
    dst: Sequence[int],
    dst_bad: tuple[set[int], set[int]],
) -> None:
    """Garbage flows from `src` to `dst` block by block; `*_bad` are the (garbage, of it from
    misses alone) blocks of each side."""
    bad, missed = dst_bad
    for j, b in enumerate(dst):
        if not oks[j]:
            garbage, from_miss = True, oks[j] is None
        elif src is not None and src[j] in src_bad[0]:
            garbage, from_miss = True, src[j] in src_bad[1]
        else:
            garbage = from_miss = False
        (bad.add if garbage else bad.discard)(b)
        (missed.add if from_miss else missed.discard)(b)
