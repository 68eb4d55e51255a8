"""Paged attention on a CPU through a small compiled kernel (`cpu_attention.c`), beside the torch
reference it is checked against.

The torch reference is the spec, and it is slow on a CPU for reasons no torch op avoids: it
gathers every request's context out of the paged cache in every layer (the copy is as large as the
K/V it reads, and the attention then reads it again), pads decode rows into batches and
materialises their score matrices. The kernel reads K and V in place through the block table with
an online softmax, as vLLM's and SGLang's CPU backends do with their own C++ kernels (see
`benchmarks/RESULTS.md`, CPU attention, for what it saves).

It is plain C99 with OpenMP, compiled at first use for this machine (`-O3 -march=native`,
`cpu_build.py`); a process that cannot build it (no compiler) says so once in the log and runs the
torch reference. Threads: the kernel splits its work over
`torch.get_num_threads()` threads of the OpenMP runtime torch already loaded.

`available()` says whether it loaded; `dispatch` sends CPU tensors here when it did. Every other
kernel name re-exports the reference's.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from radixkv.kernels import cpu_build
from radixkv.kernels.attention_kind import AttentionKind, check_kind
from radixkv.kernels.metadata import AttentionMetadata, call_metadata, check_attention_step
from radixkv.kernels.reference import (
    copy_blocks,
    rms_norm,
    rope_store_kv,
    rope_store_kv_step,
    store_kv,
    store_kv_step,
)
from radixkv.kernels.reference import paged_attention_step as reference_attention_step

__all__ = [
    "available",
    "copy_blocks",
    "paged_attention",
    "paged_attention_step",
    "rms_norm",
    "rope_store_kv",
    "rope_store_kv_step",
    "store_kv",
    "store_kv_step",
]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.c")
# Requests with at most this many new tokens (decode, short extends) attend in the compiled
# kernel, which is memory-bound there and reads K/V in place; longer ones (prefill, extend) in
# torch's fused CPU attention over a gathered copy of their context, which is compute-bound and
# whose copy is small beside its arithmetic (benchmarks/RESULTS.md, CPU attention).
KERNEL_MAX_Q = 8
# The cache dtypes the kernel reads; other dtypes (fp16) run the torch reference.
KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16)
# Query tokens of one work item of the kernel (TILE_Q in cpu_attention.c): requests sharing a
# prefix are attended together up to this many new tokens at once.
TILE_Q = 16
# Requests whose first this-many keys sit in the same blocks attend to their common blocks
# together (read once for all of them); shorter common prefixes are not worth the grouping.
SHARED_MIN_KEYS = 32
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c99")


class _Args(ctypes.Structure):
    """`Args` of cpu_attention.c, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("cu_seqlens_q", ctypes.c_void_p),
        ("sinks", ctypes.c_void_p),
        ("members", ctypes.c_void_p),
        ("group_starts", ctypes.c_void_p),
        ("group_shared", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("k_block_stride", ctypes.c_int64),
        ("k_token_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("v_block_stride", ctypes.c_int64),
        ("v_token_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("num_groups", ctypes.c_int32),
        ("max_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_q_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("cache_is_bf16", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
    ]


def available() -> bool:
    """Whether the compiled kernel is loaded (building it on the first call)."""
    return _library() is not None


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    kind: AttentionKind | None = None,
) -> torch.Tensor:
    """`reference.paged_attention`'s contract; metadata built (and checked) for this one call."""
    del num_kv_splits
    metadata = call_metadata(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out)
    return paged_attention_step(q, k_cache, v_cache, metadata, scale, out=out, kind=kind)


def paged_attention_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    kind: AttentionKind | None = None,
) -> torch.Tensor:
    """`reference.paged_attention_step`'s contract and result (to fp32 rounding), computed by the
    compiled kernel; the reference where the kernel does not apply (an fp16 cache, tensors off
    the CPU, no kernel)."""
    library = _library()
    if library is None or k_cache.dtype not in KERNEL_CACHE_DTYPES or k_cache.device.type != "cpu":
        return reference_attention_step(
            q, k_cache, v_cache, metadata, scale, out=out, num_kv_splits=num_kv_splits, kind=kind
        )
    check_attention_step(q, k_cache, v_cache, metadata, scale, out)
    kind = check_kind(q, kind)
    if out is None:
        out = torch.empty_like(q)
    if metadata.num_reqs == 0 or q.shape[0] == 0:
        return out
    plan = _step_plan(metadata, kind)
    for row in plan.fused:
        _fused_attention(q, k_cache, v_cache, row, scale, kind.window, out)
    if plan.members.numel():
        _kernel_attention(library, q, k_cache, v_cache, metadata, plan, scale, kind, out)
    return out


@dataclass(frozen=True, slots=True)
class _FusedRow:
    """A request that attends in torch's fused attention: its query rows, the blocks of its
    context and, for an extend or a window, the mask of what each query sees."""

    q_rows: slice
    blocks: torch.Tensor  # int32 [ceil(seq_len / block_size)]
    seq_len: int
    mask: torch.Tensor | None  # bool [q_len, seq_len]; None: causal prefill (q_len == seq_len)


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """How one step's requests split between the kernel and torch's fused attention, and the
    kernel's requests into groups that share leading blocks (built on the first layer, reused by
    the others of the same window)."""

    kernel_requests: torch.Tensor | None  # int32, ascending; None: every request
    fused: tuple[_FusedRow, ...]
    members: torch.Tensor  # int32: the kernel's requests, group by group
    group_starts: torch.Tensor  # int32 [groups + 1]: each group's first index into members
    group_shared: torch.Tensor  # int32 [groups]: keys the group's members share (0: alone)


def _step_plan(metadata: AttentionMetadata, kind: AttentionKind) -> _StepPlan:
    # torch's fused attention has neither soft-capping nor sinks: such layers take the kernel.
    fused_ok = kind.softcap is None and kind.sinks is None
    key = ("cpu_attention", fused_ok, kind.window)
    plan = metadata.step_plans.get(key)
    if plan is None:
        plan = _build_plan(metadata, kind.window, fused_ok)
        metadata.step_plans[key] = plan
    return plan  # type: ignore[return-value]


def _build_plan(metadata: AttentionMetadata, window: int | None, fused_ok: bool) -> _StepPlan:
    cu, lens = metadata.cu_seqlens_q_host, metadata.seq_lens_host
    block_size = metadata.kv_cache_shape[1]
    kernel, fused = [], []
    for r, seq_len in enumerate(lens):
        q_len = cu[r + 1] - cu[r]
        if not fused_ok or q_len <= KERNEL_MAX_Q:
            kernel.append(r)
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_tables[r, :num_blocks]
        mask = None
        if q_len != seq_len or (window is not None and window < seq_len):
            position = torch.arange(seq_len - q_len, seq_len)[:, None]  # each query's
            key = torch.arange(seq_len)[None, :]
            mask = key <= position
            if window is not None:
                mask &= position - key < window
        fused.append(_FusedRow(slice(cu[r], cu[r + 1]), blocks, seq_len, mask))
    groups = [[r] for r in kernel] if window is not None else _shared_groups(metadata, kernel)
    shared = [_shared_keys(metadata, g) if len(g) > 1 else 0 for g in groups]
    every = len(kernel) == len(lens)
    return _StepPlan(
        kernel_requests=None if every else torch.tensor(kernel, dtype=torch.int32),
        fused=tuple(fused),
        members=torch.tensor([r for g in groups for r in g], dtype=torch.int32),
        group_starts=torch.tensor([0, *itertools.accumulate(map(len, groups))], dtype=torch.int32),
        group_shared=torch.tensor(shared, dtype=torch.int32),
    )


def _shared_groups(metadata: AttentionMetadata, kernel: list[int]) -> list[list[int]]:
    """The kernel's requests grouped by the blocks that hold their first SHARED_MIN_KEYS keys (the
    same physical blocks: a prefix the cache serves to each of them), in order of first appearance;
    a request with fewer cached keys, or more than TILE_Q new tokens, alone."""
    cu, lens = metadata.cu_seqlens_q_host, metadata.seq_lens_host
    lead = -(-SHARED_MIN_KEYS // metadata.kv_cache_shape[1])
    groups: dict[object, list[int]] = {}
    for r in kernel:
        q_len = cu[r + 1] - cu[r]
        if q_len > TILE_Q or lens[r] - q_len < SHARED_MIN_KEYS:
            groups[("alone", r)] = [r]
            continue
        groups.setdefault(tuple(metadata.block_tables[r, :lead].tolist()), []).append(r)
    return list(groups.values())


def _shared_keys(metadata: AttentionMetadata, group: list[int]) -> int:
    """How many leading keys every request of `group` holds in the same blocks and sees from
    each of its queries: whole common blocks, capped at the shortest cached context."""
    cu, lens = metadata.cu_seqlens_q_host, metadata.seq_lens_host
    block_size = metadata.kv_cache_shape[1]
    cached = min(lens[r] - (cu[r + 1] - cu[r]) for r in group)
    tables = metadata.block_tables[group, : -(-cached // block_size)]
    same = (tables == tables[0]).all(dim=0).int().cumprod(dim=0)
    return min(int(same.sum()) * block_size, cached)


def _fused_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: _FusedRow,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """One request's attention in torch's fused CPU kernel over a gathered copy of its context."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    k = k_cache.index_select(0, row.blocks).view(-1, num_kv_heads, head_dim)[: row.seq_len]
    v = v_cache.index_select(0, row.blocks).view(-1, num_kv_heads, head_dim)[: row.seq_len]
    # [1, heads, tokens, head_dim] views, as the fused kernel takes them
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q[row.q_rows], k, v))
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=row.mask, is_causal=row.mask is None, scale=scale, enable_gqa=True
    )
    out[row.q_rows] = o[0].transpose(0, 1)


def _kernel_attention(
    library: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    plan: _StepPlan,
    scale: float,
    kind: AttentionKind,
    out: torch.Tensor,
) -> None:
    """The plan's kernel requests through the compiled kernel, into `out`."""
    # The kernel reads fp32 queries and writes a contiguous fp32 result.
    q32 = q if q.dtype == torch.float32 else q.float()
    direct = out.dtype == torch.float32 and out.is_contiguous()
    result = out if direct else torch.empty(q.shape, dtype=torch.float32)
    tables, lens, cu = _index_tensors(metadata)
    sinks = None if kind.sinks is None else kind.sinks.float().contiguous()
    requests = plan.kernel_requests
    args = _Args(
        q=q32.data_ptr(),
        k_cache=k_cache.data_ptr(),
        v_cache=v_cache.data_ptr(),
        out=result.data_ptr(),
        block_tables=tables.data_ptr(),
        seq_lens=lens.data_ptr(),
        cu_seqlens_q=cu.data_ptr(),
        sinks=None if sinks is None else sinks.data_ptr(),
        members=plan.members.data_ptr(),
        group_starts=plan.group_starts.data_ptr(),
        group_shared=plan.group_shared.data_ptr(),
        q_token_stride=q32.stride(0),
        q_head_stride=q32.stride(1),
        k_block_stride=k_cache.stride(0),
        k_token_stride=k_cache.stride(1),
        k_head_stride=k_cache.stride(2),
        v_block_stride=v_cache.stride(0),
        v_token_stride=v_cache.stride(1),
        v_head_stride=v_cache.stride(2),
        num_groups=plan.group_shared.shape[0],
        max_blocks=tables.shape[1],
        block_size=k_cache.shape[1],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        window=kind.window or 0,
        cache_is_bf16=int(k_cache.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
        scale=scale,
        softcap=kind.softcap or 0.0,
    )
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be unit-stride"
    if library.radixkv_paged_attention(ctypes.byref(args)) != 0:
        raise MemoryError("the CPU attention kernel could not allocate its scratch memory")
    if direct:
        return
    if requests is None:
        out.copy_(result)
        return
    for r in requests.tolist():  # only the kernel's rows: the fused ones are already in out
        rows = slice(metadata.cu_seqlens_q_host[r], metadata.cu_seqlens_q_host[r + 1])
        out[rows] = result[rows]


def _index_tensors(
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata's block tables, lengths and query offsets as contiguous int32 CPU tensors (the
    engine's already are: then nothing is copied)."""
    return tuple(  # type: ignore[return-value]
        t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
        for t in (metadata.block_tables, metadata.seq_lens, metadata.cu_seqlens_q)
    )


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built into the cache folder if it is not there yet; None when it
    cannot be built or loaded (logged once)."""
    library = cpu_build.load(SOURCE, _FLAGS, "CPU attention kernel")
    if library is not None:
        library.radixkv_paged_attention.argtypes = [ctypes.POINTER(_Args)]
        library.radixkv_paged_attention.restype = ctypes.c_int
    return library
