"""The GPU kernel benchmark's plumbing, run on the CPU (interpreter, fp16, tiny sizes, fake timer):
a crash here would otherwise surface only once a GPU is lent."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bench.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("kernel_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kernel_bench", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DEVICE", "cpu")
    monkeypatch.setattr(module, "DTYPE", torch.float16)  # bf16 tl.dot is broken in the interpreter
    monkeypatch.setattr(module, "_bench", lambda fn: (fn(), 1.0)[1])
    return module


@pytest.mark.interpreter
def test_kernel_bench_runs_on_tiny_sizes(bench, capsys):
    copy_gbps = bench.copy_bandwidth_gbps(num_bytes=1 << 20)
    decode = [bench.bench_decode(1, 40, block_size, sdpa_ms=2.0) for block_size in (16, 64)]
    assert all(r.max_abs_err is not None and r.max_abs_err < 1e-2 for r in decode)
    extend = [bench.bench_extend(1, 24, 16, block_size=16)]
    failures = bench._print_decode(decode, copy_gbps) + bench._print_extend(extend)
    out = capsys.readouterr().out
    assert "| 1 | 40 | 64 |" in out and "### Extend" in out
    assert failures == []  # the goals only bind at batch >= 16 and context >= 4k
    assert bench._attention_flops(1, 0, 2) == 4.0 * 32 * 128 * 3  # keys seen: 1 + 2
