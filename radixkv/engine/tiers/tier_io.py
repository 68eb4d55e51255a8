"""Runs the cache's tier moves (`radixkv.cache.moves`) and measures them.

One `TierIO` per KV cache group, built by `make_tier_ios`, which splits the host and disk
budgets between the groups (a model with window layers has a second one over the window layers'
pool, its files in a folder of their own).

`TierIO.run(moves)` carries out one step's moves in order: copies between the device pool and the
host pool through the `KVCopier` (asynchronous on CUDA), block files through the `DiskStore`.
A file move waits on the host for the copies before it (it reads or rewrites host blocks an
earlier copy may still be reading or writing); copies never wait on the host.
`order_before_compute()` then makes the compute stream wait for the step's copies (on the
device), before the copy-on-write copies and the forward read the blocks.

A move that fails (an exception in a copy, a block file missing, damaged, unreadable or of
another prefix) is logged and counted; `run` returns the blocks it left holding garbage
(`Poisoned`, which tells a missed file from a fault), for the engine to recompute the requests
that would read them and the cache to forget those copies. A
KeyboardInterrupt or another BaseException stops the run: every move not finished counts as
failed (`poisoned_so_far`), and it is re-raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.cache.moves import DiskRead, DiskWrite, Load, Move, Offload, Poisoned
from radixkv.engine.tiers.disk_store import DiskStore, block_file_nbytes
from radixkv.engine.tiers.host_kv import HostKVPool, KVCopier, KVCopy, plan_host_blocks
from radixkv.engine.tiers.kv_fingerprint import kv_fingerprint

if TYPE_CHECKING:
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.step.kv_tensors import GroupKV

logger = logging.getLogger(__name__)

KINDS = ("offload", "load", "disk_write", "disk_read")
_KIND = {Offload: "offload", Load: "load", DiskWrite: "disk_write", DiskRead: "disk_read"}


@dataclass(slots=True)
class MoveTotals:
    """What the moves of one kind did: the engine's one record of them. Copies count when
    issued: their time is the host's time to issue them on CUDA."""

    num_moves: int = 0
    num_blocks: int = 0  # blocks moved (a failed block not included)
    nbytes: int = 0
    seconds: float = 0.0
    num_failed_blocks: int = 0


def make_tier_io(
    model: Any,
    kv: GroupKV,
    config: EngineConfig,
    *,
    num_host_blocks: int | None = None,
    disk_bytes: int | None = None,
    group: str | None = None,
) -> TierIO | None:
    """The host pool, its copier and the disk store that `config` asks for, over the device pool
    of `kv` (its K and V, or its latent: [num_layers, num_blocks, block_size, heads, width]);
    None without a host tier. `num_host_blocks` / `disk_bytes`: this pool's share of the budgets
    (None: all of them); `group` names a KV cache group other than the full layers' (its files
    are kept apart). ValueError for a host or disk budget that holds no block."""
    if not config.host_cache_bytes:
        return None
    k_cache = kv.caches[0]
    num_layers, _, block_size, num_kv_heads, head_dim = k_cache.shape
    shape = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    dtype = k_cache.dtype
    bytes_per_block = kv.bytes_per_block  # every tensor of one block over every layer
    if num_host_blocks is None:
        num_host_blocks = plan_host_blocks(bytes_per_block, config.host_cache_bytes)
    cuda = k_cache.device.type == "cuda"
    host = HostKVPool(
        num_host_blocks,
        block_size=block_size,
        dtype=dtype,
        pin_memory=cuda,
        num_parts=len(kv.caches),
        **shape,
    )
    disk = None
    if config.kv_cache_dir is not None:
        file_nbytes = block_file_nbytes(block_size, bytes_per_block)
        disk_bytes = config.disk_cache_bytes if disk_bytes is None else disk_bytes
        if disk_bytes < file_nbytes:
            raise ValueError(
                f"disk_cache_bytes={config.disk_cache_bytes} holds no KV block file "
                f"({file_nbytes} bytes each)"
            )
        fingerprint = kv_fingerprint(
            model,
            block_size=block_size,
            dtype=dtype,
            device=k_cache.device,
            kv_layout=kv.layout,
            **shape,
        )
        if group is not None:
            fingerprint["kv_cache_group"] = group
        disk = open_disk_store(config, fingerprint, block_size, bytes_per_block, disk_bytes)
    logger.info(
        "host KV tier%s: %d blocks (%.0f MiB)",
        f" ({kv.label} layers)" if group is not None or kv.latent is not None else "",
        num_host_blocks,
        num_host_blocks * bytes_per_block / 2**20,
    )
    if disk is not None:
        logger.info(
            "disk KV tier %s: %d block files found at start (%.0f of %.0f MiB)",
            disk.directory,
            disk.num_files,
            disk.num_bytes / 2**20,
            disk.budget_bytes / 2**20,
        )
    v_cache = kv.caches[1] if len(kv.caches) == 2 else None
    return TierIO(KVCopier(k_cache, v_cache, host), disk)


