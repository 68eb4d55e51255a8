"""The host tier's storage: KV blocks in host memory, batched copies to and from the device pool.

`HostKVPool` holds `num_blocks` blocks, each one contiguous region with the block's K and V over
every layer, in the model's dtype:

    data: [num_blocks, num_layers, 2 (K, V), block_size, kv_heads, head_dim]

(the device pool is layer-first: K and V each [num_layers, num_blocks, block_size, kv_heads,
head_dim]). A group that keeps one tensor (multi-head latent attention's latent) has one part
where K and V are two: [num_blocks, num_layers, 1, block_size, 1, latent width]. Block-first,
so that one block is one buffer: a run of consecutive host blocks moves with one DMA, and a
block moves to or from the disk tier as one file payload (`block_buffer`, the bytes `DiskStore`
writes and reads, no other serialisation). On CUDA the pool is pinned
(page-locked): copies from and to it are asynchronous DMA.

`KVCopier` moves lists of blocks across all layers, in one batch per call:

* on the CPU, synchronously: a gather and a scatter of all the blocks per layer and K / V
  (`index_select`, `index_copy_`);
* on CUDA, on a side stream: the device side gathers into (or scatters from) a contiguous staging
  tensor with one index op per K and V, the host side is one DMA per run of consecutive host
  blocks. A copy starts after the work already queued on the compute stream (an offload reads what
  the forward wrote; a load's target blocks may have been freed by a request that a queued forward
  still reads) and records an event when done. The host never waits for it: before a forward that
  reads loaded blocks, or writes into blocks whose offload is in flight, the engine makes the
  compute stream wait on the event (`order_before_compute`), a wait on the device. Rows that need
  no load are stalled only if the copy is still running by then.

The caller keeps the blocks a copy reads or writes out of any other use until it completes
(`KVCopy.done`; `synchronize` waits on the host, e.g. before a host block's bytes go to disk).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

LOAD = "load"  # host -> device
OFFLOAD = "offload"  # device -> host


def plan_host_blocks(bytes_per_block: int, host_cache_bytes: int) -> int:
    """How many host blocks `host_cache_bytes` (an int >= 0: `EngineConfig` checked it) holds (0:
    no host tier). ValueError for a size that holds no block of this model's."""
    assert host_cache_bytes >= 0, host_cache_bytes
    n = host_cache_bytes // bytes_per_block
    if host_cache_bytes and n < 1:
        raise ValueError(
            f"host_cache_bytes={host_cache_bytes} holds no KV block ({bytes_per_block} bytes each)"
        )
    return n


class HostKVPool:
    """`num_blocks` KV blocks in host memory (see the module docstring for the layout), pinned
    when the device pool is on CUDA. Storage only: which host block holds what is the cache's
    business (it hands out host block ids as it does device ones).

    Invariant: `data` has shape [num_blocks, num_layers, num_parts, block_size, kv_heads,
    head_dim] on the CPU, contiguous, pinned iff `pinned`."""

    def __init__(
        self,
        num_blocks: int,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
        num_parts: int = 2,
    ) -> None:
        shape = (num_blocks, num_layers, num_parts, block_size, num_kv_heads, head_dim)
        # Empty, not zeroed: a host block is written before anything reads it, and untouched
        # pages of an unpinned pool cost no memory until then.
        self.data = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
        self.num_blocks = num_blocks
        self.pinned = pin_memory
        self.bytes_per_block = self.data[0].nbytes if num_blocks else 0

    def block_buffer(self, block_id: int) -> np.ndarray:
        """The bytes of host block `block_id` (uint8, a view: writing it writes the block): K then
        V (or the one part) of each layer in turn. What the disk tier stores for one block."""
        assert 0 <= block_id < self.num_blocks, f"host block {block_id} out of range"
        return self.data[block_id].view(torch.uint8).numpy().reshape(-1)

    def check_integrity(self) -> None:
        assert self.data.device.type == "cpu" and self.data.is_contiguous(), "host pool layout"
        assert self.data.is_pinned() == self.pinned, "host pool pinning"


