"""A step's integer inputs packed into one flat int32 buffer: one host->device copy per step.

    | input_ids | positions | slot_mapping | block_tables (num_reqs x max_blocks) | seq_lens |
    | cu_seqlens_q (num_reqs + 1) | sample_idx | copy_src | copy_dst | copy_slots |

`StepLayout` names the regions, `pack_step` fills them on the host from the scheduler's rows (and,
for a CUDA-graph bucket, pad rows up to the bucket), `InputStager` owns the host buffer: pinned and
reused on CUDA (copied with `non_blocking=True`), a fresh array on the CPU (the tensors are views of
it, nothing is copied), and `split_step` builds the step's attention metadata over the copy.
int32 throughout: the kernels take int32 block tables and lengths, and the embedding, rotary
positions and logits index accept int32 ids.

A pad row is a decode row that writes nothing and reads something harmless: token 0 at position 0,
slot -1 (`store_kv` skips it), seq_len 1 over block 0 of its (zeroed) block-table row; its output
row is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from radixkv.kernels import AttentionMetadata
from radixkv.scheduler.output import BlockCopy, ScheduledRequest

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

PAD_TOKEN_ID = 0
PAD_SLOT = -1  # store_kv skips negative slots
# What AttentionMetadata reads from the host (its `host_tensors`), in its order.
_METADATA_REGIONS = ("block_tables", "seq_lens", "cu_seqlens_q", "slot_mapping")


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Sizes of the regions of one step's flat buffer (see the module docstring)."""

    num_tokens: int  # query tokens, pad rows included
    num_reqs: int  # rows, pad rows included
    max_blocks: int  # block-table columns
    num_sampled: int = 0  # rows whose last token's logits are kept
    num_copies: int = 0  # copy-on-write block copies

    def sizes(self) -> tuple[tuple[str, int], ...]:
        t, r = self.num_tokens, self.num_reqs
        return (
            ("input_ids", t),
            ("positions", t),
            ("slot_mapping", t),
            ("block_tables", r * self.max_blocks),
            ("seq_lens", r),
            ("cu_seqlens_q", r + 1),
            ("sample_idx", self.num_sampled),
            ("copy_src", self.num_copies),
            ("copy_dst", self.num_copies),
            ("copy_slots", self.num_copies),
        )

    @property
    def total(self) -> int:
        return sum(n for _, n in self.sizes())

    def split(self, flat: ArrayT) -> dict[str, ArrayT]:
        """Views of `flat` (a numpy array or a tensor, host or device, at least `total` long) by
        region name; block_tables as [num_reqs, max_blocks]."""
        assert flat.shape[0] >= self.total, f"buffer of {flat.shape[0]} < {self.total}"
        views = {}
        start = 0
        for name, n in self.sizes():
            views[name] = flat[start : start + n]
            start += n
        views["block_tables"] = views["block_tables"].reshape(self.num_reqs, self.max_blocks)
        return views


def layout_for(rows: Sequence[ScheduledRequest], *, num_copies: int = 0) -> StepLayout:
    """The eager layout of `rows`: exact sizes, the sampled rows' indices kept."""
    return StepLayout(
        num_tokens=sum(len(r.token_ids) for r in rows),
        num_reqs=len(rows),
        max_blocks=max(len(r.block_table) for r in rows),
        num_sampled=sum(r.sample for r in rows),
        num_copies=num_copies,
    )


def bucket_layout(bucket: int, max_blocks: int) -> StepLayout:
    """The layout of a CUDA-graph decode bucket: `bucket` one-token rows (pad rows included)
    whose logits are all kept (no sample_idx), over `max_blocks` block-table columns."""
    return StepLayout(bucket, bucket, max_blocks)


def split_step(
    layout: StepLayout,
    host: torch.Tensor,
    dev: torch.Tensor,
    kv_cache_shape: tuple[int, ...],
    *,
    validate: bool = True,
) -> tuple[dict[str, torch.Tensor], AttentionMetadata]:
    """The device views of a packed step (`layout.split(dev)`) and its attention metadata over
    them; the metadata's values are read from the host copy `host` of `dev`, so nothing syncs."""
    views, on_host = layout.split(dev), layout.split(host)
    meta = AttentionMetadata(
        views["block_tables"],
        views["seq_lens"],
        views["cu_seqlens_q"],
        kv_cache_shape,
        slot_mapping=views["slot_mapping"],
        validate=validate,
        host_tensors=tuple(on_host[name] for name in _METADATA_REGIONS),
    )
    return views, meta


