"""A step's integer inputs packed into one flat int32 buffer: one host->device copy per step.

    | input_ids | positions | slot_mapping | block_tables (num_reqs x max_blocks) | seq_lens |
    | cu_seqlens_q (num_reqs + 1) | sample_idx | copy_src | copy_dst | copy_slots |
    and for each KV cache group g >= 1 (`radixkv.cache.grouped`: a model with window layers has
    two groups) its own slots, block tables (as wide as the first group's) and copies:
    | slot_mapping.g | block_tables.g | copy_src.g | copy_dst.g | copy_slots.g |

`StepLayout` names the regions, `pack_step` fills them on the host from the scheduler's rows (and,
for a CUDA-graph bucket, pad rows up to the bucket), `InputStager` owns the host buffer: pinned and
reused on CUDA (copied with `non_blocking=True`), a fresh array on the CPU (the tensors are views of
it, nothing is copied), and `split_step` builds the step's attention metadata over the copy.
`stage_step` does all of it for an eager step, in one call from the runner.
int32 throughout: the kernels take int32 block tables and lengths, and the embedding, rotary
positions and logits index accept int32 ids. The regions' offsets move with the step's shape, so
their alignment does too: the Triton kernels are marked not to specialize on the alignment of these
pointers (one compiled variant for every step; see `radixkv.kernels.triton_paged_attention`).

A pad row is a decode row that writes nothing and reads something harmless: token 0 at position 0,
slot -1 (`store_kv` skips it), seq_len 1 over block 0 of its (zeroed) block-table row; its output
row is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from radixkv.kernels import AttentionMetadata
from radixkv.scheduler.output import BlockCopy, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from radixkv.engine.step.kv_tensors import StepPlan

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

PAD_TOKEN_ID = 0
PAD_SLOT = -1  # store_kv skips negative slots
_GROUP_REGIONS = ("slot_mapping", "block_tables", "copy_src", "copy_dst", "copy_slots")


def region(name: str, group: int) -> str:
    """The name of a KV cache group's own region (`_GROUP_REGIONS`): group 0's is the bare name."""
    return name if group == 0 else f"{name}.{group}"


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Sizes of the regions of one step's flat buffer (see the module docstring)."""

    num_tokens: int  # query tokens, pad rows included
    num_reqs: int  # rows, pad rows included
    max_blocks: int  # block-table columns
    num_sampled: int = 0  # rows whose last token's logits are kept
    # copy-on-write block copies per KV cache group, one entry per group
    num_copies: tuple[int, ...] = (0,)

    @property
    def num_groups(self) -> int:
        return len(self.num_copies)

    def sizes(self) -> tuple[tuple[str, int], ...]:
        t, r, c = self.num_tokens, self.num_reqs, self.num_copies[0]
        regions = [
            ("input_ids", t),
            ("positions", t),
            ("slot_mapping", t),
            ("block_tables", r * self.max_blocks),
            ("seq_lens", r),
            ("cu_seqlens_q", r + 1),
            ("sample_idx", self.num_sampled),
            ("copy_src", c),
            ("copy_dst", c),
            ("copy_slots", c),
        ]
        for g, c in enumerate(self.num_copies[1:], 1):
            sizes = (t, r * self.max_blocks, c, c, c)
            regions += [(region(name, g), n) for name, n in zip(_GROUP_REGIONS, sizes, strict=True)]
        return tuple(regions)

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
        for g in range(self.num_groups):
            name = region("block_tables", g)
            views[name] = views[name].reshape(self.num_reqs, self.max_blocks)
        return views


def layout_for(
    rows: Sequence[ScheduledRequest], *, num_copies: tuple[int, ...] | None = None
) -> StepLayout:
    """The eager layout of `rows`: exact sizes, the sampled rows' indices kept, regions for
    every KV cache group the rows carry tables of (`num_copies`: copies per group; None:
    none)."""
    num_groups = len(rows[0].block_tables)
    return StepLayout(
        num_tokens=sum(len(r.token_ids) for r in rows),
        num_reqs=len(rows),
        max_blocks=max(len(r.block_tables[0]) for r in rows),
        num_sampled=sum(r.sample for r in rows),
        num_copies=(0,) * num_groups if num_copies is None else num_copies,
    )


