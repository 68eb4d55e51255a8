"""vLLM's and SGLang's Triton attention kernels (benchmarks/peer_kernels.py) against radixkv's torch
reference, under the interpreter: the launchers pass them our paged cache as their backends do,
so kernel_bench's peer columns time the same function on the same inputs. Skipped only when
`.peers/` was never fetched (`python3 -P benchmarks/peer_kernels.py fetch`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from radixkv.kernels import reference

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peer_kernels.py"


def _module():
    spec = importlib.util.spec_from_file_location("peer_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peer_kernels"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


peer_kernels = _module()
pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        not peer_kernels.fetched(),
        reason="not fetched: python3 -P benchmarks/peer_kernels.py fetch",
    ),
]


@pytest.fixture(scope="module")
def peers():
    loaded = peer_kernels.load()
    assert not [n for n in sys.modules if n.split(".")[0] in ("vllm", "sglang")]
    return loaded


def _check(peers, batch, name, dtype, assert_close, **options):
    expected = reference.paged_attention(*batch.args)
    out = torch.full_like(batch.q, float("nan"))  # every row must be written
    peer_kernels.LAUNCHERS[name](peers, peer_kernels.Batch.of(batch.args), out, **options)()
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [4, 16])
def test_vllm_decode_3d_matches_reference(peers, paged_batch, assert_close, dtype, block_size):
    """Fewer sequences than 128 / kv_heads: the 3D kernel, 16 segments, and their reduction."""
    batch = paged_batch([40, 17, 65], [1, 1, 1], block_size=block_size, group=4, dtype=dtype)
    _check(peers, batch, "vLLM", dtype, assert_close)


def test_vllm_decode_2d_matches_reference(peers, paged_batch, assert_close, monkeypatch):
    monkeypatch.setattr(peer_kernels, "VLLM_MIN_LAUNCH_GRID_SIZE_2D", 2)  # 2D from 2 sequences
    batch = paged_batch([40, 17, 65], [1, 1, 1], block_size=16, group=4)
    _check(peers, batch, "vLLM", torch.float32, assert_close)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("num_sms", [None, 132])
def test_sglang_decode_matches_reference(peers, paged_batch, assert_close, dtype, num_sms):
    """With cores to size against, its own split kernel picks each request's splits; without
    (a CPU), the backend's fallback: the most splits."""
    batch = paged_batch([40, 17, 65], [1, 1, 1], block_size=16, group=4, dtype=dtype)
    _check(peers, batch, "SGLang", dtype, assert_close, num_sms=num_sms)


@pytest.mark.parametrize("name", ["vLLM", "SGLang"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_extend_over_a_cached_prefix_matches_reference(
    peers, paged_batch, assert_close, name, dtype
):
    """Prefill over cached prefixes, a decode row among them, one request without a prefix."""
    batch = paged_batch([40, 23, 12], [9, 1, 12], block_size=4, group=4, dtype=dtype)
    _check(peers, batch, name, dtype, assert_close)
