"""The host tier's storage and copies, and a block's K/V through the disk store and back.

CPU here; the CUDA path (pinned pool, side stream, events) in the gpu-marked tests at the end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_llama import build_model

from radixkv.cache.keys import chain_keys
from radixkv.engine.tiers.disk_store import DiskStore
from radixkv.engine.tiers.host_kv import OFFLOAD, HostKVPool, KVCopier, _runs, plan_host_blocks
from radixkv.engine.tiers.kv_fingerprint import kv_fingerprint, weights_digest

L, N, B, H, D = 3, 12, 4, 2, 8  # layers, device blocks, block size, kv heads, head dim


def pools(
    num_host: int = 10, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, HostKVPool, KVCopier]:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn((L, N, B, H, D), generator=gen).to(device=device, dtype=dtype)
    v = torch.randn((L, N, B, H, D), generator=gen).to(device=device, dtype=dtype)
    host = HostKVPool(
        num_host,
        num_layers=L,
        block_size=B,
        num_kv_heads=H,
        head_dim=D,
        dtype=dtype,
        pin_memory=device == "cuda",
    )
    host.check_integrity()
    return k, v, host, KVCopier(k, v, host)


def assert_host_holds(host: HostKVPool, k: torch.Tensor, v: torch.Tensor, pairs) -> None:
    for h, d in pairs:
        torch.testing.assert_close(host.data[h, :, 0], k[:, d].cpu(), rtol=0, atol=0)
        torch.testing.assert_close(host.data[h, :, 1], v[:, d].cpu(), rtol=0, atol=0)


def test_runs_of_consecutive_ids() -> None:
    assert _runs(np.array([4, 5, 6, 9, 2, 3, 8])) == [(0, 3, 4), (3, 4, 9), (4, 6, 2), (6, 7, 8)]
    assert _runs(np.array([7])) == [(0, 1, 7)]


def test_plan_host_blocks_checks_the_budget() -> None:
    assert plan_host_blocks(100, 0) == 0 and plan_host_blocks(100, 250) == 2
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_host_blocks(100, 99)
    with pytest.raises(AssertionError):  # the door (EngineConfig) checks the type and sign
        plan_host_blocks(100, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_then_load_moves_every_layer_of_exactly_those_blocks(dtype: torch.dtype) -> None:
    k, v, host, copier = pools(dtype=dtype)
    device_ids = [7, 2, 3, 11, 0]  # runs and gaps on both sides
    host_ids = [4, 5, 6, 0, 9]
    done = copier.offload(device_ids, host_ids)
    assert done.complete and done.direction == OFFLOAD and done.nbytes == 5 * host.bytes_per_block
    assert_host_holds(host, k, v, zip(host_ids, device_ids, strict=True))
    before_k, before_v = k.clone(), v.clone()
    targets = [1, 10, 8, 4, 5]
    copier.load(host_ids, targets)
    for src, dst in zip(device_ids, targets, strict=True):
        assert torch.equal(k[:, dst], before_k[:, src]) and torch.equal(v[:, dst], before_v[:, src])
    untouched = [b for b in range(N) if b not in targets]
    assert torch.equal(k[:, untouched], before_k[:, untouched])
    assert torch.equal(v[:, untouched], before_v[:, untouched])


def test_an_empty_copy_does_nothing() -> None:
    k, _, _, copier = pools()
    before = k.clone()
    assert copier.load([], []).num_blocks == 0 and copier.offload([], []).complete
    assert torch.equal(k, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_goes_to_disk_and_comes_back_in_a_fresh_process(tmp_path, dtype) -> None:
    """device block -> host block -> file; then a new pool and store (a restart) -> host block ->
    another device block: the same K and V, bit for bit, in every layer."""
    k, v, host, copier = pools(dtype=dtype)
    fingerprint = {"test": "host_kv", "dtype": str(dtype)}

    def store() -> DiskStore:
        return DiskStore(
            tmp_path,
            fingerprint,
            block_size=B,
            block_nbytes=host.bytes_per_block,
            budget_bytes=10**7,
        )

    keys = chain_keys("t", np.arange(2 * B, dtype="<u4").tobytes(), B)
    copier.offload([5, 9], [0, 1])
    disk = store()
    for key, h in zip(keys, [0, 1], strict=True):
        assert disk.put(key, host.block_buffer(h))
    original = (k.clone(), v.clone())

    k2, v2, host2, copier2 = pools(dtype=dtype)
    k2.zero_()
    v2.zero_()
    disk2 = store()
    assert disk2.probe(keys) == 2
    for key, h in zip(keys, [3, 7], strict=True):
        assert disk2.get(key, host2.block_buffer(h))
    copier2.load([3, 7], [0, 1])
    assert torch.equal(k2[:, 0], original[0][:, 5]) and torch.equal(v2[:, 1], original[1][:, 9])
    assert torch.equal(k2[:, 1], original[0][:, 9]) and torch.equal(v2[:, 0], original[1][:, 5])


# ------------------------------------------------------------------------- fingerprint
def fingerprint_of(model, block_size: int = 16, dtype: torch.dtype = torch.float32) -> dict:
    cfg = model.config
    return kv_fingerprint(
        model,
        block_size=block_size,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        dtype=dtype,
        device=torch.device("cpu"),
    )


def test_the_fingerprint_tells_models_weights_and_layouts_apart() -> None:
    a = build_model("gqa", seed=0)
    same = fingerprint_of(a)
    assert fingerprint_of(build_model("gqa", seed=0)) == same  # the same checkpoint, rebuilt
    assert json.loads(json.dumps(same)) == same  # JSON all the way down
    assert fingerprint_of(build_model("gqa", seed=1))["weights"] != same["weights"]
    assert fingerprint_of(build_model("mha", seed=0))["config"] != same["config"]
    assert fingerprint_of(a, block_size=64) != same
    assert fingerprint_of(a, dtype=torch.bfloat16) != same
    # One weight changed in a sampled position: another digest.
    with torch.no_grad():
        a.model.norm.weight[0] += 1.0
    assert weights_digest(a) != same["weights"]


# --------------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_copies_match_and_never_wait_on_the_host() -> None:
    """On CUDA: a pinned pool; an offload or load returns while the compute stream is still busy
    (the host did not wait), sees what the compute stream wrote before it, and the compute stream
    sees the loaded blocks once it waits on the copy's event."""
    k, v, host, copier = pools(device="cuda")
    assert host.pinned and host.data.is_pinned()
    # First use allocates the side stream's staging and pinned index memory: not timed.
    copier.synchronize(copier.load([0, 1, 2], [0, 1, 2]))
    compute = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy for a while
    k[:, 3] = 7.0  # written by the compute stream after the sleep
    first = copier.offload([3, 4, 9], [2, 3, 8])
    assert not compute.query(), "offload() waited for the compute stream"
    copier.synchronize(first)
    assert torch.all(host.data[2, :, 0] == 7.0)
    assert_host_holds(host, k, v, [(2, 3), (3, 4), (8, 9)])

    torch.cuda._sleep(200_000_000)
    second = copier.load([2, 3, 8], [10, 11, 0])
    assert not compute.query() and not second.complete
    copier.order_before_compute(second)
    got = (k[:, [10, 11, 0]] + 0).cpu()  # read on the compute stream, after the wait
    torch.testing.assert_close(got, host.data[[2, 3, 8], :, 0].transpose(0, 1), rtol=0, atol=0)
    torch.cuda.synchronize()
    assert first.complete and second.complete


@pytest.mark.gpu
@cuda
def test_cuda_and_cpu_copies_agree() -> None:
    results = []
    for device in ("cpu", "cuda"):
        k, v, host, copier = pools(device=device, dtype=torch.bfloat16)
        copier.offload([1, 2, 3, 8, 5], [9, 0, 1, 2, 4])
        copier.load([0, 1, 9], [6, 7, 11])
        torch.cuda.synchronize()
        results.append((k.cpu(), v.cpu(), host.data.clone()))
    (k0, v0, h0), (k1, v1, h1) = results
    assert torch.equal(k0, k1) and torch.equal(v0, v1)
    used = [9, 0, 1, 2, 4]
    assert torch.equal(h0[used], h1[used])
