"""Input validation of the latent kernels, shared by the torch reference and the Triton launchers.

As in `checks.py`: structural checks (shapes, dtypes, strides, devices) always run; the slot
values are read only where the caller asks (loose tensors on the CPU); a step's metadata was
checked when it was built. Every failure is a ValueError naming the argument.
"""

from __future__ import annotations

import torch

from radixkv.kernels.checks import (
    CACHE_DTYPES,
    INDEX_DTYPES,
    _check_index_vector,
    _check_same_device,
    _check_tensor,
    _require,
    check_attention_metadata,
    check_metadata_tensors,
)
from radixkv.kernels.latent_metadata import latent_cache_shape
from radixkv.kernels.metadata import AttentionMetadata, check_metadata


def check_latent_cache(cache: torch.Tensor) -> None:
    """cache: [num_blocks, block_size, latent_dim], a float dtype, unit stride on latent_dim."""
    _check_tensor("cache", cache)
    _require(
        cache.dim() == 3 and all(n > 0 for n in cache.shape),
        f"cache must be [num_blocks, block_size, latent_dim], got {tuple(cache.shape)}",
    )
    _require(cache.dtype in CACHE_DTYPES, f"cache dtype {cache.dtype} not in {CACHE_DTYPES}")
    _require(cache.stride(-1) == 1, "cache must have unit stride on latent_dim")


def _check_parts(
    names: tuple[str, str], parts: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor
) -> None:
    """Two tensors [..., L] and [..., R] whose widths add up to the cache's latent_dim, of its
    dtype and device, with unit last stride and equal leading dims."""
    for name, t in zip(names, parts, strict=True):
        _check_tensor(name, t)
        _require(t.dtype == cache.dtype, f"{name} dtype {t.dtype} != cache dtype {cache.dtype}")
        _require(t.stride(-1) == 1, f"{name} must have unit stride on its last dim")
    first, second = parts
    _require(
        first.shape[:-1] == second.shape[:-1],
        f"{names[0]} {tuple(first.shape)} and {names[1]} {tuple(second.shape)} differ before "
        "their last dim",
    )
    width = first.shape[-1] + second.shape[-1]
    _require(
        width == cache.shape[2],
        f"{names[0]} ({first.shape[-1]}) + {names[1]} ({second.shape[-1]}) = {width} values, "
        f"the cache holds {cache.shape[2]} a token",
    )
    _require(first.shape[-1] > 0, f"{names[0]} has no values")
    _check_same_device(cache.device, **dict(zip(names, parts, strict=True)))


# ------------------------------------------------------------------------------------ store


def check_new_latent(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor) -> None:
    """latent [num_tokens, L] and k_pe [num_tokens, R] against a checked cache of L + R."""
    _check_parts(("latent", "k_pe"), (latent, k_pe), cache)
    _require(latent.dim() == 2, f"latent must be [num_tokens, L], got {tuple(latent.shape)}")


