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
    monkeypatch.setattr(module, "_bench", lambda fn, timing=None: (fn(), 1.0)[1])
    return module


@pytest.mark.interpreter
def test_kernel_bench_runs_on_tiny_sizes(bench, capsys):
    copy_gbps = bench.copy_bandwidth_gbps(num_bytes=1 << 20)
    decode = [bench.bench_decode(1, 40, block_size, sdpa_ms=2.0) for block_size in (16, 64)]
    assert all(r.max_abs_err is not None and r.max_abs_err < 1e-2 for r in decode)
    extend = [bench.bench_extend(1, 24, 16, block_size=16)]
    chosen, times = bench.bench_splits(1, 40, block_size=16)
    assert chosen == 1 and len(times) == len(bench.SPLIT_SWEEP)  # one split on the CPU
    bench._print_decode(decode, copy_gbps)
    bench._print_extend(extend)
    bench._print_splits([(1, 40, chosen, times)])
    tiles = bench.bench_extend_tiles(1, 24, 16, block_size=16)
    assert len(tiles) == len(bench.EXTEND_SWEEP) and all(r.max_abs_err < 1e-2 for r in tiles)
    bench._print_extend_tiles([tiles])
    missed = bench._print_goals(bench.goals(decode, extend, copy_gbps))
    out = capsys.readouterr().out
    assert "| 1 | 40 | 64 |" in out and "### Extend" in out
    assert "| 1 | 40 | 1 | 1.0000* | 1.0000 |" in out
    assert "| 1 | 24 | 16 | 0.0 |" in out and "64x64 w4 s2" in out  # fake time: 1 ms
    assert "not in this sweep" in out  # no goal configuration at these sizes
    assert missed == []  # the fake timer gives paged and SDPA the same time: extend ratio 1
    assert bench._attention_flops(1, 0, 2) == 4.0 * 32 * 128 * 3  # keys seen: 1 + 2


def test_goal_ratios_are_the_worst_configuration(bench):
    def decode(batch, context, block_size, ms, gbps, sdpa_ms=1.0):
        return bench.DecodeResult(batch, context, block_size, ms, gbps, sdpa_ms, None)

    results = [
        decode(1, 16384, 16, 1.2, 100.0),
        decode(1, 16384, 64, 1.5, 100.0),  # worst: 1.5x SDPA
        decode(16, 4096, 16, 1.0, 2700.0),
        decode(16, 4096, 64, 1.0, 2400.0),  # worst: 0.8 of 3000
        decode(64, 4096, 16, 1.0, 1000.0),
        decode(64, 4096, 64, 1.0, 1020.0),  # spread 20 / 1010
    ]
    extend = [bench.ExtendResult(1, 4096, 512, 16, 1.0, 90.0, 1.0, 100.0, 0.0)]
    rows = bench.goals(results, extend, copy_gbps=3000.0)
    measured = [g.measured for g in rows]
    assert measured[0] == pytest.approx(1.5) and measured[1] == pytest.approx(0.8)
    # batch 16: 300 / 2550; batch 64: 20 / 1010; the worst is batch 16's
    assert measured[2] == pytest.approx(300 / 2550) and measured[3] == pytest.approx(0.9)
    assert [g.met for g in rows] == [False, False, False, True]
