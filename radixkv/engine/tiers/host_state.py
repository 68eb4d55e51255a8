"""The state group's host tier storage: recurrent-state snapshots in host memory, and the copies
between them and the device's state slots.

A snapshot is every recurrent layer's state of one slot (`RecurrentStates`: per layer a conv
tensor [num_slots, K - 1, channels] and, but for a short convolution, an ssm tensor [num_slots,
*state_shape]); the host holds it as one contiguous row of bytes, the layers' tensors one after
the other in layer order (conv, then ssm):

    data: [num_host_slots, snapshot_bytes] uint8

so a host slot is one buffer: what the disk tier writes and reads as one file's payload
(`block_buffer`), as a host KV block is. `StateCopier` speaks `KVCopier`'s verbs (offload, load,
order, synchronize) over slots, so the tier mover (`TierIO`) runs the state group's moves as it
runs a KV group's. The copies are synchronous, on the compute stream: a snapshot moves when it is
evicted or hit, one slot at a time, far less often than KV blocks do.

Compact snapshots (`snapshot_dtype` bf16 / int8, `recurrent.compact`) go down as the device's
snapshot slot holds them, byte for byte (per layer conv, ssm as stored, then an int8 state's
scales), so a restored snapshot equals what the device held and the tiers' budgets count those
bytes; a load into a running slot expands one on the device, by the compact pool's own `load`
(through a one-slot staging pool), as a resume copy does. The disk files' fingerprint names the
format: a store of another `snapshot_dtype` is not read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.engine.step.recurrent.compact import CompactSnapshots
from radixkv.engine.tiers.disk_store import block_file_nbytes
from radixkv.engine.tiers.host_kv import LOAD, OFFLOAD, KVCopy
from radixkv.engine.tiers.kv_fingerprint import kv_fingerprint
from radixkv.engine.tiers.tier_io import TierIO, open_disk_store

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.step.recurrent import RecurrentStates

logger = logging.getLogger(__name__)

STATE_GROUP = "state"  # the fingerprint's name of the snapshots' files (kept apart from KV's)
HOST_SLOT_LAYOUT = "[slot bytes: per recurrent layer in order, conv then ssm (then int8 scales)]"


class HostStatePool:
    """`num_blocks` snapshots in host memory (see the module docstring): storage only, the
    cache says which host slot holds which snapshot. Pinned when the device is CUDA."""

    def __init__(self, num_blocks: int, snapshot_bytes: int, *, pin_memory: bool) -> None:
        self.data = torch.empty(
            (num_blocks, snapshot_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self.num_blocks = num_blocks
        self.pinned = pin_memory
        self.bytes_per_block = snapshot_bytes

    def block_buffer(self, block_id: int) -> np.ndarray:
        """The bytes of host slot `block_id` (a view: writing it writes the slot)."""
        assert 0 <= block_id < self.num_blocks, f"host slot {block_id} out of range"
        return self.data[block_id].numpy()

    def check_integrity(self) -> None:
        assert self.data.device.type == "cpu" and self.data.is_contiguous(), "host pool layout"


class StateCopier:
    """Slot copies between the device's `RecurrentStates` and a `HostStatePool` of its snapshots'
    size (the verbs of `KVCopier`, block ids being slot ids). Exact snapshots: any slot either
    way. Compact ones: offloads read snapshot slots as stored, loads expand into running slots
    (the only copies the state group plans with compact snapshots)."""

    def __init__(self, states: RecurrentStates, host: HostStatePool) -> None:
        self.states = states
        self.host = host
        self.device = next(iter(states.conv.values())).device
        compact = states.snapshot_dtype != "exact"
        # the device tensors an offload reads, as rows of bytes, and the id of their row 0
        self.rows, self.first = _byte_rows(states.conv, states.ssm), 0
        self.staging: CompactSnapshots | None = None
        if compact:
            snaps = states.snapshots  # None: no snapshot slot, only loads (a restart's hits)
            self.rows = [] if snaps is None else _byte_rows(snaps.conv, snaps.ssm, snaps.scale)
            self.first = states.num_running
            self.staging = CompactSnapshots(
                states.specs.values(), 1, states.snapshot_dtype, states.dtype, self.device
            )
            staged = _byte_rows(self.staging.conv, self.staging.ssm, self.staging.scale)
            self.staged = [r[0] for r in staged]
            assert sum(r.shape[0] for r in self.staged) == host.bytes_per_block
        assert compact or sum(r.shape[1] for r in self.rows) == host.bytes_per_block
        assert host.bytes_per_block == states.snapshot_nbytes()

    def offload(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> KVCopy:
        """Copy state slots `device_ids[i]` (snapshot slots, compact) into host slots
        `host_ids[i]`."""
        assert all(d >= self.first for d in device_ids), ("not a snapshot slot", device_ids)
        d, h = self._index([d - self.first for d in device_ids], host_ids)
        for rows, (lo, hi) in zip(self.rows, _spans(self.rows), strict=True):
            self.host.data[h, lo:hi] = rows.index_select(0, d).cpu()
        return self._done(OFFLOAD, len(host_ids))

    def load(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> KVCopy:
        """Copy host slots `host_ids[i]` into state slots `device_ids[i]` (running slots,
        expanded from the compact format, compact)."""
        if self.staging is not None:
            assert all(d < self.states.num_running for d in device_ids), device_ids
            for host_id, slot in zip(host_ids, device_ids, strict=True):
                row = self.host.data[host_id].to(self.device)
                for part, (lo, hi) in zip(self.staged, _spans(self.staged), strict=True):
                    part.copy_(row[lo:hi])
                self.staging.load(0, *self.states.running_views(slot))
            return self._done(LOAD, len(host_ids))
        d, h = self._index(device_ids, host_ids)
        for rows, (lo, hi) in zip(self.rows, _spans(self.rows), strict=True):
            rows.index_copy_(0, d, self.host.data[h, lo:hi].to(self.device))
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


def _byte_rows(*by_layer: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The host slot's layout: layer by layer, each layer's tensors in the order given (conv,
    ssm, scale), each as its slots' rows of bytes [num_slots, its bytes per slot] (views)."""
    layers = sorted(by_layer[0])
    tensors = [d[i] for i in layers for d in by_layer if i in d]
    return [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]