@dataclass(slots=True)
class KVCopy:
    """One batched copy of `num_blocks` blocks (`direction` LOAD or OFFLOAD)."""

    direction: str
    num_blocks: int
    nbytes: int
    done: Any = None  # CUDA: recorded on the side stream after the copy; None on the CPU (done)

    @property
    def complete(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self.done is None or bool(self.done.query())


class KVCopier:
    """Batched block copies between a device pool (`k_cache`, `v_cache`: [num_layers, num_blocks,
    block_size, kv_heads, head_dim]; `v_cache` None for a pool of one tensor, a latent) and a
    `HostKVPool` of the same block shape, parts and dtype; see the module docstring for how they
    are ordered on CUDA. What the copies move is counted once, by the tier mover
    (`radixkv.engine.tiers.tier_io.MoveTotals`)."""

    def __init__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor | None, host: HostKVPool
    ) -> None:
        self.caches = (k_cache,) if v_cache is None else (k_cache, v_cache)
        assert all(c.shape == k_cache.shape for c in self.caches)
        assert k_cache.dtype == host.data.dtype
        parts = len(self.caches)
        assert tuple(host.data.shape[1:]) == (k_cache.shape[0], parts, *k_cache.shape[2:])
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.host = host
        self.device = k_cache.device
        self.cuda = self.device.type == "cuda"
        assert host.pinned or not self.cuda, "asynchronous copies need a pinned host pool"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None

    def offload(self, device_ids: Sequence[int], host_ids: Sequence[int]) -> KVCopy:
        """Copy device blocks `device_ids[i]` into host blocks `host_ids[i]`, every layer."""
        return self._copy(OFFLOAD, device_ids, host_ids)

    def load(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> KVCopy:
        """Copy host blocks `host_ids[i]` into device blocks `device_ids[i]`, every layer."""
        return self._copy(LOAD, host_ids, device_ids)

    def order_before_compute(self, copy: KVCopy) -> None:
        """Make the compute stream's next work wait until `copy` is done (on the device: the host
        does not wait). Nothing to do on the CPU."""
        if copy.done is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.done)

    def synchronize(self, copy: KVCopy) -> None:
        """Wait on the host until `copy` is done (before the CPU reads or reuses its blocks)."""
        if copy.done is not None:
            copy.done.synchronize()

    # ---------------------------------------------------------------- internals
    def _copy(self, direction: str, src_ids: Sequence[int], dst_ids: Sequence[int]) -> KVCopy:
        assert len(src_ids) == len(dst_ids), "one destination per source block"
        n = len(src_ids)
        copy = KVCopy(direction, n, n * self.host.bytes_per_block)
        if n == 0:
            return copy
        device_ids, host_ids = (dst_ids, src_ids) if direction == LOAD else (src_ids, dst_ids)
        if not self.cuda:
            d = torch.as_tensor(device_ids, dtype=torch.long)
            h = torch.as_tensor(host_ids, dtype=torch.long)
            (self._load_cpu if direction == LOAD else self._offload_cpu)(h, d)
            return copy
        self._copy_cuda(copy, np.asarray(host_ids, dtype=np.int64), device_ids)
        return copy

    def _offload_cpu(self, h: torch.Tensor, d: torch.Tensor) -> None:
        # Layer by layer: a gather and a scatter of whole [B, H, D] rows run 3-4x faster on the
        # CPU than the same index ops over the 5-d tensors (benchmarks/RESULTS.md, issue 18).
        for kv, cache in enumerate(self.caches):
            for layer in range(cache.shape[0]):
                self.host.data[:, layer, kv].index_copy_(0, h, cache[layer].index_select(0, d))

    def _load_cpu(self, h: torch.Tensor, d: torch.Tensor) -> None:
        for kv, cache in enumerate(self.caches):
            for layer in range(cache.shape[0]):
                cache[layer].index_copy_(0, d, self.host.data[:, layer, kv].index_select(0, h))

    def _copy_cuda(self, copy: KVCopy, host_ids: np.ndarray, device_ids: Sequence[int]) -> None:
        """Enqueue `copy` on the side stream (see the module docstring); returns at once."""
        stream = self.stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        copy.done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            # The ids reach the device from pinned memory: a pageable copy would block the host
            # until the compute stream's queued work is done.
            index = torch.as_tensor(device_ids, dtype=torch.long).pin_memory()
            d = index.to(self.device, non_blocking=True)
            stage = torch.empty(
                (copy.num_blocks, *self.host.data.shape[1:]),
                dtype=self.host.data.dtype,
                device=self.device,
            )
            runs = _runs(host_ids)
            if copy.direction == OFFLOAD:
                for kv, cache in enumerate(self.caches):
                    stage[:, :, kv] = cache.index_select(1, d).transpose(0, 1)
                for lo, hi, first in runs:
                    self.host.data[first : first + hi - lo].copy_(stage[lo:hi], non_blocking=True)
            else:
                for lo, hi, first in runs:
                    stage[lo:hi].copy_(self.host.data[first : first + hi - lo], non_blocking=True)
                for kv, cache in enumerate(self.caches):
                    cache.index_copy_(1, d, stage[:, :, kv].transpose(0, 1))
            copy.done.record(stream)


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids: (lo, hi, ids[lo]) with ids[lo:hi] == ids[lo] + arange."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    bounds = [0, *breaks.tolist(), len(ids)]
    return [(lo, hi, int(ids[lo])) for lo, hi in itertools.pairwise(bounds)]
