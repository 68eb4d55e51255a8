"""radixkv's attention variants compiled for sm_90 (H100 / H200) on a machine without a GPU: what
each tile of kernel_bench's sweeps costs in registers, spills and shared memory, how deep its
loop buffers K and V, and how many CTAs an SM then holds.

    python3 -P benchmarks/sm90_compile.py

Triton compiles each launch for the target through its own ptxas (the JIT's specialization of the
launch's arguments, as on the GPU); nothing runs. The GPU machine has Triton 3.6: for its figures,
run this under that version (`pip download --no-deps triton==3.6.0`, unzip the wheel into a
folder and put it first on PYTHONPATH). Exits 1 when a swept tile spills registers: a sweep point
that spills wastes the GPU run's minutes.

Columns: K/V buffers is the leading dimension of the loop's shared K tile (1: single-buffered);
"in flight" is how many async copy groups the loop's wait on K/V leaves outstanding (0: the next
tile's loads are not overlapped with this tile's math).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # siblings by name: these scripts run with -P
import kernel_bench  # noqa: E402
import peer_kernels  # noqa: E402

CAPABILITY = 90


@dataclass(frozen=True, slots=True)
class Report:
    kernel: str
    head_dim: int
    variant: str
    regs: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    num_warps: int
    kv_buffers: str
    in_flight: str

    @property
    def ctas_per_sm(self) -> int:
        return kernel_bench.ctas_per_sm(self.regs, self.shared, self.num_warps)

    def row(self) -> str:
        return (
            f"| {self.kernel} | {self.head_dim} | {self.variant} | {self.regs} | "
            f"{self.spill_stores} / {self.spill_loads} | {self.stack} | {self.shared} | "
            f"{self.kv_buffers} | {self.in_flight} | {self.ctas_per_sm} |"
        )


HEADER = (
    "| kernel | head_dim | variant | registers | spill stores / loads (B) | stack (B) | "
    "shared (B) | K/V buffers | in flight | CTAs/SM |\n|---|---:|---|---:|---:|---:|---:|---:|"
    "---:|---:|"
)


def _ptxas_report(ptx: str) -> dict[str, int]:
    """Registers, spills and stack of the kernel, from ptxas -v on its PTX (the ptxas and the
    target name Triton itself compiles sm_90 with)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(CAPABILITY).path
    arch = sm_arch_from_capability(CAPABILITY)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={arch}", str(source), "-o", str(source) + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {
        "regs": number(r"Used (\d+) registers"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "stack": number(r"(\d+) bytes stack frame"),
    }


def _pipelining(ttgir: str) -> tuple[str, str]:
    """(K/V buffers, copy groups in flight at the loop's wait on them) read off the TTGIR."""
    buffers = re.findall(r"memdesc<(\d+)x\d+x\d+x(?:bf16|f16|f32), [^>]*mutable>", ttgir)
    waits = re.findall(r"= ttg\.async_wait %k\w*[^{\n]*\{num = (\d+)", ttgir)
    return (max(buffers, key=int) if buffers else "-", max(waits, key=int) if waits else "-")


class Compiler:
    """Replaces the kernels' launches by compiles for sm_90 while in use."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        self.target = GPUTarget("cuda", CAPABILITY, 32)
        self.backend = CUDABackend(self.target)
        self.compiled: list[tuple[str, Any]] = []

    def patch(self, kernel: Any) -> Callable[[], None]:
        """kernel.run compiles instead of launching; returns the undo."""
        import triton
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(kernel.signature, kernel.params, CUDABackend)

        def compile_only(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            del grid, warmup
            kwargs.setdefault("debug", False)
            bound, specialization, options = binder(*args, **kwargs)
            packed = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
            options, signature, constexprs, attrs = packed
            source = ASTSource(kernel, signature, constexprs, attrs)
            compiled = triton.compile(source, target=self.target, options=options.__dict__)
            self.compiled.append((kernel.fn.__name__, compiled))
            return compiled

        kernel.run = compile_only
        return lambda: delattr(kernel, "run")

    def report(self, head_dim: int, variant: str) -> list[Report]:
        reports = []
        for name, compiled in self.compiled:
            counts = _ptxas_report(compiled.asm["ptx"])
            buffers, in_flight = _pipelining(compiled.asm["ttgir"])
            meta = compiled.metadata
            reports.append(
                Report(
                    name.strip("_").removesuffix("_kernel"),
                    head_dim,
                    variant,
                    shared=meta.shared,
                    num_warps=meta.num_warps,
                    kv_buffers=buffers,
                    in_flight=in_flight,
                    **counts,
                )
            )
        self.compiled.clear()
        return reports


def _args(batch: int, new: int, head_dim: int) -> tuple[Any, ...]:
    """CPU tensors of the bench's shapes (nothing runs: they only set the specialization)."""
    k_cache = torch.empty(64, 16, kernel_bench.NUM_KV_HEADS, head_dim, dtype=torch.bfloat16)
    tables = torch.zeros(batch, 16, dtype=torch.int32)
    seq_lens = torch.full((batch,), 200, dtype=torch.int32)
    cu = torch.arange(batch + 1, dtype=torch.int32) * new
    q = torch.empty(batch * new, kernel_bench.NUM_Q_HEADS, head_dim, dtype=torch.bfloat16)
    return (q, k_cache, torch.empty_like(k_cache), tables, seq_lens, cu, head_dim**-0.5)


