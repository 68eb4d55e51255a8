"""Input validation shared by the torch reference and the Triton launchers.

Two kinds of checks:

* structural (shapes, dtypes, strides, devices): always run, they read only tensor metadata;
* contents (`check_attention_metadata`, slot and block id ranges): they read tensor values, which
  costs a device sync on CUDA. The reference always runs them on loose tensors (it reads the values
  anyway); the Triton launchers run them only when the tensors live on the CPU (the interpreter).
  The engine runs them once per step instead, on the host, when it builds an `AttentionMetadata`
  (`metadata.py`), and its layers then call the `*_step` kernels, which run the structural checks
  only.

Every failure is a `ValueError` naming the offending argument.
"""

from __future__ import annotations

import torch

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        _require(t.device == device, f"{name} is on {t.device}, expected {device} like the cache")


def _check_index_vector(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    _require(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    _require(t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}")
    _require(t.is_contiguous(), f"{name} must be contiguous")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor, ndims: tuple[int, ...]) -> None:
    """K and V caches: same shape/dtype/device/strides, a float dtype, unit stride on head_dim."""
    _check_tensor("k_cache", k_cache)
    _check_tensor("v_cache", v_cache)
    _require(
        k_cache.dim() in ndims,
        f"k_cache must have {' or '.join(map(str, ndims))} dims, got shape {tuple(k_cache.shape)}",
    )
    _require(
        k_cache.shape == v_cache.shape,
        f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}",
    )
    _require(k_cache.dtype in CACHE_DTYPES, f"k_cache dtype {k_cache.dtype} not in {CACHE_DTYPES}")
    _require(v_cache.dtype == k_cache.dtype, f"v_cache dtype {v_cache.dtype} != {k_cache.dtype}")
    _require(v_cache.device == k_cache.device, f"v_cache on {v_cache.device} != {k_cache.device}")
    _require(k_cache.stride(-1) == 1, "k_cache must have unit stride on head_dim")
    _require(v_cache.stride(-1) == 1, "v_cache must have unit stride on head_dim")


# ---------------------------------------------------------------------------------------- store_kv


def check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool,
) -> None:
    check_cache_pair(k_cache, v_cache, (4,))
    check_new_kv(key, value, k_cache)
    _check_tensor("slot_mapping", slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    _check_index_vector("slot_mapping", slot_mapping, INDEX_DTYPES)
    _require(
        slot_mapping.shape[0] == key.shape[0],
        f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens",
    )
    _check_same_device(k_cache.device, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel() > 0:
        num_slots = num_blocks * block_size
        hi = int(slot_mapping.max())
        _require(
            hi < num_slots, f"slot_mapping has slot {hi} >= num_blocks * block_size ({num_slots})"
        )
        written = slot_mapping[slot_mapping >= 0]
        _require(
            written.unique().numel() == written.numel(),
            "slot_mapping writes the same slot twice",
        )


def check_new_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor) -> None:
    """New tokens' key / value [num_tokens, num_kv_heads, head_dim] against a checked cache."""
    _check_tensor("key", key)
    _check_tensor("value", value)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _require(key.dim() == 3, f"key must be [num_tokens, num_kv_heads, head_dim], got {key.shape}")
    _require(
        tuple(key.shape[1:]) == (num_kv_heads, head_dim),
        f"key shape {tuple(key.shape)} does not match the cache's "
        f"[*, num_kv_heads={num_kv_heads}, head_dim={head_dim}]",
    )
    _require(value.shape == key.shape, f"value shape {tuple(value.shape)} != key {key.shape}")
    _require(key.dtype == k_cache.dtype, f"key dtype {key.dtype} != cache dtype {k_cache.dtype}")
    _require(value.dtype == k_cache.dtype, f"value dtype {value.dtype} != {k_cache.dtype}")
    _require(key.stride(-1) == 1, "key must have unit stride on head_dim")
    _require(value.stride(-1) == 1, "value must have unit stride on head_dim")
    _check_same_device(k_cache.device, key=key, value=value)


# --------------------------------------------------------------------------------- paged_attention


def check_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    *,
    check_values: bool,
) -> None:
    check_cache_pair(k_cache, v_cache, (4,))
    check_query(q, k_cache, scale, out)
    check_metadata_tensors(block_tables, seq_lens, cu_seqlens_q)
    _check_same_device(
        k_cache.device, block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q
    )
    if check_values:
        check_attention_metadata(
            block_tables,
            seq_lens,
            cu_seqlens_q,
            block_size=k_cache.shape[1],
            num_blocks=k_cache.shape[0],
            num_q_tokens=q.shape[0],
        )


