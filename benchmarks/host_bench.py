"""Host time of a decode step's Python parts, a git revision's code against this tree's, in one
process: step packing (`step_inputs.pack_step`), sampling (`sampler.sample`) and incremental
detokenisation (`detokenizer.IncrementalDetokenizer`). On a GPU these run between two replays,
so they bound the step rate.

    .venv/bin/python benchmarks/host_bench.py --against 4bfeb91

REV's version of each module is loaded from `git show` beside this tree's (they share the rest of
the package); calls alternate between the two, and each cell is the median CPU time of the
calling thread (one torch thread).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from radixkv import SamplingParams
from radixkv.engine.model import detokenizer
from radixkv.engine.sampling import sampler
from radixkv.engine.step import step_inputs
from radixkv.scheduler.output import ScheduledRequest

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = Path(os.path.expanduser("~")) / ".cache" / "radixkv" / "models" / "SmolLM2-135M-Instruct"


def load_revision(rev: str, module: ModuleType) -> ModuleType:
    """`module` as it was at git revision `rev` (its file from `git show`, imported beside)."""
    rel = Path(module.__file__).resolve().relative_to(ROOT)
    source = subprocess.run(
        ["git", "show", f"{rev}:{rel}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / rel.name
    path.write_text(source)
    name = f"{module.__name__}_at_{rev}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    sys.modules[name] = old  # dataclasses look their module up
    spec.loader.exec_module(old)
    return old


def compare(label: str, before: Callable[[], object], after: Callable[[], object], n: int) -> None:
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(n):
        for side, fn in (("before", before), ("after", after)):
            t0 = time.thread_time()
            fn()
            times[side].append(time.thread_time() - t0)
    b, a = (1e6 * statistics.median(times[s]) for s in ("before", "after"))
    print(f"| {label} | {b:.0f} | {a:.0f} | {a / b:.2f} |", flush=True)


def decode_rows(rng: np.random.Generator, n: int, context: int) -> list[ScheduledRequest]:
    rows = []
    for i in range(n):
        start = context + int(rng.integers(0, 256))
        blocks = tuple(int(b) for b in rng.integers(0, 10_000, -(-(start + 1) // 16)))
        rows.append(
            ScheduledRequest(f"r{i}", (int(rng.integers(0, 32_000)),), start, (blocks,), True)
        )
    return rows


def packing(old: ModuleType, repeats: int) -> None:
    rng = np.random.default_rng(0)
    decode = decode_rows(rng, 64, 512)
    chunk = ScheduledRequest("p", tuple(range(2048)), 1024, (tuple(range(192)),), True)
    cases = [
        ("pack_step, 64 decode rows, context 512-768", decode, step_inputs.layout_for(decode)),
        ("pack_step, graph bucket 64 (164 columns)", decode, step_inputs.bucket_layout(64, 164)),
        ("pack_step, 8 decode rows", decode[:8], step_inputs.layout_for(decode[:8])),
        ("pack_step, 63 decode rows + 2048-token chunk", [*decode[:63], chunk], None),
    ]
    for label, rows, layout in cases:
        layout = layout or step_inputs.layout_for(rows)
        flats = [np.zeros(layout.total, np.int32) for _ in range(2)]
        old.pack_step(rows, (), 16, layout, flats[0])
        step_inputs.pack_step(rows, (), 16, layout, flats[1])
        assert (flats[0] == flats[1]).all(), label
        compare(
            label,
            lambda r=rows, lay=layout, f=flats[0]: old.pack_step(r, (), 16, lay, f),
            lambda r=rows, lay=layout, f=flats[1]: step_inputs.pack_step(r, (), 16, lay, f),
            repeats,
        )


def sampling(old: ModuleType, repeats: int) -> None:
    vocab = 49_152
    for rows in (8, 64):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4
        for label, params in (
            ("temperature 0.7, top-p 0.9", SamplingParams(temperature=0.7, top_p=0.9)),
            ("temperature 1.0", SamplingParams(temperature=1.0)),
        ):
            _sampling_case(old, logits, params, f"sample, {rows} rows x {vocab} vocab, {label}")


def _sampling_case(old: ModuleType, logits: torch.Tensor, p: SamplingParams, label: str) -> None:
    rows, cpu = logits.shape[0], torch.device("cpu")
    compare(
        label,
        lambda: old.sample(logits, [p] * rows, [old.make_generator(i, cpu) for i in range(rows)]),
        lambda: sampler.sample(
            logits, [p] * rows, [sampler.make_generator(i) for i in range(rows)]
        ),
        15,
    )


def detokenizing(old: ModuleType, repeats: int) -> None:
    if not SMOLLM2.is_dir():
        print("| detokenizer | (SmolLM2's tokenizer not converted yet: run `make chat` once) |")
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    text = "The quick brown fox jumps over the lazy dog. Bonjour 🙂 — 日本語. " * 40
    ids = tokenizer.encode(text, add_special_tokens=False)[:512]

    def stream(cls: type) -> None:
        detok = cls(tokenizer)
        for token in ids:
            detok.push((token,))
        detok.finish()

    compare(
        "detokenize 512 tokens of SmolLM2 text, one at a time",
        lambda: stream(old.IncrementalDetokenizer),
        lambda: stream(detokenizer.IncrementalDetokenizer),
        max(3, repeats // 20),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", metavar="REV", required=True, help="the git revision")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(0)
    print(f"{args.against} (before) vs this tree (after): median CPU µs per call")
    print("| call | before | after | after / before |\n|---|---:|---:|---:|")
    packing(load_revision(args.against, step_inputs), args.repeats)
    sampling(load_revision(args.against, sampler), args.repeats)
    detokenizing(load_revision(args.against, detokenizer), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