def pack_step(
    rows: Sequence[ScheduledRequest],
    copies: Sequence[BlockCopy],
    block_size: int,
    layout: StepLayout,
    flat: np.ndarray,
) -> None:
    """Fill `flat[:layout.total]` (int32) with the rows, then pad rows up to `layout.num_reqs`,
    then the copies. Mutates `flat` only.

        row 0                     row 1        row 2 (decode)   pad rows
        |--- q_len 0 ---|--------- q_len 1 ---|q|               |0|0|
        positions: start_0 .. start_0+q_len0-1 | start_1 .. | start_2 | 0 | 0
    """
    B = block_size
    v = layout.split(flat)
    tables = v["block_tables"]
    tables.fill(0)
    t = s = 0
    for i, row in enumerate(rows):
        q_len = len(row.token_ids)
        end = row.start_position + q_len
        assert q_len > 0, f"row {row.request_id} has no tokens"
        assert len(row.block_table) * B >= end, (
            f"row {row.request_id}: {len(row.block_table)} blocks cannot hold {end} tokens"
        )
        tables[i, : len(row.block_table)] = row.block_table
        pos = np.arange(row.start_position, end, dtype=np.int32)
        v["input_ids"][t : t + q_len] = row.token_ids
        v["positions"][t : t + q_len] = pos
        v["slot_mapping"][t : t + q_len] = tables[i, pos // B] * B + pos % B
        v["seq_lens"][i] = end
        v["cu_seqlens_q"][i] = t
        t += q_len
        if row.sample and layout.num_sampled:
            v["sample_idx"][s] = t - 1
            s += 1
    num_pad = layout.num_reqs - len(rows)
    assert t + num_pad == layout.num_tokens, f"{t} tokens + {num_pad} pad rows != layout"
    assert s == layout.num_sampled, f"{s} sampled rows != layout's {layout.num_sampled}"
    for name, value in (("input_ids", PAD_TOKEN_ID), ("positions", 0), ("slot_mapping", PAD_SLOT)):
        v[name][t:] = value
    v["seq_lens"][len(rows) :] = 1
    v["cu_seqlens_q"][len(rows) :] = np.arange(t, t + num_pad + 1, dtype=np.int32)
    assert len(copies) == layout.num_copies, f"{len(copies)} copies != layout's"
    for j, c in enumerate(copies):
        v["copy_src"][j] = c.src_block
        v["copy_dst"][j] = c.dst_block
        v["copy_slots"][j] = c.num_slots


class InputStager:
    """The host side of a step's one copy: `host(n)` hands out an int32 buffer to fill,
    `to_device(host, out)` copies it to the device in one go.

    On CUDA the buffer is pinned and reused, so the copy is asynchronous; before handing it out
    again, `host` waits for the previous copy (an event, long done by then: the step's sampling
    has read its results back). On the CPU, every call returns a fresh array whose tensors the
    step uses directly.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._pinned = torch.empty(capacity, dtype=torch.int32, pin_memory=True)

    def host(self, n: int) -> torch.Tensor:
        """An int32 CPU tensor of `n` elements to fill (its `.numpy()` is a view)."""
        if self._pinned is None:
            return torch.from_numpy(np.empty(n, dtype=np.int32))
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._pinned.shape[0] < n:
            self._pinned = torch.empty(2 * n, dtype=torch.int32, pin_memory=True)
        return self._pinned[:n]

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`host` on the device (into `out[:len(host)]` when given): one non-blocking copy on
        CUDA; on the CPU `host` itself (or `out` filled from it)."""
        if out is None:
            if self.device.type == "cpu":
                return host
            out = torch.empty(host.shape[0], dtype=torch.int32, device=self.device)
        out[: host.shape[0]].copy_(host, non_blocking=True)
        if self._pinned is not None:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out
