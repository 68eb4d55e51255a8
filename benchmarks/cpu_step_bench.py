"""End-to-end CPU step timing of the default model: decode tokens/s at batch 1 and 8, and the time
of a 1024-token prefill, with one torch thread (two threads
stall on OpenMP spin-waits whenever the other core is busy).

    .venv/bin/python benchmarks/cpu_step_bench.py [--repeats 5]
    .venv/bin/python benchmarks/cpu_step_bench.py --against REV   # REV vs this tree, one run

Every engine step (schedule + forward + sample) is timed twice: wall clock, and CPU time of the
calling thread. On a shared machine the wall clock swings with the neighbours' load; with one torch
thread all the work runs on the calling thread, so its CPU time is the steadier number. Each
measurement is warmed up once (never timed) and repeated; the median is printed. Prompts are random
token ids, distinct per call, so the prefix cache never serves a timed prefill.

`--against REV` runs this script over the package of git revision REV and over this tree's,
alternately, `--rounds` times each (each run prints its medians as JSON with `--json`), and prints
the best run of each side and their ratio: both sides face the same machine load. `--overlap-ab`
does the same with this tree's engine, steps synchronous (before) and overlapped (after); an
overlapped run has one more step at the end (it reads the last token), timed with the decode.

A second table isolates the kernel layer of one step at the model's shapes: every layer's store_kv +
paged_attention called with loose tensors (values validated, reference plan rebuilt in each layer)
against one `AttentionMetadata` built per step and the `*_step` kernels (what the engine does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from radixkv import LLM, SamplingParams
from radixkv.kernels import AttentionMetadata, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, run with -P or not
from revision import exported


class StepTimer:
    """Wraps `llm._run_step` and records (wall_s, cpu_s) of every step."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[float, float]] = []
        inner = llm._run_step

        def timed() -> None:
            w0, c0 = time.perf_counter(), time.thread_time()
            inner()
            self.steps.append((time.perf_counter() - w0, time.thread_time() - c0))

        llm._run_step = timed  # type: ignore[method-assign]

    def run(self, fn: Callable[[], object]) -> list[tuple[float, float]]:
        self.steps = []
        fn()
        return self.steps


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def measure(
    repeats: int, new_tokens: int, prefill_tokens: int, overlap: bool | None = None
) -> dict[str, list[tuple]]:
    """measurement name -> [(wall, cpu)] of `repeats` runs, each after one untimed warm-up."""
    torch.set_num_threads(1)
    llm = LLM(num_threads=1) if overlap is None else LLM(num_threads=1, async_scheduling=overlap)
    timer = StepTimer(llm)
    rng = random.Random(0)

    def decode(batch: int) -> tuple[float, float]:
        """tokens/s of the decode steps (every step after the one prefill step)."""
        params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
        prompts = _prompts(rng, batch, 16, llm.vocab_size)
        steps = timer.run(lambda: llm.generate(prompts, params))[1:]
        assert len(steps) in (new_tokens, new_tokens + 1), len(steps)  # + 1: overlapped
        return tuple(batch * new_tokens / sum(s[i] for s in steps) for i in (0, 1))

    def prefill() -> tuple[float, float]:
        """seconds of every step of a prompt's prefill (generating one token)."""
        prompts = _prompts(rng, 1, prefill_tokens, llm.vocab_size)
        steps = timer.run(lambda: llm.generate(prompts, SamplingParams(max_tokens=1)))
        return tuple(sum(s[i] for s in steps) for i in (0, 1))

    rows = (
        ("decode tok/s, batch 1", lambda: decode(1)),
        ("decode tok/s, batch 8", lambda: decode(8)),
        (f"prefill {prefill_tokens} tokens, s", prefill),
    )
    results = {}
    for name, fn in rows:
        fn()  # warm-up, never timed
        results[name] = [fn() for _ in range(repeats)]
    results["_llm"] = llm  # for the kernel-layer table
    return results


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def compare(title: str, sides: dict[str, tuple[str, list[str]]], args: argparse.Namespace) -> None:
    """This script once per side (name -> (package folder, extra arguments)), alternately,
    `--rounds` times each; prints the best run of each side and their ratio."""
    script = Path(__file__).resolve()
    argv = ["--json", "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens)]
    argv += ["--prefill-tokens", str(args.prefill_tokens)]
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side, (src, extra) in sides.items():
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run(
                [sys.executable, "-P", str(script), *argv, *extra],
                cwd=tempfile.gettempdir(),  # not the repo root: kernels/ stays unimportable
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[side].append(json.loads(out.strip().splitlines()[-1]))
    before, after = sides
    print(f"{title}, CPU time medians, best of {args.rounds} runs")
    print(f"| measurement | {before} | {after} | {after} / {before} |")
    print("|---|---|---|---|")
    for name in runs[after][0]:
        best = max if "tok/s" in name else min
        a = best(r[name] for r in runs[before])
        b = best(r[name] for r in runs[after])
        print(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--against", metavar="REV", help="compare with a git revision")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side with --against")
    parser.add_argument("--json", action="store_true", help="print CPU-time medians as JSON")
    parser.add_argument(
        "--async-scheduling", choices=("on", "off"), help="overlapped steps (default: the engine's)"
    )
    parser.add_argument(
        "--overlap-ab", action="store_true", help="compare synchronous and overlapped steps"
    )
    args = parser.parse_args()
    tree = str(Path(__file__).resolve().parent.parent)
    if args.against:
        with exported(args.against) as export:
            sides = {"before": (str(export), []), "after": (tree, [])}
            compare(f"{args.against} (before) vs this tree (after)", sides, args)
        return
    if args.overlap_ab:
        sides = {"sync": (tree, ["--async-scheduling", "off"])}
        sides["overlapped"] = (tree, ["--async-scheduling", "on"])
        compare("this tree, steps synchronous vs overlapped", sides, args)
        return
    overlap = None if args.async_scheduling is None else args.async_scheduling == "on"
    results = measure(args.repeats, args.new_tokens, args.prefill_tokens, overlap)
    llm = results.pop("_llm")
    if args.json:
        print(json.dumps({k: statistics.median(r[1] for r in v) for k, v in results.items()}))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.repeats} runs")
    print("| measurement | CPU time: median (min-max) | wall: median (min-max) |")
    print("|---|---|---|")
    for name, runs in results.items():
        cpu, wall = _cell([r[1] for r in runs]), _cell([r[0] for r in runs])
        print(f"| {name} | {cpu} | {wall} |", flush=True)
    print()
    # Last: it writes K/V into the engine's cache blocks behind the prefix cache's back.
    kernel_layer_table(llm, args.repeats)


class _Step(NamedTuple):
    """Kernel inputs of one synthetic step (one layer's worth; every layer reuses them)."""

    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], stored as both K and V
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    scale: float


