"""Paged KV-cache kernels (Triton on CUDA, plain torch on CPU). Imported as `radixkv.kernels`.

Cache layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.

- `store_kv`: write new tokens' K/V at their slots (slot < 0 skipped).
- `paged_attention`: causal varlen attention of new tokens over their cached context (decode,
  extend, prefill; GQA; split-KV for long contexts), of the layer's `AttentionKind`: full causal,
  or a sliding window, logit soft-capping and learned sinks.
- `copy_blocks`: copy-on-write of the valid leading slots of partial blocks, across layers.
- `rms_norm`, `rope_store_kv`: the elementwise work of a Llama layer fused into one kernel each
  (RMSNorm; rotary embedding of q and k together with the K/V store), for the engine's decode.
- `store_latent`, `latent_attention`, `expanded_latent_attention`: the paged latent cache of
  multi-head latent attention (DeepSeek V2 / V3 and kin; one vector a token and layer, shared by
  every head) and the two forms of attention over it (`latent_metadata.py`).
- `causal_conv1d`, `gated_delta_rule`, `ssm_scan`: the recurrent layers of hybrid models (short
  convolutions, Gated DeltaNet and Kimi Delta Attention, Mamba-2 / Mamba-1) over a packed step,
  each request reading and writing its own state slot (`RecurrentMetadata`; torch versions in
  `recurrent_reference.py`).

Each function validates its inputs (a ValueError naming the argument), their values too except in
the Triton launchers on CUDA (that would sync). The engine calls store_kv and paged_attention once
per layer per step with the same metadata, so it builds an `AttentionMetadata` once per step, which
checks the values then (on the host: no device sync) and precomputes the torch reference's gather
indices, and calls `store_kv_step` / `paged_attention_step`, which check only the per-layer
tensors' shapes, dtypes and devices against it (`metadata.py`).

CUDA tensors run the Triton kernels (`triton_*.py`); CPU tensors run `cpu_attention.py` (attention
in a small C kernel compiled at first use, the rest the reference) or, where it cannot be built,
the torch reference (`reference.py`, the executable spec); `use_backend` overrides the choice.
Importing this package imports neither triton nor transformers.

The Triton kernels also run under `TRITON_INTERPRET=1` (how the CPU tests exercise them), which
shapes how they are written: pointer arithmetic rather than `tl.make_block_ptr` (gone in Triton
3.9), one fixed launch config rather than `@triton.autotune` (more than one config fails in the
interpreter). The interpreter's `tl.dot` returns garbage for bf16 inputs, so bf16 is tested on a
GPU only (`tests/kernels/test_kernel_gpu.py`).
"""

from radixkv.kernels.attention_kind import FULL, AttentionKind
from radixkv.kernels.checks import check_attention_metadata
from radixkv.kernels.dispatch import (
    backend_for,
    causal_conv1d,
    copy_blocks,
    expanded_latent_attention,
    expanded_latent_attention_step,
    gated_delta_rule,
    latent_attention,
    latent_attention_step,
    paged_attention,
    paged_attention_step,
    rms_norm,
    rope_store_kv,
    rope_store_kv_step,
    ssm_scan,
    store_kv,
    store_kv_step,
    store_latent,
    store_latent_step,
    use_backend,
)
from radixkv.kernels.jit_monitor import CompileCounter, compile_counter
from radixkv.kernels.latent_metadata import (
    LatentDims,
    LatentPart,
    LatentStep,
    latent_cache_shape,
    plan_latent_step,
)
from radixkv.kernels.metadata import AttentionMetadata
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

__all__ = [
    "FULL",
    "AttentionKind",
    "AttentionMetadata",
    "CompileCounter",
    "LatentDims",
    "LatentPart",
    "LatentStep",
    "RecurrentMetadata",
    "backend_for",
    "causal_conv1d",
    "check_attention_metadata",
    "compile_counter",
    "copy_blocks",
    "expanded_latent_attention",
    "expanded_latent_attention_step",
    "gated_delta_rule",
    "latent_attention",
    "latent_attention_step",
    "latent_cache_shape",
    "paged_attention",
    "paged_attention_step",
    "plan_latent_step",
    "rms_norm",
    "rope_store_kv",
    "rope_store_kv_step",
    "ssm_scan",
    "store_kv",
    "store_kv_step",
    "store_latent",
    "store_latent_step",
    "use_backend",
]