def check_store_latent(
    latent: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check_values: bool,
) -> None:
    check_latent_cache(cache)
    check_new_latent(latent, k_pe, cache)
    _check_tensor("slot_mapping", slot_mapping)
    _check_index_vector("slot_mapping", slot_mapping, INDEX_DTYPES)
    _require(
        slot_mapping.shape[0] == latent.shape[0],
        f"slot_mapping has {slot_mapping.shape[0]} entries for {latent.shape[0]} tokens",
    )
    _check_same_device(cache.device, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel() > 0:
        num_slots = cache.shape[0] * cache.shape[1]
        hi = int(slot_mapping.max())
        _require(hi < num_slots, f"slot_mapping has slot {hi} >= num_blocks * block_size")
        written = slot_mapping[slot_mapping >= 0]
        _require(
            written.unique().numel() == written.numel(), "slot_mapping writes the same slot twice"
        )


def check_latent_step(cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    """A latent layer's cache against a step's metadata (built for `latent_cache_shape`)."""
    check_metadata(metadata)
    check_latent_cache(cache)
    _require(
        latent_cache_shape(cache) == metadata.kv_cache_shape,
        f"cache shape {tuple(cache.shape)} does not match the metadata's kv_cache_shape "
        f"{metadata.kv_cache_shape} (a latent layer's is latent_cache_shape(cache))",
    )
    _require(
        cache.device == metadata.device,
        f"cache is on {cache.device}, the metadata on {metadata.device}",
    )


def check_store_latent_step(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    check_latent_step(cache, metadata)
    check_new_latent(latent, k_pe, cache)
    _require(metadata.slot_mapping is not None, "metadata has no slot_mapping: nothing to store")
    _require(
        latent.shape[0] == metadata.num_tokens,
        f"latent has {latent.shape[0]} tokens, the metadata's slot_mapping {metadata.num_tokens}",
    )


# -------------------------------------------------------------------------------- attention


def _check_scale(scale: float) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")


def check_latent_query(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> None:
    """The absorbed form's queries q_latent [num_tokens, num_heads, L] and q_pe [num_tokens,
    num_heads, R], and the optional result buffer [num_tokens, num_heads, L]."""
    _check_parts(("q_latent", "q_pe"), (q_latent, q_pe), cache)
    _require(
        q_latent.dim() == 3 and q_latent.shape[1] > 0,
        f"q_latent must be [num_tokens, num_heads, L], got {tuple(q_latent.shape)}",
    )
    _check_scale(scale)
    if out is not None:
        _check_tensor("out", out)
        _require(
            out.shape == q_latent.shape,
            f"out shape {tuple(out.shape)} != q_latent shape {tuple(q_latent.shape)}",
        )
        _require(out.dtype == q_latent.dtype, f"out dtype {out.dtype} != {q_latent.dtype}")
        _require(out.stride(-1) == 1, "out must have unit stride on its last dim")
        _check_same_device(cache.device, out=out)


def check_expanded_query(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
) -> int:
    """The expanded form's queries q_nope [num_tokens, num_heads, P] and q_pe [num_tokens,
    num_heads, R], and kv_b_proj's weight [num_heads * (P + V), L] (L + R the cache's width).
    Returns V."""
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_b_weight", kv_b_weight)):
        _check_tensor(name, t)
        _require(t.dtype == cache.dtype, f"{name} dtype {t.dtype} != cache dtype {cache.dtype}")
        _require(t.stride(-1) == 1, f"{name} must have unit stride on its last dim")
    _require(
        q_nope.dim() == 3 and q_nope.shape[1] > 0 and q_nope.shape[2] > 0,
        f"q_nope must be [num_tokens, num_heads, P], got {tuple(q_nope.shape)}",
    )
    num_tokens, num_heads, nope = q_nope.shape
    _require(
        q_pe.dim() == 3 and q_pe.shape[:2] == q_nope.shape[:2],
        f"q_pe must be [num_tokens={num_tokens}, num_heads={num_heads}, R], "
        f"got {tuple(q_pe.shape)}",
    )
    lora = cache.shape[2] - q_pe.shape[2]
    _require(lora > 0, f"q_pe's {q_pe.shape[2]} values leave no latent in the cache's width")
    rows = kv_b_weight.shape[0] if kv_b_weight.dim() == 2 else 0
    _require(
        kv_b_weight.dim() == 2
        and kv_b_weight.shape[1] == lora
        and rows % num_heads == 0
        and rows // num_heads > nope,
        f"kv_b_weight must be [num_heads * (P + V), L] = [{num_heads} * ({nope} + V), {lora}], "
        f"got {tuple(kv_b_weight.shape)}",
    )
    _check_scale(scale)
    _check_same_device(cache.device, q_nope=q_nope, q_pe=q_pe, kv_b_weight=kv_b_weight)
    return rows // num_heads - nope


def check_loose_metadata(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> None:
    """The loose metadata tensors of a Triton launcher: their structure always, their values
    only on the CPU (reading them would sync on CUDA)."""
    check_metadata_tensors(block_tables, seq_lens, cu_seqlens_q)
    _check_same_device(cache.device, block_tables=block_tables, seq_lens=seq_lens)
    if cache.device.type == "cpu":
        check_attention_metadata(
            block_tables,
            seq_lens,
            cu_seqlens_q,
            block_size=cache.shape[1],
            num_blocks=cache.shape[0],
            num_q_tokens=q.shape[0],
        )


def check_step_tokens(q: torch.Tensor, metadata: AttentionMetadata) -> None:
    """A step call's queries are the metadata's tokens."""
    _require(
        q.shape[0] == metadata.num_tokens,
        f"cu_seqlens_q[-1] = {metadata.num_tokens} != number of q tokens {q.shape[0]}",
    )
