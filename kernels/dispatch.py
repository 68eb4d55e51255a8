"""Backend switch: Triton for CUDA tensors; for CPU tensors the compiled CPU kernels
(`cpu_attention`: attention in C, everything else the reference), or the torch reference where
they cannot be built.

`use_backend("triton" | "cpu" | "torch")` overrides the choice inside a `with` block (per thread /
task, a ContextVar): tests run the Triton kernels on CPU tensors under `TRITON_INTERPRET=1`, and
compare either backend against the reference. Triton is imported on first use of the Triton
backend only, so the CPU engine works where triton is not installed (e.g. macOS).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Literal

import torch

from radixkv.kernels import cpu_attention, latent_reference, recurrent_reference, reference
from radixkv.kernels.attention_kind import AttentionKind
from radixkv.kernels.metadata import AttentionMetadata
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

logger = logging.getLogger(__name__)

Backend = Literal["triton", "cpu", "torch"]
_BACKENDS = ("triton", "cpu", "torch")
_override: ContextVar[Backend | None] = ContextVar("radixkv_kernels_backend", default=None)


@contextmanager
def use_backend(backend: Backend | None) -> Iterator[None]:
    """Run kernels on `backend` whatever the tensors' device inside the block (None: default)."""
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    token = _override.set(backend)
    try:
        yield
    finally:
        _override.reset(token)


def backend_for(device: torch.device) -> Backend:
    """The backend a call on `device` would use now."""
    override = _override.get()
    if override is not None:
        return override
    if device.type == "cuda":
        if _triton_available():
            return "triton"
        _warn_no_triton()
    if device.type == "cpu" and cpu_attention.available():
        return "cpu"
    return "torch"


def _device_of(t: object) -> torch.device:
    # Not a tensor: let the reference's validation report it with a ValueError.
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _warn_no_triton() -> None:
    logger.warning("triton is not installed: CUDA tensors use the (slower) torch reference kernels")


@functools.cache
def _triton_modules() -> dict[str, ModuleType]:
    if not _triton_available():
        raise RuntimeError(
            "the triton backend needs the `triton` package; install it or use_backend('torch')"
        )
    from radixkv.kernels import (
        triton_causal_conv1d,
        triton_copy_blocks,
        triton_gated_delta_rule,
        triton_latent_attention,
        triton_latent_expanded,
        triton_paged_attention,
        triton_rms_norm,
        triton_rope_store_kv,
        triton_ssm_scan,
        triton_store_kv,
        triton_store_latent,
    )

    return {
        "store_kv": triton_store_kv,
        "paged_attention": triton_paged_attention,
        "copy_blocks": triton_copy_blocks,
        "rms_norm": triton_rms_norm,
        "rope_store_kv": triton_rope_store_kv,
        "store_latent": triton_store_latent,
        "latent_attention": triton_latent_attention,
        "expanded_latent_attention": triton_latent_expanded,
        "causal_conv1d": triton_causal_conv1d,
        "gated_delta_rule": triton_gated_delta_rule,
        "ssm_scan": triton_ssm_scan,
    }


def _impl(kernel: str, t: object, spec: ModuleType = reference) -> ModuleType:
    """The module implementing `kernel` for `t`'s device: a Triton module, or its CPU module: for
    the paged-attention kernels the compiled CPU kernels where they are the backend, else the
    reference `spec` (each has the kernel under the same name and signature)."""
    backend = backend_for(_device_of(t))
    if backend == "triton":
        return _triton_modules()[kernel]
    return cpu_attention if backend == "cpu" and spec is reference else spec


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V at their slots, in place. See `reference.store_kv`."""
    _impl("store_kv", k_cache).store_kv(key, value, k_cache, v_cache, slot_mapping)


def store_kv_step(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """`store_kv` at `metadata.slot_mapping` (its values were checked when it was built): the
    engine's per-layer call. See `radixkv.kernels.metadata`."""
    _impl("store_kv", k_cache).store_kv_step(key, value, k_cache, v_cache, metadata)


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
    """Causal varlen paged attention (GQA; optionally a sliding window, logit soft-capping,
    attention sinks). See `reference.paged_attention` for the contract."""
    return _impl("paged_attention", q).paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        out=out,
        num_kv_splits=num_kv_splits,
        kind=kind,
    )


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
    """`paged_attention` over an `AttentionMetadata` (its values were checked when it was built):
    the engine's per-layer call. See `radixkv.kernels.metadata`."""
    return _impl("paged_attention", q).paged_attention_step(
        q,
        k_cache,
        v_cache,
        metadata,
        scale,
        out=out,
        num_kv_splits=num_kv_splits,
        kind=kind,
    )


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    num_slots: torch.Tensor,
) -> None:
    """Copy-on-write of partial blocks across the given layers. See `reference.copy_blocks`."""
    _impl("copy_blocks", k_cache).copy_blocks(k_cache, v_cache, src, dst, num_slots)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers' LlamaRMSNorm. See `reference.rms_norm`."""
    return _impl("rms_norm", x).rms_norm(x, weight, eps)


