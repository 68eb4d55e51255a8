"""The engine's side of the tiers in the cache simulations (`tests/cache/test_tiers.py`,
`test_window_group_tiers.py`): blocks of uint64 KV stand-ins, one per slot, moved by the cache's
planned moves between device and host arrays and a real `DiskStore` of such blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from radixkv.cache.moves import DiskRead, DiskWrite, Load, Offload
from radixkv.engine.tiers.disk_store import CHECKSUM, HEADER, DiskStore


def sim_disk_store(root: Path, tags: dict[str, Any], block_size: int, files: int) -> DiskStore:
    """A disk store of stand-in blocks (8 bytes a slot) with room for `files` block files."""
    nbytes = 8 * block_size
    file_bytes = HEADER.size + 4 * block_size + nbytes + CHECKSUM.size
    return DiskStore(
        root, tags, block_size=block_size, block_nbytes=nbytes, budget_bytes=files * file_bytes
    )


def run_move(move: Any, device: np.ndarray, host: np.ndarray, disk: DiskStore | None) -> None:
    """Carry out one planned move on the arrays and the store, as the engine's mover would."""
    if isinstance(move, Offload):
        host[list(move.host)] = device[list(move.device)]
    elif isinstance(move, Load):
        device[list(move.device)] = host[list(move.host)]
    elif isinstance(move, DiskWrite):
        for h, key in zip(move.host, move.keys, strict=True):
            assert disk is not None and disk.put(key, host[h])
    else:
        assert isinstance(move, DiskRead)
        for key, h in zip(move.keys, move.host, strict=True):
            assert disk is not None and disk.get(key, host[h])
