"""The engine runs the cache's tier moves in order; a failed move poisons exactly what it should."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from radixkv.cache.keys import chain_keys
from radixkv.cache.moves import DiskRead, DiskWrite, Load, Offload
from radixkv.engine.tiers.disk_store import DiskStore
from radixkv.engine.tiers.host_kv import HostKVPool, KVCopier
from radixkv.engine.tiers.tier_io import TierIO

L, N, B, H, D = 2, 8, 4, 2, 4


@pytest.fixture
def tier(tmp_path) -> TierIO:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((L, N, B, H, D), generator=gen)
    v = torch.randn((L, N, B, H, D), generator=gen)
    host = HostKVPool(
        N, num_layers=L, block_size=B, num_kv_heads=H, head_dim=D, dtype=k.dtype, pin_memory=False
    )
    disk = DiskStore(
        tmp_path, {"t": 1}, block_size=B, block_nbytes=host.bytes_per_block, budget_bytes=10**6
    )
    return TierIO(KVCopier(k, v, host), disk)


KEYS = chain_keys("t", np.arange(4 * B, dtype="<u4").tobytes(), B)


def kv(tier: TierIO, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tier.copier.k_cache[:, block].clone(), tier.copier.v_cache[:, block].clone()


def test_a_block_goes_down_every_tier_and_back_in_one_list(tier: TierIO) -> None:
    """Offload device 1 -> host 0, write it to disk, reuse host 0 and device 1 for other blocks,
    then read the file into host 5 and load it into device 6: device 6 holds what device 1 held.
    Each move reads a block before a later move reuses it: the order makes it safe."""
    original = kv(tier, 1)
    moves = [
        Offload((1,), (0,)),
        DiskWrite((0,), KEYS[:1]),
        Offload((2,), (0,)),  # host 0 reused
        Load((0,), (1,)),  # device 1 reused
        DiskRead(KEYS[:1], (5,)),
        Load((5,), (6,)),
    ]
    assert not tier.run(moves)
    tier.order_before_compute()
    got = kv(tier, 6)
    assert torch.equal(got[0], original[0]) and torch.equal(got[1], original[1])
    assert torch.equal(tier.copier.k_cache[:, 1], tier.copier.k_cache[:, 2])
    totals = tier.totals
    assert (totals["offload"].num_moves, totals["load"].num_blocks) == (2, 2)
    assert totals["disk_write"].nbytes == totals["disk_read"].nbytes == tier.host.bytes_per_block
    assert all(t.num_failed_blocks == 0 for t in totals.values())


def test_a_failed_copy_poisons_what_it_writes_and_garbage_never_reaches_the_disk(
    tier: TierIO, monkeypatch, caplog
) -> None:
    real_offload = tier.copier.offload

    def failing_offload(device, host):
        if 3 in device:
            raise RuntimeError("injected offload fault")
        return real_offload(device, host)

    monkeypatch.setattr(tier.copier, "offload", failing_offload)
    moves = [
        Offload((3, 4), (1, 2)),  # fails: host 1 and 2 hold garbage
        Offload((5,), (3,)),
        DiskWrite((1, 3), KEYS[:2]),  # block 1 is garbage: only host 3's file is written
        Load((2, 3), (6, 7)),  # device 6 gets garbage, device 7 sound
    ]
    with caplog.at_level(logging.ERROR, logger="radixkv.engine.tiers.tier_io"):
        bad = tier.run(moves)
    assert (bad.host, bad.device) == ({1, 2}, {6})
    assert "injected offload fault" in caplog.text
    assert not tier.disk.contains(KEYS[0].block_hash) and tier.disk.contains(KEYS[1].block_hash)
    assert tier.totals["disk_write"].num_failed_blocks == 1
    assert tier.totals["offload"].num_failed_blocks == 2


def test_a_missing_or_damaged_file_poisons_only_its_block(tier: TierIO) -> None:
    assert not tier.run([Offload((0, 1), (0, 1)), DiskWrite((0, 1), KEYS[:2])])
    path = tier.disk._path(KEYS[1].block_hash)
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    bad = tier.run([DiskRead(KEYS[:3], (4, 5, 6)), Load((4, 5, 6), (2, 3, 4))])
    assert (bad.host, bad.device) == ({5, 6}, {3, 4})
    assert tier.totals["disk_read"].num_failed_blocks == 2


def test_an_interrupt_counts_every_unfinished_move_as_failed(tier: TierIO, monkeypatch) -> None:
    def interrupted(host, device):
        raise KeyboardInterrupt

    monkeypatch.setattr(tier.copier, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tier.run([Offload((0,), (0,)), Load((0,), (1,)), Offload((1,), (2,))])
    assert tier.poisoned_so_far.device == {1} and tier.poisoned_so_far.host == {2}