def check_query(
    q: torch.Tensor, k_cache: torch.Tensor, scale: float, out: torch.Tensor | None
) -> None:
    """q [num_tokens, num_q_heads, head_dim], the softmax scale and the optional result buffer,
    against a checked cache."""
    _check_tensor("q", q)
    _, _, num_kv_heads, head_dim = k_cache.shape
    _require(q.dim() == 3, f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    _require(q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    _require(q.shape[1] > 0, "q has no heads")
    _require(
        q.shape[1] % num_kv_heads == 0,
        f"q has {q.shape[1]} heads, not a multiple of the cache's {num_kv_heads} kv heads",
    )
    _require(q.dtype == k_cache.dtype, f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    _require(q.stride(-1) == 1, "q must have unit stride on head_dim")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    _check_same_device(k_cache.device, q=q)
    if out is not None:
        _check_tensor("out", out)
        _require(out.shape == q.shape, f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
        _require(out.dtype == q.dtype, f"out dtype {out.dtype} != q dtype {q.dtype}")
        _require(out.device == q.device, f"out on {out.device} != q on {q.device}")
        _require(out.stride(-1) == 1, "out must have unit stride on head_dim")


def check_metadata_tensors(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor
) -> None:
    """Tensors, dims, dtypes and lengths of the attention metadata (not their values)."""
    for name, t in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
    ):
        _check_tensor(name, t)
    _require(
        block_tables.dim() == 2,
        f"block_tables must be [num_reqs, max_blocks], got {tuple(block_tables.shape)}",
    )
    _require(
        block_tables.dtype == torch.int32,
        f"block_tables must be int32, got {block_tables.dtype}",
    )
    num_reqs = block_tables.shape[0]
    _check_index_vector("seq_lens", seq_lens, (torch.int32,))
    _check_index_vector("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    _require(
        seq_lens.shape[0] == num_reqs,
        f"seq_lens has {seq_lens.shape[0]} entries for {num_reqs} block table rows",
    )
    _require(
        cu_seqlens_q.shape[0] == num_reqs + 1,
        f"cu_seqlens_q must have num_reqs + 1 = {num_reqs + 1} entries, "
        f"got {cu_seqlens_q.shape[0]}",
    )


def check_attention_metadata(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    block_size: int,
    num_blocks: int | None = None,
    num_q_tokens: int | None = None,
) -> None:
    """Check the contents of a step's attention metadata (reads the values: a sync on CUDA).

    cu_seqlens_q starts at 0 and never decreases (a request may have 0 new tokens); it ends at
    `num_q_tokens` when given; every `seq_lens[r] >= q_len[r]`; the block table has at least
    `ceil(seq_lens[r] / block_size)` columns, and those entries are valid block ids (`< num_blocks`
    when given). Entries past a request's last block are padding and are never read.
    """
    check_metadata_values(
        block_tables,
        seq_lens.tolist(),
        cu_seqlens_q.tolist(),
        block_size=block_size,
        num_blocks=num_blocks,
        num_q_tokens=num_q_tokens,
    )


def check_metadata_values(
    block_tables: torch.Tensor,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
    *,
    block_size: int,
    num_blocks: int | None,
    num_q_tokens: int | None,
) -> None:
    """`check_attention_metadata` over host copies of seq_lens and cu_seqlens_q."""
    # Per-request Python over a few scalars (tens of requests); the block ids in one tensor pass.
    cu = cu_seqlens_q
    _require(cu[0] == 0, f"cu_seqlens_q[0] must be 0, got {cu[0]}")
    if num_q_tokens is not None:
        _require(
            cu[-1] == num_q_tokens,
            f"cu_seqlens_q[-1] = {cu[-1]} != number of q tokens {num_q_tokens}",
        )
    max_blocks = block_tables.shape[1]
    needed = []
    for r, seq_len in enumerate(seq_lens):
        q_len = cu[r + 1] - cu[r]
        _require(q_len >= 0, f"cu_seqlens_q must be non-decreasing (at index {r})")
        _require(
            seq_len >= q_len,
            f"seq_lens[{r}] = {seq_len} < q_len {q_len}: seq_lens counts the whole context "
            "including the new tokens",
        )
        needed.append(-(-seq_len // block_size))
        _require(
            needed[r] <= max_blocks,
            f"block_tables has {max_blocks} columns, too short for seq_lens[{r}] = {seq_len} at "
            f"block_size {block_size} (needs {needed[r]})",
        )
    width = max(needed, default=0)
    if width:
        used = (
            torch.arange(width, device=block_tables.device)[None, :]
            < torch.tensor(needed, device=block_tables.device)[:, None]
        )
        ids = block_tables[:, :width][used]
        lo, hi = int(ids.min()), int(ids.max())
        _require(lo >= 0, f"block_tables holds a negative block id ({lo}) within seq_lens")
        if num_blocks is not None:
            _require(
                hi < num_blocks, f"block_tables holds block id {hi} >= num_blocks {num_blocks}"
            )


# ------------------------------------------------------------------------------------- copy_blocks


def check_copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slots: torch.Tensor,
    *,
    check_values: bool,
) -> None:
    check_cache_pair(k_cache, v_cache, (4, 5))
    for name, t in (("src", src), ("dst", dst), ("num_slots", num_slots)):
        _check_tensor(name, t)
        _check_index_vector(name, t, INDEX_DTYPES)
    _require(
        src.shape == dst.shape == num_slots.shape,
        f"src, dst and num_slots must have the same length, got {src.shape[0]}, {dst.shape[0]}, "
        f"{num_slots.shape[0]}",
    )
    _check_same_device(k_cache.device, src=src, dst=dst, num_slots=num_slots)
    if check_values and src.numel():
        num_blocks, block_size = k_cache.shape[-4], k_cache.shape[-3]
        for name, t in (("src", src), ("dst", dst)):
            _require(
                int(t.min()) >= 0 and int(t.max()) < num_blocks,
                f"{name} holds a block id outside [0, {num_blocks})",
            )
        _require(
            int(num_slots.min()) >= 0 and int(num_slots.max()) <= block_size,
            f"num_slots must be in [0, block_size={block_size}]",
        )
        dst_set = set(dst.tolist())
        _require(len(dst_set) == dst.numel(), "dst holds the same block twice")
        _require(not dst_set & set(src.tolist()), "a dst block is also a src block")


# ------------------------------------------------------------------------ rms_norm, rope_store_kv


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_tensor("x", x)
    _check_tensor("weight", weight)
    _require(x.dim() >= 1 and x.shape[-1] > 0, f"x must be [..., hidden], got {tuple(x.shape)}")
    _require(
        weight.shape == (x.shape[-1],),
        f"weight must be [hidden={x.shape[-1]}], got {tuple(weight.shape)}",
    )
    for name, t in (("x", x), ("weight", weight)):
        _require(t.dtype in CACHE_DTYPES, f"{name} dtype {t.dtype} not in {CACHE_DTYPES}")
    _require(x.stride(-1) == 1, "x must have unit stride on hidden")
    _require(weight.is_contiguous(), "weight must be contiguous")
    _check_same_device(x.device, weight=weight)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def check_rope(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """q [num_tokens, num_q_heads, head_dim], k / v [num_tokens, num_kv_heads, head_dim] and the
    rotary tables cos / sin [num_tokens, head_dim] of the tokens' positions."""
    _check_tensor("q", q)
    _require(q.dim() == 3, f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, _, head_dim = q.shape
    _require(head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {head_dim}")
    _require(q.dtype in CACHE_DTYPES, f"q dtype {q.dtype} not in {CACHE_DTYPES}")
    _require(q.stride(-1) == 1, "q must have unit stride on head_dim")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_tensor(name, t)
        _require(
            t.shape == (num_tokens, head_dim),
            f"{name} must be [num_tokens={num_tokens}, head_dim={head_dim}], got {tuple(t.shape)}",
        )
        _require(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
        _require(t.stride(-1) == 1, f"{name} must have unit stride on head_dim")
    _check_tensor("k", k)
    _require(
        k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim,
        f"k must be [num_tokens={num_tokens}, num_kv_heads, head_dim={head_dim}], "
        f"got {tuple(k.shape)}",
    )
    _check_same_device(q.device, k=k, v=v, cos=cos, sin=sin)
