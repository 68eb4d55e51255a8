"""Which compiled variants Triton's CUDA JIT would build for the kernels' launches, on the CPU.

Triton compiles a kernel once per key: every argument's type and specialization (an int that is 1
or a multiple of 16, a pointer's 16-byte alignment, unless the kernel says `do_not_specialize` /
`do_not_specialize_on_alignment`), the constexprs and the launch options. The interpreter compiles
nothing, but the launchers pass it the same arguments: `VariantRecorder` wraps each kernel's `run`
and feeds them to the binder Triton's JIT builds for its CUDA backend, which computes the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

KERNEL_MODULES = {
    "store_kv": ("triton_store_kv", "_store_kv_kernel"),
    "paged_attention": ("triton_paged_attention", "_paged_attention_kernel"),
    "merge_splits": ("triton_paged_attention", "_merge_splits_kernel"),
    "copy_blocks": ("triton_copy_blocks", "_copy_blocks_kernel"),
    "rms_norm": ("triton_rms_norm", "_rms_norm_kernel"),
    "rope_store_kv": ("triton_rope_store_kv", "_rope_store_kv_kernel"),
    "store_latent": ("triton_store_latent", "_store_latent_kernel"),
    "latent_attention": ("triton_latent_attention", "_latent_attention_kernel"),
    "gather_latents": ("triton_latent_expanded", "_gather_latents_kernel"),
    "expanded_chunk": ("triton_latent_expanded", "_expanded_chunk_kernel"),
}


def radixkv_kernels() -> dict[str, Any]:
    """Every Triton kernel radixkv launches, by a short name."""
    import importlib

    return {
        name: getattr(importlib.import_module(f"radixkv.kernels.{module}"), attr)
        for name, (module, attr) in KERNEL_MODULES.items()
    }


def _cuda_binder(kernel: Any) -> Any:
    """Triton's argument binder for `kernel` on the CUDA backend, with the kernel's own
    specialization settings (an interpreted kernel keeps `triton.jit`'s keyword arguments)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    settings = getattr(kernel, "kwargs", None)
    if settings is None:  # a compiled kernel
        settings = {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
        }
    jit = JITFunction(
        kernel.fn,
        do_not_specialize=settings.get("do_not_specialize"),
        do_not_specialize_on_alignment=settings.get("do_not_specialize_on_alignment"),
    )
    return create_function_from_signature(jit.signature, jit.params, CUDABackend)


class VariantRecorder:
    """Records the CUDA compile key of every launch of the given kernels (name -> kernel)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kernels: Mapping[str, Any]) -> None:
        self.keys: dict[str, list[tuple]] = {name: [] for name in kernels}
        for name, kernel in kernels.items():
            monkeypatch.setattr(kernel, "run", self._recording(name, kernel))

    def _recording(self, name: str, kernel: Any) -> Any:
        binder, run = _cuda_binder(kernel), kernel.run

        def recording_run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            _, specialization, options = binder(*args, **kwargs)
            self.keys[name].append((tuple(specialization), tuple(sorted(options.items()))))
            return run(*args, grid=grid, warmup=warmup, **kwargs)

        return recording_run

    def variants(self) -> dict[str, set[tuple]]:
        """name -> the distinct keys launched so far (one compile each on a GPU)."""
        return {name: set(keys) for name, keys in self.keys.items()}

    def launches(self) -> int:
        return sum(len(keys) for keys in self.keys.values())