def compile_sweeps() -> list[Report]:
    """Every tile of kernel_bench's decode and extend sweeps, and the split merge's two forms,
    at each head_dim the bench sweeps."""
    from radixkv.kernels import triton_paged_attention as module

    compiler = Compiler()
    undo = [
        compiler.patch(module._paged_attention_kernel),
        compiler.patch(module._merge_splits_kernel),
    ]
    reports = []
    try:
        for head_dim in kernel_bench.QUICK.head_dims:
            for name, sweep, new in (
                ("_DECODE_TILES", kernel_bench.DECODE_SWEEP, 1),
                ("EXTEND_TILES", kernel_bench.EXTEND_SWEEP, 64),
            ):
                for tile in sweep:
                    with kernel_bench._tiles(name, tile):
                        module.paged_attention(*_args(4, new, head_dim), num_kv_splits=1)
                    reports += compiler.report(head_dim, kernel_bench._tile_name(tile))
            for splits in (4, 64):  # one split a load, many heads; many splits a load
                module.paged_attention(*_args(4, 1, head_dim), num_kv_splits=splits)
                reports += [
                    r
                    for r in compiler.report(head_dim, f"{splits} splits")
                    if r.kernel == "merge_splits"
                ]
    finally:
        for u in undo:
            u()
    return reports


@contextlib.contextmanager
def _as_if_sm90() -> Iterator[None]:
    """torch answers as on an H100 while the peers' files import: SGLang picks its extend tiles
    by the device's capability at import."""
    saved = torch.cuda.is_available, torch.cuda.get_device_capability
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *_: (CAPABILITY // 10, CAPABILITY % 10)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.get_device_capability = saved


def compile_peers() -> list[str]:
    """The peers' kernels as kernel_bench launches them (decode at batch 1 and 64, extend), for
    sm_90: their report rows, or why there are none. Their spills are theirs: not a failure."""
    from triton.runtime.jit import JITFunction

    with _as_if_sm90():
        try:
            peers = peer_kernels.load()
        except peer_kernels.PeersMissing as e:
            return [f"peers: {e}"]
    compiler = Compiler()
    modules = (peers.vllm, peers.sglang_decode, peers.sglang_extend, peers.sglang_metadata)
    kernels = [k for m in modules for k in vars(m).values() if isinstance(k, JITFunction)]
    undo = [compiler.patch(k) for k in kernels]
    lines = []
    try:
        for head_dim, (batch, new), (name, make) in itertools.product(
            kernel_bench.QUICK.head_dims, ((1, 1), (64, 1), (4, 64)), peer_kernels.LAUNCHERS.items()
        ):
            args = _args(batch, new, head_dim)
            options = {"num_sms": 132} if name == "SGLang" else {}
            variant = "decode" if new == 1 else "extend"
            try:
                make(peers, peer_kernels.Batch.of(args), torch.empty_like(args[0]), **options)()
                reports = compiler.report(head_dim, f"{variant}, batch {batch}")
                lines += [replace(r, kernel=f"{name} {r.kernel}").row() for r in reports]
            except Exception as e:
                compiler.compiled.clear()
                lines.append(
                    f"| {name} | {head_dim} | {variant} | FAILED: {type(e).__name__}: {e} |"
                )
    finally:
        for u in undo:
            u()
    return lines


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        print("sm90_compile compiles: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    import triton

    print(f"## radixkv's attention for sm_{CAPABILITY}, Triton {triton.__version__} (bf16)\n")
    print(HEADER)
    reports = compile_sweeps()
    for report in reports:
        print(report.row())
    spilling = [r for r in reports if r.spill_stores or r.spill_loads]
    print("\n### The peers' kernels, as kernel_bench launches them\n")
    print(HEADER)
    for line in compile_peers():
        print(line)
    for r in spilling:
        print(f"SPILLS: {r.kernel} head_dim {r.head_dim} {r.variant}")
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
