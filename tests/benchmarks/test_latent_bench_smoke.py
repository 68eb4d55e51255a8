"""Smoke tests of the latent benchmarks: what must hold whatever the machine (no timings here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.latent_forms_bench import SHAPES, run_case
from benchmarks.latent_memory import GOAL_MODEL, MAX_OVER_FLOOR, MIN_RATIO, MODELS, measure

ROOT = Path(__file__).resolve().parents[2]


def test_the_latent_cache_of_deepseek_v3_is_71x_smaller_and_at_its_floor() -> None:
    r = measure(GOAL_MODEL, MODELS[GOAL_MODEL], block_size=16, num_blocks=2)
    assert r.latent_bytes_per_token == r.floor == 576 * 61 * 2
    assert r.latent_bytes_per_token <= MAX_OVER_FLOOR * r.floor
    assert r.expanded_bytes_per_token == 128 * (192 + 128) * 61 * 2
    assert r.ratio >= MIN_RATIO


def test_the_forms_bench_runs_both_forms_to_the_same_output() -> None:
    for name, dims in SHAPES.items():
        r = run_case(name, dims, q_len=8, prefix=40, repeats=1)
        assert r.max_diff < 1e-4
        assert r.absorbed_s > 0 and r.expanded_s > 0


def test_the_latent_kernels_compile_for_sm90_without_spills() -> None:
    """Triton's compiler and ptxas, on the CPU, in a process of its own: the interpreter this
    suite runs under replaces the kernels' compiled form."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "benchmarks/sm90_registers.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = [line.split() for line in result.stdout.splitlines()[1:] if line.startswith("_")]
    kernels = {row[0] for row in rows}
    assert {"_latent_attention_kernel", "_expanded_chunk_kernel", "_store_latent_kernel"} <= kernels
    for row in rows:
        registers, spills = int(row[-4]), int(row[-3])
        assert registers <= 255 and spills == 0, " ".join(row)


def test_the_decode_bytes_bench_runs_the_kernel_to_the_reference() -> None:
    """At tiny sizes, in a process of its own (the interpreter on a CPU, the GPU where there is
    one): the kernel's output matches the torch reference and the cache's bytes are the batch's
    latents once."""
    result = subprocess.run(
        [sys.executable, "benchmarks/latent_decode_bytes.py", "--batch", "2", "--context", "40"]
        + ["--heads", "16", "--block-size", "16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = result.stdout.splitlines()
    elem = 4 if "float32" in lines[0] else 2  # the interpreter runs fp32, a GPU bf16
    assert lines[1].startswith(f"latent cache bytes {2 * 40 * 576 * elem:,};")
    diff = next(line for line in lines if line.startswith("max |kernel - torch reference|"))
    assert float(diff.split()[-1]) < 2e-2  # bf16 on a GPU, fp32 under the interpreter
