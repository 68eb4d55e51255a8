"""The CPU backend (`radixkv.kernels.cpu_attention`: the compiled kernel for decode-sized
requests, torch's fused attention for prefill and extend) against the torch reference, on caches
whose unwritten slots hold NaN, with permuted block tables and lengths around block boundaries."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radixkv.kernels import AttentionKind, AttentionMetadata, cpu_attention, reference

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="no C compiler: the CPU backend is the reference"
)

KINDS = {
    "full": None,
    "window": AttentionKind(window=20),
    "softcap": AttentionKind(softcap=5.0),
    "sinks": AttentionKind(sinks=torch.linspace(-2.0, 2.0, 12)),
    "window+sinks": AttentionKind(window=7, sinks=torch.linspace(1.0, -1.0, 12)),
}


def _mixed(block_size: int) -> tuple[list[int], list[int]]:
    """Decode rows beside prefill / extend rows on both sides of `KERNEL_MAX_Q`:

    req 0: a 1-token prompt         req 1: decode at B-1       req 2: prefill of B+1 tokens
    req 3: extend of KERNEL_MAX_Q   req 4: extend of KERNEL_MAX_Q + 1 over 200 cached
    req 5: no new tokens
    """
    limit = cpu_attention.KERNEL_MAX_Q
    seq_lens = [1, max(block_size - 1, 1), block_size + 1, 40, 200 + limit + 1, 30]
    q_lens = [1, 1, block_size + 1, limit, limit + 1, 0]
    return seq_lens, q_lens


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_mixed_batch_matches_the_reference(
    paged_batch, assert_close, block_size, group, head_dim
) -> None:
    seq_lens, q_lens = _mixed(block_size)
    batch = paged_batch(seq_lens, q_lens, block_size=block_size, group=group, head_dim=head_dim)
    expected = reference.paged_attention(*batch.args)
    assert_close(cpu_attention.paged_attention(*batch.args), expected, torch.float32)


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_every_attention_kind_matches_the_reference(
    paged_batch, assert_close, kind, block_size
) -> None:
    seq_lens, q_lens = _mixed(block_size)
    batch = paged_batch(seq_lens, q_lens, block_size=block_size, num_kv_heads=3, group=4)
    expected = reference.paged_attention(*batch.args, kind=KINDS[kind])
    actual = cpu_attention.paged_attention(*batch.args, kind=KINDS[kind])
    assert_close(actual, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_caches_match_the_reference(paged_batch, assert_close, dtype) -> None:
    # bf16 through the kernel (it widens each value), fp16 through the reference's own path.
    seq_lens, q_lens = _mixed(16)
    batch = paged_batch(seq_lens, q_lens, block_size=16, group=2, dtype=dtype)
    expected = reference.paged_attention(*batch.args)
    actual = cpu_attention.paged_attention(*batch.args)
    assert actual.dtype == dtype
    assert_close(actual, expected, dtype)


def test_long_decode_rows_cross_many_chunks(paged_batch, assert_close) -> None:
    batch = paged_batch([1000, 17, 333], [1, 1, 1], block_size=16, group=3)
    expected = reference.paged_attention(*batch.args)
    assert_close(cpu_attention.paged_attention(*batch.args), expected, torch.float32)


def test_strided_q_and_a_strided_out_buffer(paged_batch, assert_close) -> None:
    # q sliced out of a fused projection, out a slice of a wider buffer: both honoured, and the
    # result is written into out.
    batch = paged_batch([40, 17, 60], [9, 1, 30], block_size=16, group=4)
    num_tokens, num_heads, head_dim = batch.q.shape
    qkv = torch.randn(num_tokens, num_heads + 4, head_dim)
    qkv[:, :num_heads] = batch.q
    wide = torch.zeros(num_tokens, 2 * num_heads, head_dim)
    out = wide[:, num_heads:]
    result = cpu_attention.paged_attention(qkv[:, :num_heads], *batch.args[1:], out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_close(out, reference.paged_attention(*batch.args), torch.float32)
    assert (wide[:, :num_heads] == 0).all()


def test_the_step_plan_is_built_once_and_reused_by_every_layer(paged_batch) -> None:
    seq_lens, q_lens = _mixed(16)
    batch = paged_batch(seq_lens, q_lens, block_size=16)
    metadata = AttentionMetadata(
        batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, tuple(batch.k_cache.shape)
    )
    first = cpu_attention.paged_attention_step(
        batch.q, batch.k_cache, batch.v_cache, metadata, batch.scale
    )
    plans = dict(metadata.step_plans)
    again = cpu_attention.paged_attention_step(
        batch.q, batch.k_cache, batch.v_cache, metadata, batch.scale
    )
    assert metadata.step_plans == plans and len(plans) == 1
    (plan,) = plans.values()
    limit = cpu_attention.KERNEL_MAX_Q
    kernel_rows = [r for r, q in enumerate(q_lens) if q <= limit]
    assert plan.kernel_requests.tolist() == kernel_rows
    assert len(plan.fused) == len(q_lens) - len(kernel_rows)
    assert torch.equal(first, again)


def _sharing(paged_batch, seq_lens, q_lens, shared_blocks, *, block_size, **kw):
    """A batch whose requests 1.. use request 0's first `shared_blocks[r]` blocks as their own
    (request 0 is the longest, so every shared slot is written): the prefix a radix tree serves
    to each of them, in the same physical blocks."""
    batch = paged_batch(seq_lens, q_lens, block_size=block_size, **kw)
    for r, n in enumerate(shared_blocks):
        batch.block_tables[r, :n] = batch.block_tables[0, :n]
    return batch


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kind", ["full", "softcap", "sinks"])
def test_requests_sharing_leading_blocks_match_the_reference(
    paged_batch, assert_close, block_size, kind
) -> None:
    # Decode and short extends over one shared prefix, a request whose context ends inside it,
    # one sharing less, and one sharing nothing; softcap and sinks send the long ones through
    # the kernel too.
    seq_lens = [300, 260, 261, 270, 90, 200, 150, 45]
    q_lens = [1, 1, 5, 8, 1, 3, 1, 12]
    per_block = 96 // block_size
    shared = [0, 2 * per_block, 2 * per_block, 2 * per_block, per_block, per_block // 2, 0, 0]
    batch = _sharing(
        paged_batch, seq_lens, q_lens, shared, block_size=block_size, num_kv_heads=3, group=4
    )
    expected = reference.paged_attention(*batch.args, kind=KINDS[kind])
    assert_close(
        cpu_attention.paged_attention(*batch.args, kind=KINDS[kind]), expected, torch.float32
    )


def test_the_plan_groups_requests_by_their_shared_blocks(paged_batch) -> None:
    seq_lens, q_lens = [300, 260, 261, 90, 200, 30], [1, 1, 5, 1, 1, 1]
    batch = _sharing(paged_batch, seq_lens, q_lens, [0, 12, 12, 5, 1, 2], block_size=16)
    metadata = AttentionMetadata(
        batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, tuple(batch.k_cache.shape)
    )
    cpu_attention.paged_attention_step(batch.q, batch.k_cache, batch.v_cache, metadata, batch.scale)
    (plan,) = metadata.step_plans.values()
    starts = plan.group_starts.tolist()
    groups = [plan.members[a:b].tolist() for a, b in itertools.pairwise(starts)]
    # 0-3 share at least two blocks (32 keys); 4 shares one block only, 5 has 29 cached keys.
    assert groups == [[0, 1, 2, 3], [4], [5]]
    # 3's table shares 5 blocks, its context 89 keys: the group shares 80.
    assert plan.group_shared.tolist() == [80, 0, 0]


def test_more_sharing_requests_than_one_item_holds(paged_batch, assert_close) -> None:
    # 21 requests with 1 or 3 new tokens over one prefix: several work items, each reading it.
    n = 21
    seq_lens = [400] + [130 + 7 * r for r in range(1, n)]
    q_lens = [1 + 2 * (r % 2) for r in range(n)]
    batch = _sharing(paged_batch, seq_lens, q_lens, [8] * n, block_size=16, group=3)
    expected = reference.paged_attention(*batch.args)
    assert_close(cpu_attention.paged_attention(*batch.args), expected, torch.float32)
    torch.set_num_threads(2)  # the kernel tests' fixture restores one thread afterwards
    assert_close(cpu_attention.paged_attention(*batch.args), expected, torch.float32)


def test_sharing_requests_without_new_tokens(paged_batch, assert_close) -> None:
    # Members with no query rows take no room in an item, but an item holds at most TILE_Q
    # members: 40 requests over one prefix, most of them with nothing new this step.
    n = 40
    seq_lens = [200] + [100 + r for r in range(1, n)]
    q_lens = [1 if r % 9 == 0 else 0 for r in range(n)]
    batch = _sharing(paged_batch, seq_lens, q_lens, [5] * n, block_size=16, group=2)
    expected = reference.paged_attention(*batch.args)
    assert_close(cpu_attention.paged_attention(*batch.args), expected, torch.float32)


def test_a_sliding_window_never_shares(paged_batch, assert_close) -> None:
    batch = _sharing(paged_batch, [300, 280, 290], [1, 1, 1], [0, 10, 10], block_size=16, group=2)
    kind = AttentionKind(window=50)
    expected = reference.paged_attention(*batch.args, kind=kind)
    assert_close(cpu_attention.paged_attention(*batch.args, kind=kind), expected, torch.float32)


def test_two_threads_give_the_one_thread_result(paged_batch) -> None:
    batch = paged_batch([300, 1, 90, 45], [1, 1, 1, 1], block_size=16, group=3)
    one = cpu_attention.paged_attention(*batch.args)
    torch.set_num_threads(2)  # the kernel tests' fixture restores one thread afterwards
    assert torch.equal(cpu_attention.paged_attention(*batch.args), one)


def test_an_empty_batch(paged_batch) -> None:
    batch = paged_batch([5], [0], block_size=16)
    assert cpu_attention.paged_attention(*batch.args).shape == (0, 2, 64)


def test_without_a_compiler_the_reference_runs(tmp_path) -> None:
    # No compiler and nothing built yet: the CPU backend is the reference, said once in the log.
    script = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        import radixkv.kernels as k
        assert not k.cpu_attention.available()
        assert k.backend_for(torch.device("cpu")) == "torch"
        cache = torch.zeros(4, 2, 1, 8)
        out = k.paged_attention(torch.ones(1, 2, 8), cache, cache, torch.tensor([[0, 1]],
                                dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32), 0.5)
        assert out.shape == (1, 2, 8)
        print("ok")
        """
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "RADIXKV_KERNEL_CACHE": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert result.stderr.count("CPU attention kernel unavailable") == 1


def test_a_build_lands_in_the_cache_folder_once(tmp_path) -> None:
    script = "import radixkv.kernels.cpu_attention as c; assert c.available(); print('ok')"
    env = {**os.environ, "RADIXKV_KERNEL_CACHE": str(tmp_path)}
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
    built = [p.name for p in tmp_path.iterdir()]
    assert len(built) == 1 and built[0].startswith("cpu_attention-") and built[0].endswith(".so")