def bucket_layout(bucket: int, max_blocks: int, num_groups: int = 1) -> StepLayout:
    """The layout of a CUDA-graph decode bucket: `bucket` one-token rows (pad rows included)
    whose logits are all kept (no sample_idx), over `max_blocks` block-table columns, for
    `num_groups` KV cache groups."""
    return StepLayout(bucket, bucket, max_blocks, num_copies=(0,) * num_groups)


def split_step(
    layout: StepLayout,
    host: torch.Tensor,
    dev: torch.Tensor,
    kv_shapes: Sequence[tuple[int, ...]],
    *,
    validate: bool = True,
    plans: Sequence[StepPlan | None] = (),
) -> tuple[dict[str, torch.Tensor], tuple[Any, ...]]:
    """The device views of a packed step (`layout.split(dev)`) and the attention metadata of
    each KV cache group over them (`kv_shapes[g]`: one layer's KV shape of group g): its own
    block tables and slots, the same lengths; for a group with a plan (`plans[g]`, see
    `kv_tensors.StepPlan`), what the plan makes of it. The metadata's values are read from the
    host copy `host` of `dev`, so nothing syncs."""
    views, on_host = layout.split(dev), layout.split(host)
    # NOTE: `map`, not a loop: the step's walk then ends here, without a return to this file.
    metadata = partial(_metadata, views, on_host, validate=validate)
    metas = map(metadata, range(len(kv_shapes)), kv_shapes)  # lazy: built where it is consumed
    if not any(plans):
        return views, tuple(metas)
    tables = [on_host[region("block_tables", g)] for g in range(len(kv_shapes))]
    planned = (m if p is None else p(m, t) for m, p, t in zip(metas, plans, tables, strict=True))
    return views, tuple(planned)


def stage_step(
    step: SchedulerOutput,
    stager: InputStager,
    kv_shapes: Sequence[tuple[int, ...]],
    *,
    block_size: int,
    vocab_size: int,
    validate: bool,
    plans: Sequence[StepPlan | None] = (),
) -> tuple[dict[str, torch.Tensor], tuple[Any, ...]]:
    """An eager step's inputs on the device, packed and copied in one go: `split_step` over
    its buffer. The KV shapes are one layer's per group, as `split_step` takes them, and so
    are the groups' plans."""
    copies = [step.plan(g).copies for g in range(len(kv_shapes))]
    layout = layout_for(step.rows, num_copies=tuple(map(len, copies)))
    host, dev = stager.stage(step.rows, copies, block_size, layout)
    ids = host.numpy()[: layout.num_tokens]
    # On the host: an id past the embedding would be a device-side assert on CUDA, which
    # leaves the whole process unable to run another step.
    assert ids.min() >= 0 and ids.max() < vocab_size, "token id out of range"
    return split_step(layout, host, dev, kv_shapes, validate=validate, plans=plans)


def _metadata(
    views: dict[str, torch.Tensor],
    on_host: dict[str, torch.Tensor],
    group: int,
    kv_cache_shape: tuple[int, ...],
    validate: bool,
) -> AttentionMetadata:
    """Attention metadata over the device views of group `group`'s block tables and slots and
    the shared seq_lens and cu_seqlens_q, its values read from their host copies (its
    `host_tensors`, in its order)."""
    regions = (region("block_tables", group), "seq_lens", "cu_seqlens_q")
    slots = region("slot_mapping", group)
    return AttentionMetadata(
        *(views[name] for name in regions),
        kv_cache_shape,
        slot_mapping=views[slots],
        validate=validate,
        host_tensors=tuple(on_host[name] for name in (*regions, slots)),
    )