def _spans(rows: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Where each of `rows` lies in a host slot's bytes: [lo, hi) by its last axis's width."""
    spans, lo = [], 0
    for r in rows:
        spans.append((lo, lo + r.shape[-1]))
        lo += r.shape[-1]
    return spans


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
    keys of `block_size`-token blocks, each unit a snapshot as the device stores it (compact or
    not). ValueError for a budget that holds no snapshot."""
    snapshot_bytes = states.snapshot_nbytes()
    num_host = host_bytes // snapshot_bytes
    if num_host < 1:
        raise ValueError(
            f"host_cache_bytes={config.host_cache_bytes}: its share for recurrent-state "
            f"snapshots (snapshot_share={config.snapshot_share}, {host_bytes} bytes) holds no "
            f"snapshot ({snapshot_bytes} bytes each)"
        )
    device = next(iter(states.conv.values())).device
    host = HostStatePool(num_host, snapshot_bytes, pin_memory=device.type == "cuda")
    disk = None
    if config.kv_cache_dir is not None:
        file_nbytes = block_file_nbytes(block_size, snapshot_bytes)
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
        fingerprint["snapshot_dtype"] = states.snapshot_dtype
        fingerprint["state_layers"] = [
            [i, list(s.conv_shape), None if s.ssm_shape is None else list(s.ssm_shape)]
            for i, s in sorted(states.specs.items())
        ]
        disk = open_disk_store(config, fingerprint, block_size, snapshot_bytes, disk_bytes)
    logger.info(
        "host tier for recurrent-state snapshots: %d (%.1f MiB)%s",
        num_host,
        num_host * snapshot_bytes / 2**20,
        "" if disk is None else f", disk: {disk.num_files} snapshot files found at start",
    )
    return TierIO(StateCopier(states, host), disk)