def make_tier_ios(
    model: Any,
    kvs: Sequence[GroupKV],
    config: EngineConfig,
    *,
    host_bytes: int | None = None,
    disk_bytes: int | None = None,
) -> tuple[TierIO | None, ...]:
    """One tier mover per KV cache group (`kvs[g]`: group g's device tensors), None each
    without a host tier. One group takes the whole host and disk budgets (`host_bytes`,
    `disk_bytes`: the KV's share of them; None: all); several split them so that each holds as
    many blocks (a hit resumes where every group has its blocks of the prefix), every group but
    the first keeping its files apart. ValueError, as `make_tier_io`, for a host or disk budget
    that holds no block (several groups: no set of one block or block file per group)."""
    if not config.host_cache_bytes:
        return (None,) * len(kvs)
    host_bytes = config.host_cache_bytes if host_bytes is None else host_bytes
    disk_bytes = config.disk_cache_bytes if disk_bytes is None else disk_bytes
    if len(kvs) == 1:
        num_host = plan_host_blocks(kvs[0].bytes_per_block, host_bytes)
        return (
            make_tier_io(model, kvs[0], config, num_host_blocks=num_host, disk_bytes=disk_bytes),
        )
    B = config.block_size
    nbytes = [kv.bytes_per_block for kv in kvs]
    files = [block_file_nbytes(B, n) for n in nbytes]
    names = [kv.name for kv in kvs]
    _check_holds_a_set("host_cache_bytes", host_bytes, nbytes, names, "KV blocks")
    if config.kv_cache_dir is not None:
        _check_holds_a_set("disk_cache_bytes", disk_bytes, files, names, "KV block files")
    num_host = host_bytes // sum(nbytes)
    num_files = disk_bytes // sum(files)
    return tuple(
        make_tier_io(
            model,
            kv,
            config,
            num_host_blocks=num_host,
            disk_bytes=num_files * file_nbytes,
            group=None if g == 0 else kv.name,
        )
        for g, (kv, file_nbytes) in enumerate(zip(kvs, files, strict=True))
    )


def _check_holds_a_set(
    name: str, budget: int, sizes: list[int], groups: list[str], what: str
) -> None:
    """ValueError unless `budget` holds one of each group's `sizes`."""
    if budget < sum(sizes):
        each = " + ".join(
            f"{n}{' bytes' if i == 0 else ''} for the {group} layers"
            for i, (n, group) in enumerate(zip(sizes, groups, strict=True))
        )
        kind = "pair" if len(sizes) == 2 else "set"
        raise ValueError(
            f"{name}={budget} holds no {kind} of {what}, one per KV cache group ({each} = "
            f"{sum(sizes)})"
        )


def open_disk_store(
    config: EngineConfig,
    fingerprint: dict[str, Any],
    block_size: int,
    block_nbytes: int,
    budget_bytes: int,
) -> DiskStore:
    """The disk store of one group's block files (a KV group's, or the recurrent-state
    snapshots') in `config.kv_cache_dir`, under `fingerprint`, signed with its secret."""
    assert config.kv_cache_dir is not None, "a disk tier needs kv_cache_dir"
    return DiskStore(
        config.kv_cache_dir,
        fingerprint,
        block_size=block_size,
        block_nbytes=block_nbytes,
        budget_bytes=budget_bytes,
        secret=_secret_bytes(config.kv_cache_secret),
    )


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    return secret.encode("utf-8") if isinstance(secret, str) else secret


