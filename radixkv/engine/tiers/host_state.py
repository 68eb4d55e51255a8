"""The state group's host tier storage: recurrent-state snapshots in host memory, and the copies
between them and the device's state slots.

A snapshot is every recurrent layer's state of one slot (`RecurrentStates`: per layer a conv
tensor [num_slots, K - 1, channels] and, but for a short convolution, an ssm tensor [num_slots,
*state_shape]); the host holds it as one contiguous row of bytes, the layers' tensors one after
the other in layer order (conv, then ssm):

    data: [num_host_slots, slot_bytes] uint8

so a host slot is one buffer: what the disk tier writes and reads as one file's payload
(`block_buffer`), as a host KV block is. `StateCopier` speaks `KVCopier`'s verbs (offload, load,
order, synchronize) over slots, so the tier mover (`TierIO`) runs the state group's moves as it
runs a KV group's. The copies are synchronous, on the compute stream: a snapshot moves when it is
evicted or hit, one slot at a time, far less often than KV blocks do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.engine.tiers.disk_store import DiskStore, block_file_nbytes
from radixkv.engine.tiers.host_kv import LOAD, OFFLOAD, KVCopy
from radixkv.engine.tiers.kv_fingerprint import kv_fingerprint
from radixkv.engine.tiers.tier_io import TierIO, _secret_bytes

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.step.recurrent import RecurrentStates

logger = logging.getLogger(__name__)

STATE_GROUP = "state"  # the fingerprint's name of the snapshots' files (kept apart from KV's)
HOST_SLOT_LAYOUT = "[slot bytes: per recurrent layer in order, conv then ssm]"


class HostStatePool:
    """`num_blocks` snapshots in host memory (see the module docstring): storage only, the
    cache says which host slot holds which snapshot. Pinned when the device is CUDA."""

    def __init__(self, num_blocks: int, slot_bytes: int, *, pin_memory: bool) -> None:
        self.data = torch.empty((num_blocks, slot_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.pinned = pin_memory
        self.bytes_per_block = slot_bytes

    def block_buffer(self, block_id: int) -> np.ndarray:
        """The bytes of host slot `block_id` (a view: writing it writes the slot)."""
        assert 0 <= block_id < self.num_blocks, f"host slot {block_id} out of range"
        return self.data[block_id].numpy()

    def check_integrity(self) -> None:
        assert self.data.device.type == "cpu" and self.data.is_contiguous(), "host pool layout"


class StateCopier:
    """Slot copies between the device's `RecurrentStates` and a `HostStatePool` of its slot size
    (the verbs of `KVCopier`, block ids being slot ids)."""

    def __init__(self, states: RecurrentStates, host: HostStatePool) -> None:
        self.tensors = [
            t
            for i in sorted(states.specs)
            for t in (states.conv[i], states.ssm.get(i))
            if t is not None
        ]
        # each tensor's slots as rows of bytes: [num_slots, its bytes per slot]
        self.rows = [t.view(t.shape[0], -1).view(torch.uint8) for t in self.tensors]
        assert sum(r.shape[1] for r in self.rows) == host.bytes_per_block == states.slot_nbytes()
        self.host = host
        self.device = self.tensors[0].device

    def offload(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> KVCopy:
        """Copy state slots `device_ids[i]` into host slots `host_ids[i]`."""
        d, h = self._index(device_ids, host_ids)
        offset = 0
        for rows in self.rows:
            width = rows.shape[1]
            self.host.data[h, offset : offset + width] = rows.index_select(0, d).cpu()
            offset += width
        return self._done(OFFLOAD, len(host_ids))

    def load(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> KVCopy:
        """Copy host slots `host_ids[i]` into state slots `device_ids[i]`."""
        d, h = self._index(device_ids, host_ids)
        offset = 0
        for rows in self.rows:
            width = rows.shape[1]
            part = self.host.data[h, offset : offset + width].to(self.device)
            rows.index_copy_(0, d, part)
            offset += width
        return self._done(LOAD, len(host_ids))

    def order_before_compute(self, copy: KVCopy) -> None:
        """The copies ran on the compute stream: nothing to order."""

    def synchronize(self, copy: KVCopy) -> None:
        """The copies are done when they return."""

    def _index(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> tuple[Any, Any]:
        assert len(device_ids) == len(host_ids), "one destination per source slot"
        d = torch.as_tensor(list(device_ids), dtype=torch.long, device=self.device)
        return d, torch.as_tensor(list(host_ids), dtype=torch.long)

    def _done(self, direction: str, n: int) -> KVCopy:
        return KVCopy(direction, n, n * self.host.bytes_per_block)


def make_state_tier_io(
    model: Any,
    states: RecurrentStates,
    config: EngineConfig,
    *,
    host_bytes: int,
    disk_bytes: int,
    block_size: int,
) -> TierIO:
    """The host pool of `host_bytes` for snapshots of `states`' slots, its copier and (with a
    `kv_cache_dir`) a disk store of `disk_bytes` beside the KV's, its files named by the chained
    keys of `block_size`-token blocks. ValueError for a budget that holds no snapshot."""
    slot_bytes = states.slot_nbytes()
    num_host = host_bytes // slot_bytes
    if num_host < 1:
        raise ValueError(
            f"host_cache_bytes={config.host_cache_bytes}: its share for recurrent-state "
            f"snapshots (snapshot_share={config.snapshot_share}, {host_bytes} bytes) holds no "
            f"snapshot ({slot_bytes} bytes each)"
        )
    device = next(iter(states.conv.values())).device
    host = HostStatePool(num_host, slot_bytes, pin_memory=device.type == "cuda")
    disk = None
    if config.kv_cache_dir is not None:
        file_nbytes = block_file_nbytes(block_size, slot_bytes)
        if disk_bytes < file_nbytes:
            raise ValueError(
                f"disk_cache_bytes={config.disk_cache_bytes}: its share for recurrent-state "
                f"snapshots (snapshot_share={config.snapshot_share}, {disk_bytes} bytes) holds "
                f"no snapshot file ({file_nbytes} bytes each)"
            )
        fingerprint = kv_fingerprint(
            model,
            block_size=block_size,
            dtype=states.dtype,
            device=device,
            num_layers=len(states.specs),
            num_kv_heads=0,
            head_dim=0,
        )
        fingerprint["kv_cache_group"] = STATE_GROUP
        fingerprint["block_layout"] = HOST_SLOT_LAYOUT
        fingerprint["state_layers"] = [
            [i, list(s.conv_shape), None if s.ssm_shape is None else list(s.ssm_shape)]
            for i, s in sorted(states.specs.items())
        ]
        disk = DiskStore(
            config.kv_cache_dir,
            fingerprint,
            block_size=block_size,
            block_nbytes=slot_bytes,
            budget_bytes=disk_bytes,
            secret=_secret_bytes(config.kv_cache_secret),
        )
    logger.info(
        "host tier for recurrent-state snapshots: %d (%.1f MiB)%s",
        num_host,
        num_host * slot_bytes / 2**20,
        "" if disk is None else f", disk: {disk.num_files} snapshot files found at start",
    )
    return TierIO(StateCopier(states, host), disk)
