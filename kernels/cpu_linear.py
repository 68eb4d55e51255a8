"""A linear layer over few rows on a CPU through a small compiled kernel (`cpu_linear.c`).

A decode step multiplies every weight of the model by as many rows as it has requests. There the
product is bound by reading the weights, and MKL's sgemm, tuned for many rows, reaches a fraction
of that; the kernel reads each weight row once, in order, against all the step's rows
(`benchmarks/RESULTS.md`, CPU linears). Its sums run in another order than MKL's, so the result
equals `F.linear`'s to fp32 rounding, not bit for bit. Weights stay in `nn.Linear`'s own row-major
layout, fp32 or bf16 (bf16 widened in registers: half the bytes, fp32 arithmetic); inputs of other
shapes (more than `MAX_ROWS` rows, a strided weight, fp16) go to `F.linear`.

Built at first use for this machine (`cpu_build.py`, with FMA contraction: the kernel's sums are
its own anyway); threads: `torch.get_num_threads()` of the OpenMP runtime torch already loaded.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from radixkv.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_linear.c")
# Up to this many rows the kernel beats MKL at every SmolLM2 shape measured; above it MKL's
# blocking for many rows wins (benchmarks/RESULTS.md, CPU linears).
MAX_ROWS = 16
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c99")
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


class _LinearArgs(ctypes.Structure):
    """`LinearArgs` of cpu_linear.c, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("x_stride", ctypes.c_int64),
        ("out_stride", ctypes.c_int64),
        ("m", ctypes.c_int32),
        ("n", ctypes.c_int32),
        ("k", ctypes.c_int32),
        ("w_is_bf16", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


def available() -> bool:
    """Whether the compiled kernel is loaded (building it on the first call)."""
    return _library() is not None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` runs the kernel (else `F.linear`)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _WEIGHT_DTYPES
        and weight.dtype in _WEIGHT_DTYPES
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
        and available()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel where it `applies`; the result has x's
    dtype."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    bias32 = None if bias is None else bias.float().contiguous()
    args = _LinearArgs(
        x=rows.data_ptr(),
        w=weight.data_ptr(),
        bias=None if bias32 is None else bias32.data_ptr(),
        out=out.data_ptr(),
        x_stride=rows.stride(0),
        out_stride=out.stride(0),
        m=rows.shape[0],
        n=weight.shape[0],
        k=weight.shape[1],
        w_is_bf16=int(weight.dtype == torch.bfloat16),
        num_threads=torch.get_num_threads(),
    )
    _library().radixkv_linear(ctypes.byref(args))
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = cpu_build.load(SOURCE, _FLAGS, "CPU linear kernel")
    if library is not None:
        library.radixkv_linear.argtypes = [ctypes.POINTER(_LinearArgs)]
        library.radixkv_linear.restype = ctypes.c_int
    return library