class TierIO:
    """The engine's side of the tiers: a `KVCopier` over the device and host pools, and the disk
    store (None: no disk tier). Not thread-safe: the engine's step thread uses it."""

    def __init__(self, copier: KVCopier, disk: DiskStore | None) -> None:
        self.copier = copier
        self.host = copier.host
        self.disk = disk
        self.totals = {kind: MoveTotals() for kind in KINDS}
        self.poisoned_so_far = Poisoned()
        self._last_copy: KVCopy | None = None  # the last copy issued (one stream: all before it)
        self._num_stored_logged = 0  # the disk's files written, as `log_saved` last said

    def run(self, moves: Sequence[Move]) -> Poisoned:
        """Carry out `moves` in order (see the module docstring); returns the blocks left holding
        garbage (empty when every move worked)."""
        self.poisoned_so_far = poisoned = Poisoned()
        done = 0
        try:
            for move in moves:
                self._run_one(move, poisoned)
                done += 1
        except BaseException:
            for move in moves[done:]:
                poisoned.record(move, False)
                if isinstance(move, DiskRead) and self.disk is not None:
                    self.disk.unpin([key.block_hash for key in move.keys])  # reads that won't be
            raise
        return poisoned

    def log_saved(self) -> None:
        """Say in the log how many block files the disk tier wrote since the last time (or since
        it opened): what a stopping engine saved for the next one."""
        if self.disk is None:
            return
        stats = self.disk.stats()
        logger.info(
            "disk KV tier %s: %d block files written, %d there (%.0f MiB)",
            stats.directory,
            stats.num_stored - self._num_stored_logged,
            stats.num_files,
            stats.num_bytes / 2**20,
        )
        self._num_stored_logged = stats.num_stored

    def order_before_compute(self) -> None:
        """The compute stream's next work waits for every copy issued so far (on the device)."""
        if self._last_copy is not None:
            self.copier.order_before_compute(self._last_copy)
            self._last_copy = None

    # ---------------------------------------------------------------- internals
    def _run_one(self, move: Move, poisoned: Poisoned) -> None:
        kind = _KIND[type(move)]
        totals = self.totals[kind]
        t0 = time.perf_counter()
        if isinstance(move, (Offload, Load)):
            oks = self._copy(move)
        else:
            self._wait_for_copies()
            oks = self._disk(move, poisoned)
        poisoned.record(move, oks)
        moved = sum(map(bool, oks))
        totals.num_moves += 1
        totals.num_blocks += moved
        totals.nbytes += moved * self.host.bytes_per_block
        totals.num_failed_blocks += len(oks) - moved
        totals.seconds += time.perf_counter() - t0

    def _copy(self, move: Offload | Load) -> list[bool | None]:
        try:
            if isinstance(move, Offload):
                copy = self.copier.offload(move.device, move.host)
            else:
                copy = self.copier.load(move.host, move.device)
        except Exception:
            logger.exception("KV %s of %d blocks failed", _KIND[type(move)], len(move.host))
            return [False] * len(move.host)
        if copy.done is not None:
            self._last_copy = copy
        return [True] * len(move.host)

    def _disk(self, move: DiskWrite | DiskRead, poisoned: Poisoned) -> list[bool | None]:
        """Per block: True if it moved, None for a block file the store could not use (a
        miss), False for a fault (an exception)."""
        disk = self.disk
        assert disk is not None, "the cache plans file moves only with a disk tier"
        writing = isinstance(move, DiskWrite)
        # A garbage block is not written; a write that fails loses only that copy.
        sound = poisoned.sound(move) if writing else [True] * len(move.host)
        oks: list[bool | None] = []
        for ok, key, h in zip(sound, move.keys, move.host, strict=True):
            try:
                buf = self.host.block_buffer(h)
                if writing:
                    oks.append(ok and disk.put(key, buf))
                else:
                    oks.append(disk.get(key, buf) or None)
            except Exception:
                logger.exception(
                    "KV block file %016x: %s failed", key.block_hash, _KIND[type(move)]
                )
                oks.append(False)
        return oks

    def _wait_for_copies(self) -> None:
        if self._last_copy is not None:
            self.copier.synchronize(self._last_copy)
            self._last_copy = None