def _make_step(llm: LLM, seq_lens: list[int], q_lens: list[int], gen: torch.Generator) -> _Step:
    _, num_blocks, block_size, num_kv_heads, head_dim = llm.runner.kv[0].k_cache.shape
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    tables = perm.view(len(seq_lens), max_blocks).int()
    slots = [
        int(tables[r, pos // block_size]) * block_size + pos % block_size
        for r, (n, q) in enumerate(zip(seq_lens, q_lens, strict=True))
        for pos in range(n - q, n)
    ]
    num_q_heads = llm.model.config.num_attention_heads
    return _Step(
        q=torch.randn(len(slots), num_q_heads, head_dim, generator=gen),
        kv=torch.randn(len(slots), num_kv_heads, head_dim, generator=gen),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).int(),
        slot_mapping=torch.tensor(slots),
        scale=head_dim**-0.5,
    )


def _loose_layers(s: _Step, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    for k, v in zip(k_cache, v_cache, strict=True):
        reference.store_kv(s.kv, s.kv, k, v, s.slot_mapping)
        reference.paged_attention(s.q, k, v, s.block_tables, s.seq_lens, s.cu_seqlens_q, s.scale)


def _metadata_layers(s: _Step, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    meta = AttentionMetadata(
        s.block_tables,
        s.seq_lens,
        s.cu_seqlens_q,
        tuple(k_cache.shape[1:]),
        slot_mapping=s.slot_mapping,
    )
    for k, v in zip(k_cache, v_cache, strict=True):
        reference.store_kv_step(s.kv, s.kv, k, v, meta)
        reference.paged_attention_step(s.q, k, v, meta, s.scale)


def kernel_layer_table(llm: LLM, repeats: int) -> None:
    """CPU time of the kernel calls of one step over all layers: loose vs metadata once."""
    k_cache, v_cache = llm.runner.kv[0].k_cache, llm.runner.kv[0].v_cache
    gen = torch.Generator().manual_seed(0)
    cases = {
        "decode, batch 1, context 48": ([48], [1]),
        "decode, batch 8, context 48-55": ([48 + i for i in range(8)], [1] * 8),
        "decode, batch 8, context 1000-1007": ([1000 + i for i in range(8)], [1] * 8),
        "prefill chunk 512..1024": ([1024], [512]),
    }
    print(f"kernel layer of one step ({k_cache.shape[0]} layers), CPU ms, median of {repeats}")
    print("| step | loose tensors, every layer | AttentionMetadata once + *_step | saved |")
    print("|---|---|---|---|")
    for name, (seq_lens, q_lens) in cases.items():
        step = _make_step(llm, seq_lens, q_lens, gen)
        times: dict[str, list[float]] = {"loose": [], "metadata": []}
        _loose_layers(step, k_cache, v_cache)  # warm-up
        _metadata_layers(step, k_cache, v_cache)
        for _ in range(repeats):  # interleaved: a neighbour's load hits both alike
            for label, fn in (("loose", _loose_layers), ("metadata", _metadata_layers)):
                c0 = time.thread_time()
                fn(step, k_cache, v_cache)
                times[label].append(1e3 * (time.thread_time() - c0))
        a, b = statistics.median(times["loose"]), statistics.median(times["metadata"])
        print(f"| {name} | {a:.1f} | {b:.1f} | {a - b:.1f} ({(a - b) / a:.0%}) |", flush=True)


if __name__ == "__main__":
    main()
