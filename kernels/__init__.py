"""Paged KV-cache kernels (Triton on CUDA, plain torch on CPU). Imported as `radixkv.kernels`.

Cache layout per layer: K and V each `[num_blocks, block_size, num_kv_heads, head_dim]`.

- `store_kv`: write new tokens' K/V at their slots (slot < 0 skipped).
- `paged_attention`: causal varlen attention of new tokens over their cached context (decode,
  extend, prefill; GQA; split-KV for long contexts).
- `copy_blocks`: copy-on-write of the valid leading slots of partial blocks, across layers.

CUDA tensors run the Triton kernels (`triton_*.py`), CPU tensors the torch reference
(`reference.py`, the executable spec); `use_backend` overrides the choice. Importing this package
imports neither triton nor transformers.

The Triton kernels also run under `TRITON_INTERPRET=1` (how the CPU tests exercise them), which
shapes how they are written: pointer arithmetic rather than `tl.make_block_ptr` (gone in Triton
3.9), one fixed launch config rather than `@triton.autotune` (more than one config fails in the
interpreter). The interpreter's `tl.dot` returns garbage for bf16 inputs, so bf16 is tested on a
GPU only (`tests/kernels/test_kernel_gpu.py`).
"""

from radixkv.kernels.checks import check_attention_metadata
from radixkv.kernels.dispatch import (
    backend_for,
    copy_blocks,
    paged_attention,
    store_kv,
    use_backend,
)

__all__ = [
    "backend_for",
    "check_attention_metadata",
    "copy_blocks",
    "paged_attention",
    "store_kv",
    "use_backend",
]