def rope_store_kv_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Rotary embedding of q and k, then k and v stored at `metadata.slot_mapping`; returns the
    rotated q: the engine's per-layer call for the models it fuses. See
    `reference.rope_store_kv`."""
    return _impl("rope_store_kv", k_cache).rope_store_kv_step(
        q, k, v, cos, sin, k_cache, v_cache, metadata
    )


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rope_store_kv_step` over loose tensors. See `reference.rope_store_kv`."""
    return _impl("rope_store_kv", k_cache).rope_store_kv(
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping
    )


# ------------------------------------------------------------------ the latent cache (MLA)


def store_latent(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' [latent | k_pe] at their slots of a latent cache, in place. See
    `latent_reference.store_latent`."""
    _impl("store_latent", cache, latent_reference).store_latent(latent, k_pe, cache, slot_mapping)


def store_latent_step(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata
) -> None:
    """`store_latent` at `metadata.slot_mapping`: the engine's per-layer call."""
    module = _impl("store_latent", cache, latent_reference)
    module.store_latent_step(latent, k_pe, cache, metadata)


def latent_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of latent-space queries over a paged latent cache (the absorbed
    form of MLA). See `latent_reference.latent_attention`."""
    return _impl("latent_attention", cache, latent_reference).latent_attention(
        q_latent,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        out=out,
        num_kv_splits=num_kv_splits,
    )


def latent_attention_step(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """`latent_attention` over an `AttentionMetadata` of a latent layer: the engine's call."""
    return _impl("latent_attention", cache, latent_reference).latent_attention_step(
        q_latent, q_pe, cache, metadata, scale, out=out, num_kv_splits=num_kv_splits
    )


def expanded_latent_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_b_weight: torch.Tensor,
    scale: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention over a paged latent cache up-projected a chunk at a time (MLA's
    expanded form). See `latent_reference.expanded_latent_attention`."""
    return _impl("expanded_latent_attention", cache, latent_reference).expanded_latent_attention(
        q_nope,
        q_pe,
        cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        kv_b_weight,
        scale,
        chunk_size=chunk_size,
    )


def expanded_latent_attention_step(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    metadata: AttentionMetadata,
    kv_b_weight: torch.Tensor,
    scale: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """`expanded_latent_attention` over an `AttentionMetadata` of a latent layer."""
    module = _impl("expanded_latent_attention", cache, latent_reference)
    return module.expanded_latent_attention_step(
        q_nope, q_pe, cache, metadata, kv_b_weight, scale, chunk_size=chunk_size
    )


# ------------------------------------------------------------------ the recurrent layers


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    metadata: RecurrentMetadata,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of a packed step, each request after its window of earlier
    inputs (updated in place). See `recurrent_reference.causal_conv1d`."""
    return _impl("causal_conv1d", x, recurrent_reference).causal_conv1d(
        x, weight, bias, conv_states, metadata, activation
    )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """Gated DeltaNet (g a decay a head) or Kimi Delta Attention (g a decay a head and key
    channel) over a packed step, each request from and back to its state slot. See
    `recurrent_reference.gated_delta_rule`."""
    return _impl("gated_delta_rule", v, recurrent_reference).gated_delta_rule(
        q, k, v, g, beta, states, metadata, scale=scale, use_qk_l2norm=use_qk_l2norm
    )


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = recurrent_reference.NO_LIMIT,
) -> torch.Tensor:
    """The selective scan of Mamba-2 / Mamba-1 over a packed step, each request from and back to
    its state slot. See `recurrent_reference.ssm_scan`."""
    return _impl("ssm_scan", x, recurrent_reference).ssm_scan(
        x,
        dt,
        A,
        B,
        C,
        D,
        states,
        metadata,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
