"""Registers, spills and shared memory of the latent kernels compiled for sm_90, on a CPU.

A GPU is not needed to see whether a kernel fits an H100 / H200: Triton's compiler and the ptxas
its wheel carries run anywhere. This script calls the kernels' own launchers with CPU tensors of
DeepSeek V3's shape (bf16: 128 heads, kv_lora_rank 512, rope 64, nope 128, v 128), records each
launch instead of running it, compiles the recorded launch for sm_90 exactly as Triton's JIT
would on a GPU (the same binder, hence the same specialization and alignment attributes), and
prints what ptxas reports for each variant: registers per thread, spill stores / loads, shared
memory, and how many CTAs of it one SM holds.

    python benchmarks/sm90_registers.py

Run it without TRITON_INTERPRET (the interpreter replaces the kernels' compiled form).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# sm_90: 64k 32-bit registers, 228 KiB shared memory, 64 warps and 32 CTAs an SM.
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
WARPS_PER_SM = 64
CTAS_PER_SM = 32


@dataclass(frozen=True)
class Variant:
    kernel: str
    label: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int

    @property
    def ctas_per_sm(self) -> int:
        by_registers = REGISTERS_PER_SM // max(1, self.registers * 32 * self.num_warps)
        by_shared = SHARED_PER_SM // self.shared_bytes if self.shared_bytes else CTAS_PER_SM
        return min(by_registers, by_shared, WARPS_PER_SM // self.num_warps, CTAS_PER_SM)


@dataclass
class _Launch:
    kernel: Any
    args: tuple
    kwargs: dict


@contextmanager
def recorded_launches(kernels: list[Any]) -> Iterator[list[_Launch]]:
    """Inside the block, launches of `kernels` are recorded and not run."""
    launches: list[_Launch] = []
    saved = [k.run for k in kernels]

    def recorder(kernel: Any) -> Callable[..., None]:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            launches.append(_Launch(kernel, args, kwargs))

        return run

    for k in kernels:
        k.run = recorder(k)
    try:
        yield launches
    finally:
        for k, run in zip(kernels, saved, strict=True):
            k.run = run


def compile_sm90(launch: _Launch, label: str) -> Variant:
    """Compile one recorded launch for sm_90 and read ptxas' resource report of it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    src = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(src, target=target, options=options.__dict__)
    registers, spills = _ptxas_report(compiled.asm["ptx"])
    return Variant(
        kernel.__name__,
        label,
        registers,
        spills,
        compiled.metadata.shared,
        options.num_warps,
    )


def _ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) of the PTX's kernel, from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas Triton itself compiles sm_90 with
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(folder, "k.cubin")],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            raise RuntimeError(f"ptxas failed: {result.stderr.strip()}")
    report = result.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    return registers, spills


def deepseek_v3_launches() -> list[tuple[str, _Launch]]:
    """The latent kernels' launches at DeepSeek V3's shape: store, decode (one split and
    four), extend, and the expanded form's gather and chunk (first and later chunks)."""
    from radixkv.kernels import LatentDims, triton_latent_attention, triton_store_latent
    from radixkv.kernels import triton_latent_expanded as expanded
    from radixkv.kernels.triton_paged_attention import _merge_splits_kernel

    dims = LatentDims(128, 512, 64, 128, 128)
    dtype, block_size, num_blocks = torch.bfloat16, 64, 8
    cache = torch.zeros((num_blocks, block_size, dims.latent_dim), dtype=dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(2, -1)
    labels: list[str] = []
    kernels = [
        triton_store_latent._store_latent_kernel,
        triton_latent_attention._latent_attention_kernel,
        _merge_splits_kernel,
        expanded._gather_latents_kernel,
        expanded._expanded_chunk_kernel,
    ]

    def queries(num_tokens: int, width: int) -> torch.Tensor:
        return torch.zeros((num_tokens, dims.num_heads, width), dtype=dtype)

    with recorded_launches(kernels) as launches:
        latent = torch.zeros((4, dims.latent_dim), dtype=dtype)
        slots = torch.arange(4, dtype=torch.int64)
        triton_store_latent.store_latent(latent[:, :512], latent[:, 512:], cache, slots)
        labels.append("store")
        decode = (tables, torch.tensor([100, 200], dtype=torch.int32))
        cu_decode = torch.tensor([0, 1, 2], dtype=torch.int32)
        for splits in (1, 4):
            triton_latent_attention.latent_attention(
                queries(2, 512), queries(2, 64), cache, *decode, cu_decode, 0.1,
                num_kv_splits=splits,
            )  # fmt: skip
            labels += [f"decode, {splits} split(s)"] + (["merge of 4 splits"] if splits > 1 else [])
        extend = (tables, torch.tensor([150, 256], dtype=torch.int32))
        cu_extend = torch.tensor([0, 50, 306], dtype=torch.int32)
        triton_latent_attention.latent_attention(
            queries(306, 512), queries(306, 64), cache, *extend, cu_extend, 0.1
        )
        labels.append("extend (absorbed)")
        weight = torch.zeros((dims.num_heads * 256, 512), dtype=dtype)
        expanded.expanded_latent_attention(
            queries(306, 128), queries(306, 64), cache, *extend, cu_extend, weight, 0.1,
            chunk_size=128,
        )  # fmt: skip
        labels += ["gather (expanded)", "chunk 0 (expanded)"]
        labels += ["gather (expanded)", "chunk 1 (expanded)"]
    return list(zip(labels, launches, strict=True))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the interpreter compiles nothing")
    seen: set[tuple] = set()
    print(f"{'kernel':<28} {'launch':<22} {'regs':>5} {'spill B':>8} {'smem KiB':>9} {'CTA/SM':>7}")
    for label, launch in deepseek_v3_launches():
        key = (launch.kernel.__name__, tuple(sorted(launch.kwargs.items())))
        if key in seen:  # later chunks: the same variant as the second
            continue
        seen.add(key)
        v = compile_sm90(launch, label)
        print(
            f"{v.kernel:<28} {v.label:<22} {v.registers:>5} {v.spill_bytes:>8} "
            f"{v.shared_bytes / 1024:>9.1f} {v.ctas_per_sm:>7}"
        )


if __name__ == "__main__":
    main()
