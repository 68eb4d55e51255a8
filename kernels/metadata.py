"""Per-step attention metadata: block tables -> kernel inputs, validated once, read by every layer.

The engine calls `store_kv` and `paged_attention` once per layer per step (30 layers for SmolLM2)
with the same block tables, lengths and slots. Checking their values (seq_len >= q_len, block ids in
range, slots where the block tables put them) costs as much in every layer as in the first, and so
does the torch reference's index arithmetic. `AttentionMetadata` does both once, when it is built:

    host tensors (the runner's numpy arrays)
      -> AttentionMetadata(...): structure and values checked on the host (no device sync), tensors
         copied once to `device`; on the CPU also the torch reference's `GatherPlan`
      -> store_kv_step / paged_attention_step, once per layer: shape / dtype / device checks of the
         per-layer tensors against the metadata only

Building is the only way to get an instance, so holding one means its contents passed validation
(unless built with `validate=False`: the engine's hot path, whose inputs come from its scheduler;
tests and the engine's debug mode validate). Tensors already on `device` are not copied: do not
modify them after building, except a CUDA graph's static inputs, rewritten before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import torch

from radixkv.kernels.checks import (
    INDEX_DTYPES,
    _check_index_vector,
    _check_tensor,
    _require,
    check_cache_pair,
    check_metadata_tensors,
    check_metadata_values,
    check_new_kv,
    check_paged_attention,
    check_query,
)

__all__ = ["AttentionMetadata", "GatherBatch", "GatherPlan"]

# Decode requests batched into one padded gather of the torch reference hold at most this many K
# elements (4 MiB fp32): measured on a 2-core machine, larger padded batches got slower than
# separate calls.
DECODE_GROUP_ELEMS = 1 << 20
# Query rows per score matrix in the reference's extend path: bounds memory at
# [heads, 512, seq_len] fp32.
EXTEND_Q_CHUNK = 512


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMetadata:
    """The attention inputs of one step, validated when built, shared by every layer.

    Request r owns the query rows `[cu_seqlens_q[r], cu_seqlens_q[r + 1])`, the last q_len positions
    of its `seq_lens[r]`-token context; token i of a request lives in block
    `block_tables[r, i // block_size]` at offset `i % block_size`.

    Checked when built (a ValueError naming the argument): dims, dtypes and lengths of the tensors;
    `kv_cache_shape` is 4 positive ints; every check of `check_attention_metadata` (block ids
    within `[0, num_blocks)`); and, with a slot_mapping, that it has `cu_seqlens_q[-1]` entries
    and every non-negative slot is the one the block tables give its token (so `store_kv_step`
    writes exactly where `paged_attention_step` reads) and no slot is written twice.

    The values are read from host copies: pass CPU tensors and the kernels' `device` (copied
    there once), or device tensors with their `host_tensors` (nothing copied, no sync); device
    tensors alone are copied to the host once (one sync). `validate=False` skips the value checks.
    """

    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]; entries past a request's blocks
    # are never read (any value)
    seq_lens: torch.Tensor  # int32 [num_reqs]: context length including this step's new tokens
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]: prefix sums of the per-request q lengths
    kv_cache_shape: tuple[int, int, int, int]  # one layer's K (and V) cache:
    # [num_blocks, block_size, num_kv_heads, head_dim]; the step kernels accept only caches of it
    slot_mapping: torch.Tensor | None = None  # int32/int64 [num_tokens]: where each new token's
    # K/V goes (block * block_size + offset; < 0: not written); None: attention only
    device: torch.device | str | None = None  # where the kernels run; None: block_tables' device
    # False: skip the value checks (check_metadata_values, the slot check); structure, dtypes and
    # shapes are still checked. The engine's step passes False unless debugging: its inputs come
    # from the scheduler, and the checks cost a pass over every token per step.
    validate: bool = True
    # CPU copies of (block_tables, seq_lens, cu_seqlens_q, slot_mapping) when those are already on
    # `device` (the engine's staging buffer, copied without waiting): the host values are read from
    # them, so building never syncs. Not kept after building.
    host_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = (
        field(default=None, repr=False)
    )
    # ---- derived when built
    seq_lens_host: tuple[int, ...] = field(init=False)
    cu_seqlens_q_host: tuple[int, ...] = field(init=False)
    max_seq_len: int = field(init=False)  # 0 without requests
    max_q_len: int = field(init=False)
    # The torch reference's gather indices, built with the metadata on the CPU; None elsewhere
    # (Triton reads the tensors above; the reference on CUDA plans per call).
    gather_plan: GatherPlan | None = field(init=False, repr=False)
    # The reference's batches of each sliding window a layer asked for, built on first use and
    # reused by the step's later layers of that window (CPU only, like gather_plan).
    window_batches: dict[int, tuple[GatherBatch, ...]] = field(init=False, repr=False)
    # What a kernel module plans from this metadata on its first layer and reuses for the step's
    # later layers, under the module's own key (the CPU kernels' split of requests, say).
    step_plans: dict[str, object] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        shape = self.kv_cache_shape
        _require(
            isinstance(shape, (tuple, torch.Size))
            and len(shape) == 4
            and all(isinstance(n, int) and n > 0 for n in shape),
            f"kv_cache_shape must be 4 positive ints [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {shape!r}",
        )
        check_metadata_tensors(self.block_tables, self.seq_lens, self.cu_seqlens_q)
        num_blocks, block_size = shape[0], shape[1]
        slots = self.slot_mapping
        if slots is not None:
            _check_tensor("slot_mapping", slots)
            _check_index_vector("slot_mapping", slots, INDEX_DTYPES)
        device = torch.device(self.device) if self.device is not None else self.block_tables.device

        tables_host, lens_host, cu_host, slots_host = self._host_copies()
        lens = lens_host.tolist()
        cu = cu_host.tolist()
        if self.validate:
            check_metadata_values(
                tables_host,
                lens,
                cu,
                block_size=block_size,
                num_blocks=num_blocks,
                num_q_tokens=None if slots is None else slots.shape[0],
            )
            if slots_host is not None:
                _check_slot_mapping(slots_host, tables_host, lens, cu, block_size)

        def on_device(t: torch.Tensor) -> torch.Tensor:
            return t if t.device == device else t.to(device)

        block_tables = on_device(self.block_tables)
        set_field = object.__setattr__  # frozen: fields are set here, once
        set_field(self, "kv_cache_shape", tuple(shape))
        set_field(self, "block_tables", block_tables)
        set_field(self, "seq_lens", on_device(self.seq_lens))
        set_field(self, "cu_seqlens_q", on_device(self.cu_seqlens_q))
        set_field(self, "slot_mapping", None if slots is None else on_device(slots))
        set_field(self, "device", block_tables.device)  # "cuda" -> "cuda:0", as tensors report it
        set_field(self, "seq_lens_host", tuple(lens))
        set_field(self, "cu_seqlens_q_host", tuple(cu))
        set_field(self, "max_seq_len", max(lens, default=0))
        set_field(self, "max_q_len", max((b - a for a, b in pairwise(cu)), default=0))
        set_field(self, "gather_plan", build_gather_plan(self) if device.type == "cpu" else None)
        set_field(self, "window_batches", {})
        set_field(self, "step_plans", {})
        set_field(self, "host_tensors", None)

    def _host_copies(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """block_tables, seq_lens, cu_seqlens_q, slot_mapping on the host: `host_tensors` when
        given (checked to match), else `.cpu()` (the tensors themselves on the CPU; a sync on
        CUDA)."""
        if self.host_tensors is None:
            slots = self.slot_mapping
            return (
                self.block_tables.cpu(),
                self.seq_lens.cpu(),
                self.cu_seqlens_q.cpu(),
                None if slots is None else slots.cpu(),
            )
        _require(
            isinstance(self.host_tensors, tuple) and len(self.host_tensors) == 4,
            "host_tensors must be (block_tables, seq_lens, cu_seqlens_q, slot_mapping)",
        )
        names = ("block_tables", "seq_lens", "cu_seqlens_q", "slot_mapping")
        for name, host in zip(names, self.host_tensors, strict=True):
            on_device = getattr(self, name)
            _require(
                (host is None) == (on_device is None)
                and (
                    host is None
                    or (
                        isinstance(host, torch.Tensor)
                        and host.device.type == "cpu"
                        and host.shape == on_device.shape
                        and host.dtype == on_device.dtype
                    )
                ),
                f"host_tensors' {name} must be a CPU tensor like {name}",
            )
        return self.host_tensors

    @property
    def num_reqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def num_tokens(self) -> int:
        """New (query) tokens of the step: `cu_seqlens_q[-1]`."""
        return self.cu_seqlens_q_host[-1]

    @property
    def block_size(self) -> int:
        return self.kv_cache_shape[1]

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_shape[0]


def _check_slot_mapping(
    slots: torch.Tensor, block_tables: torch.Tensor, lens: list[int], cu: list[int], block_size: int
) -> None:
    """Every written slot (>= 0) is its token's slot in the block tables, and is written once.
    Runs after `check_metadata_values`: the block ids within seq_lens are valid."""
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    q_lens = [b - a for a, b in pairwise(cu)]
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(q_lens))  # [num_tokens]
    # Token i of the step is new token i - cu[r] of its request r, at position ctx_len[r] + that.
    offset = [n - q - start for n, q, start in zip(lens, q_lens, cu, strict=False)]
    pos = torch.arange(num_tokens) + torch.tensor(offset)[req]
    expected = block_tables[req, pos // block_size].long() * block_size + pos % block_size
    slots = slots.long()
    written = slots >= 0
    wrong = (written & (slots != expected)).nonzero()
    if wrong.numel():
        i = int(wrong[0])
        r = int(req[i])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slots[i])}, but token {i} (request {r}, position "
            f"{int(pos[i])}) lives in slot {int(expected[i])} of block_tables"
        )
    kept = slots[written]
    _require(kept.unique().numel() == kept.numel(), "slot_mapping writes the same slot twice")


# -------------------------------------------------------------------------- per-layer checks


def check_metadata(metadata: object) -> AttentionMetadata:
    if not isinstance(metadata, AttentionMetadata):
        raise ValueError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    return metadata


def _check_cache_matches(
    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    check_cache_pair(k_cache, v_cache, (4,))
    _require(
        tuple(k_cache.shape) == metadata.kv_cache_shape,
        f"k_cache shape {tuple(k_cache.shape)} != the metadata's kv_cache_shape "
        f"{metadata.kv_cache_shape}",
    )
    _require(
        k_cache.device == metadata.device,
        f"k_cache is on {k_cache.device}, the metadata on {metadata.device}",
    )


def check_store_step(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Per-layer checks of `store_kv_step`: tensor metadata only, the values were checked when
    `metadata` was built."""
    check_metadata(metadata)
    _check_cache_matches(k_cache, v_cache, metadata)
    check_new_kv(key, value, k_cache)
    _require(metadata.slot_mapping is not None, "metadata has no slot_mapping: nothing to store")
    _require(
        key.shape[0] == metadata.num_tokens,
        f"key has {key.shape[0]} tokens, the metadata's slot_mapping {metadata.num_tokens}",
    )


