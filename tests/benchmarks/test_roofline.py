"""The rooflines the GPU benchmarks print: on gpu_bench's model and workloads with the first H200
run's ceilings (4,247 GB/s copy; 790 TFLOP/s, the matrix rate measured on such a machine) they
give the figures the issue quotes, and a hand-counted case checks the terms."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import roofline

H200 = roofline.Ceilings(copy_gbps=4247.0, matmul_tflops=790.0)


@pytest.fixture(scope="module")
def full():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module.FULL
    finally:
        sys.modules.pop("gpu_bench", None)


def test_the_issues_rooflines(full):
    model = roofline.Model.of(full)
    assert model.weight_bytes == pytest.approx(2.077e9, rel=1e-3)  # ~1B bf16 weights read
    assert model.kv_bytes_per_token == 32768  # 16 layers x K and V x 8 heads x 64 x 2 bytes
    # Bucket-64 replay at a 640-token context: 0.80 ms; turn 6's prefill: 11.8 ms of compute.
    assert roofline.step_floor_s(model, [(1, 639)] * 64, H200) == pytest.approx(0.805e-3, rel=5e-3)
    assert roofline.step_floor_s(model, [(129, 2303)] * 32, H200) == pytest.approx(
        11.8e-3, rel=5e-3
    )
    # The decode workload: ~57k tok/s; chat, cache on over cache off: ~0.485.
    tokens = full.decode_prompts * full.decode_new_tokens
    assert tokens / roofline.decode_workload_floor_s(full, H200) == pytest.approx(57.5e3, rel=0.02)
    on = roofline.chat_floor(full, H200, reuses_prefixes=True)
    off = roofline.chat_floor(full, H200, reuses_prefixes=False)
    assert on.total_s / off.total_s == pytest.approx(0.485, abs=0.01)
    assert len(on.turn_prefill_s) == full.chat_turns
    assert on.turn_prefill_s[-1] < off.turn_prefill_s[-1] / 10  # 129 new tokens, not 2,432


def test_each_term_by_hand():
    shape = dict(hidden=4, layers=2, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10)
    model = roofline.Model(SimpleNamespace(**shape, dtype=torch.bfloat16))
    # attention: 4 * 2 * (2 * 2 + 2 * 1) = 48; MLP 3 * 4 * 8 = 96; two layers: 288 weights.
    assert model.layer_params == 288
    assert model.weight_bytes == (288 + 40) * 2
    assert model.kv_bytes_per_token == 2 * 2 * 1 * 2 * 2
    # 3 new tokens after 5 cached: 3 * 5 + 6 visible keys, 4 * layers * heads * head_dim each.
    assert model.attention_flops(3, 5) == 4.0 * 2 * 2 * 2 * 21
    assert model.forward_flops([(3, 5)]) == 2 * 288 * 3 + 2 * 10 * 4 + 4.0 * 2 * 2 * 2 * 21
    ceilings = roofline.Ceilings(copy_gbps=1e-6, matmul_tflops=1e-9)  # 1 kB/s, 1 kFLOP/s
    read = (model.weight_bytes + 8 * model.kv_bytes_per_token) / 1e3
    compute = model.forward_flops([(3, 5)]) / 1e3
    assert roofline.step_floor_s(model, [(3, 5)], ceilings) == pytest.approx(max(read, compute))
    assert roofline.fraction(1.0, 4.0) == 0.25 and roofline.fraction(1.0, None) is None