def pack_step(
    rows: Sequence[ScheduledRequest],
    copies: Sequence[Sequence[BlockCopy]],
    block_size: int,
    layout: StepLayout,
    flat: np.ndarray,
) -> None:
    """Fill `flat[:layout.total]` (int32) with the rows, then pad rows up to `layout.num_reqs`,
    then each KV cache group's copies (`copies[g]`; groups past its end have none). Mutates
    `flat` only.

        row 0                     row 1        row 2 (decode)   pad rows
        |--- q_len 0 ---|--------- q_len 1 ---|q|               |0|0|
        positions: start_0 .. start_0+q_len0-1 | start_1 .. | start_2 | 0 | 0

    Numpy over all rows at once: one pass reads the rows' scalars, one `np.fromiter` each their
    tokens and block ids (numpy calls per row cost about 15 µs a row, 1 ms a step at 64 rows).
    """
    B, n = block_size, len(rows)
    v = layout.split(flat)
    per_row = [(len(r.token_ids), r.start_position, len(r.block_tables[0]), r.sample) for r in rows]
    q_lens, starts, widths, sample = np.array(per_row, dtype=np.int64).reshape(n, 4).T
    ends = starts + q_lens
    assert n == 0 or q_lens.min() > 0, "a row has no tokens"
    assert (widths * B >= ends).all(), "a row's block table cannot hold its tokens"
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    t = int(cu[-1])

    used = np.arange(layout.max_blocks) < widths[:, None]  # [n, max_blocks], row-major like rows
    if t == n:  # decode rows only (every graph replay): one token each, at its start
        token_row, pos = np.arange(n), starts
    else:
        token_row = np.repeat(np.arange(n), q_lens)
        pos = np.arange(t) + np.repeat(starts - cu[:-1], q_lens)  # start + index within the row
    v["input_ids"][:t] = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int32, t)
    v["positions"][:t] = pos
    for g in range(layout.num_groups):  # every group's table is as wide as the first's
        tables = v[region("block_tables", g)]
        tables.fill(0)
        tables[:n][used] = np.fromiter(
            chain.from_iterable(r.block_tables[g] for r in rows), np.int32, int(widths.sum())
        )
        slots = v[region("slot_mapping", g)]
        slots[:t] = tables[token_row, pos // B] * B + pos % B
        slots[t:] = PAD_SLOT
        group_copies = copies[g] if g < len(copies) else ()
        assert len(group_copies) == layout.num_copies[g], f"group {g}'s copies != layout's"
        if group_copies:
            v[region("copy_src", g)][:] = [c.src_block for c in group_copies]
            v[region("copy_dst", g)][:] = [c.dst_block for c in group_copies]
            v[region("copy_slots", g)][:] = [c.num_slots for c in group_copies]
    v["seq_lens"][:n] = ends
    v["cu_seqlens_q"][:n] = cu[:-1]
    if layout.num_sampled:
        sampled = np.flatnonzero(sample)
        assert sampled.shape[0] == layout.num_sampled, f"{sampled.shape[0]} sampled rows != layout"
        v["sample_idx"][:] = cu[sampled + 1] - 1
    num_pad = layout.num_reqs - n
    assert t + num_pad == layout.num_tokens, f"{t} tokens + {num_pad} pad rows != layout"
    v["input_ids"][t:] = PAD_TOKEN_ID
    v["positions"][t:] = 0
    v["seq_lens"][n:] = 1
    v["cu_seqlens_q"][n:] = np.arange(t, t + num_pad + 1, dtype=np.int32)


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

    def stage(
        self,
        rows: Sequence[ScheduledRequest],
        copies: Sequence[Sequence[BlockCopy]],
        block_size: int,
        layout: StepLayout,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pack a step (`pack_step`) into a host buffer and copy it to the device (into `out`
        when given): (host, device) buffers."""
        host = self.host(layout.total)
        pack_step(rows, copies, block_size, layout, host.numpy())
        return host, self.to_device(host, out)

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