def check_attention_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None,
) -> None:
    """Per-layer checks of `paged_attention_step`: tensor metadata only, the values were checked
    when `metadata` was built."""
    check_metadata(metadata)
    _check_cache_matches(k_cache, v_cache, metadata)
    check_query(q, k_cache, scale, out)
    _require(
        q.shape[0] == metadata.num_tokens,
        f"cu_seqlens_q[-1] = {metadata.num_tokens} != number of q tokens {q.shape[0]}",
    )


def call_metadata(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> AttentionMetadata:
    """The metadata of one loose-tensor `paged_attention` call, its arguments checked: what the
    CPU backends' loose functions build before their step."""
    check_paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, check_values=False
    )
    # Building checks the values (the messages name block_tables / seq_lens / cu_seqlens_q).
    return AttentionMetadata(block_tables, seq_lens, cu_seqlens_q, tuple(k_cache.shape))


# -------------------------------------------------------------------- the reference's gather plan


@dataclass(frozen=True, slots=True, eq=False)
class GatherBatch:
    """One padded batch of the torch reference: n block-table rows with q_len queries each.

    Row i gathers the blocks of its table from its first visible block on (block 0 without a
    window) up to its length; positions below are relative to that first gathered slot, and its
    last query sits at the row's last gathered position (causal).
    """

    q_rows: slice | torch.Tensor  # the n * q_len rows of q / out, row-major (int64 when a tensor)
    n: int
    q_len: int
    kv_len: int  # positions in the score matrix: kv_lens[0] for one row, else whole blocks
    blocks: torch.Tensor  # int64 [n * ceil(kv_len / block_size)]: the blocks gathered, row by row
    # (a shorter row's padding entries clamped into range: their slots are zeroed / masked)
    zero_positions: torch.Tensor | None  # int64: positions of the gathered [n * padded_len] past
    # their row's kv_len, zeroed after the gather; None: nothing to zero
    hidden: torch.Tensor | None  # bool [n, q_len, kv_len]: (query, position) pairs masked before
    # the softmax (causal, window and padding); None: nothing masked


@dataclass(frozen=True, slots=True, eq=False)
class GatherPlan:
    """Index tensors of the torch reference for one step, reused by every layer."""

    batches: tuple[GatherBatch, ...]  # decode groups first, then extend / prefill query chunks
    store_rows: torch.Tensor | None  # int64: tokens whose slot is written; None: every token
    store_blocks: torch.Tensor | None  # int64 [num_written]; None without a slot_mapping
    store_offsets: torch.Tensor | None  # int64 [num_written]


def build_gather_plan(metadata: AttentionMetadata) -> GatherPlan:
    """Lay out the reference's padded batches of full causal attention and its store indices (on
    the metadata's device)."""
    block_size = metadata.kv_cache_shape[1]
    store_rows = store_blocks = store_offsets = None
    if metadata.slot_mapping is not None:
        slots = metadata.slot_mapping.long()
        written = slots >= 0
        if not bool(written.all()):
            store_rows = written.nonzero().squeeze(1)
            slots = slots[store_rows]
        store_blocks, store_offsets = slots // block_size, slots % block_size
    batches = build_gather_batches(metadata, None)
    return GatherPlan(batches, store_rows, store_blocks, store_offsets)


def build_gather_batches(
    metadata: AttentionMetadata, window: int | None
) -> tuple[GatherBatch, ...]:
    """The reference's padded batches of one attention kind: full causal (`window` None) or a
    sliding window, where a query at position p sees (p - window, p].

    Decode requests (q_len 1) are grouped into padded batches of similar span whose gathered K
    stays within DECODE_GROUP_ELEMS; each prefill / extend request is a batch of its own per
    EXTEND_Q_CHUNK query rows. Every row gathers only the blocks its queries can see: from the
    block of its first query's first visible position (block 0 without a window) to its end.
    """
    dev = metadata.device
    num_blocks, block_size, num_kv_heads, head_dim = metadata.kv_cache_shape
    lens, cu = metadata.seq_lens_host, metadata.cu_seqlens_q_host
    q_lens = [b - a for a, b in pairwise(cu)]
    tables = metadata.block_tables

    def first_block(kv_len: int, q_len: int) -> int:
        """The first block a row of q_len queries ending at kv_len reads."""
        return 0 if window is None else max(0, kv_len - q_len - window + 1) // block_size

    def batch(
        q_rows: slice | torch.Tensor, table_rows: torch.Tensor, kv_lens: list[int], q_len: int
    ) -> GatherBatch:
        n = len(kv_lens)
        firsts = [first_block(kv, q_len) for kv in kv_lens]
        spans = [kv - f * block_size for kv, f in zip(kv_lens, firsts, strict=True)]
        num_used_blocks = -(-max(spans) // block_size)
        padded_len = num_used_blocks * block_size
        if max(firsts) == 0:
            cols = table_rows[:, :num_used_blocks]
        else:  # each row from its own first block; padding columns clamped into the table
            col = torch.tensor(firsts, device=dev)[:, None] + torch.arange(
                num_used_blocks, device=dev
            )
            cols = table_rows.gather(1, col.clamp_(max=table_rows.shape[1] - 1))
        blocks = cols.reshape(-1).long().clamp_(0, num_blocks - 1)
        spans_t = torch.tensor(spans, device=dev)
        zero_positions = None
        if n == 1:
            kv_len = spans[0]  # the tail past it is cut off after the gather, nothing to zero
        else:
            kv_len = padded_len
            if min(spans) < padded_len:
                pos = torch.arange(padded_len, device=dev)
                zero_positions = (pos[None, :] >= spans_t[:, None]).view(-1).nonzero().squeeze(1)
        hidden = None
        if q_len > 1 or min(spans) < kv_len or window is not None:
            # Positions relative to each row's first gathered one. Causal: the query at p sees
            # [0, p]; p < spans[i], so this hides padding too.
            q_pos = torch.arange(q_len, device=dev) + (spans_t - q_len)[:, None]  # [n, q_len]
            kv_pos = torch.arange(kv_len, device=dev)[None, None, :]
            hidden = kv_pos > q_pos[:, :, None]
            if window is not None:
                hidden |= kv_pos <= q_pos[:, :, None] - window
        return GatherBatch(q_rows, n, q_len, kv_len, blocks, zero_positions, hidden)

    batches = []
    decode = [r for r, q_len in enumerate(q_lens) if q_len == 1]
    spans = [n - first_block(n, 1) * block_size for n in lens]
    for group in _decode_groups(decode, spans, num_kv_heads * head_dim):
        r0 = group[0]
        if len(group) == 1:  # slices: no index tensors, no copies
            rows: slice | torch.Tensor = slice(cu[r0], cu[r0] + 1)
            table_rows = tables[r0 : r0 + 1]
        else:
            rows = torch.tensor([cu[r] for r in group], device=dev)
            table_rows = tables[torch.tensor(group, device=dev)]
        batches.append(batch(rows, table_rows, [lens[r] for r in group], 1))
    for r, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        ctx_len = lens[r] - q_len
        for j0 in range(0, q_len, EXTEND_Q_CHUNK):
            j1 = min(j0 + EXTEND_Q_CHUNK, q_len)
            # Query chunk [j0, j1) sees positions before ctx_len + j1: shorten the gather to that.
            rows = slice(cu[r] + j0, cu[r] + j1)
            batches.append(batch(rows, tables[r : r + 1], [ctx_len + j1], j1 - j0))
    return tuple(batches)


def _decode_groups(decode: list[int], spans: list[int], row_elems: int) -> list[list[int]]:
    """Decode requests grouped into padded batches of similar span (the positions each gathers)
    whose gathered K stays within DECODE_GROUP_ELEMS; a long context is a group of its own.
    Batching amortises the per-call overhead of short contexts; on long ones padding and a working
    set past the CPU caches cost more than separate calls."""
    groups: list[list[int]] = []
    for r in sorted(decode, key=spans.__getitem__):
        group = groups[-1] if groups else None
        # sorted by span: spans[r] is the group's padded length if r joins it
        if group is not None and (len(group) + 1) * spans[r] * row_elems <= DECODE_GROUP_ELEMS:
            group.append(r)
        else:
            groups.append([r])
    return groups
