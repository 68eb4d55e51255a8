"""The state group's speed goals on a CPU (issue 40): a warm turn's TTFT against the cold one's,
and what taking snapshots adds to the steps that take them.

A tiny random model of Qwen3.5's class (`qwen3_5_text`: Gated DeltaNet on three of every four
layers, full attention on the fourth) with per-head sizes of the real model's order runs through
`LLM`, one torch thread, in one process:

    ttft      a `--conversation`-token first turn on a cold cache (fresh tokens every round: a
              chunked prefill that leaves snapshots at its chunk ends and its end), then the next
              turn (that turn, a `--reply`-token reply, a `--turn`-token question), which resumes
              from the snapshot at the first turn's end. Goal: warm / cold <= 0.3x.
    snapshot  the same cold prefill with the prefix cache on (every chunk end and the prompt's
              end snapshot the recurrent state into the pool; the tree takes the KV) and off (no
              tree, no snapshot): on / off - 1 is what the snapshots and the tree's bookkeeping
              cost the steps together. Goal: <= 5 %.

Rounds interleave the sides; each figure is the median over rounds of the process's CPU time
(`time.process_time`) and wall time, the load average beside them. Greedy tokens of the warm turn
are compared with the cache-off engine's.

    python -m benchmarks.hybrid_engine_bench [--rounds 5] [--conversation 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_archs import build_config, save_tiny_model
from tiny_llama import VOCAB_SIZE

from radixkv import LLM, SamplingParams


def qwen3_5_shaped(args: argparse.Namespace):
    return build_config(
        "qwen3_5_text",
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        * (args.layers // 4),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=8,
        linear_num_key_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB_SIZE) for _ in range(n)]


def timed_first_token(llm: LLM, prompt: list[int]) -> tuple[float, float, int]:
    """CPU and wall seconds to the first greedy token of `prompt`, and the token."""
    cpu, wall = time.process_time(), time.perf_counter()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return time.process_time() - cpu, time.perf_counter() - wall, out.token_ids[0]


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_model(qwen3_5_shaped(args), Path(folder))
        common = dict(num_threads=1, max_num_seqs=4, chunked_prefill_size=args.chunk)
        on = LLM(str(path), **common)
        off = LLM(str(path), enable_prefix_cache=False, **common)
        timed_first_token(on, _tokens(rng, 64))  # warm-up: kernels built, allocator primed
        timed_first_token(off, _tokens(rng, 64))
        cold, warm, on_prefill, off_prefill = [], [], [], []
        equal = 0
        for r in range(args.rounds):
            first = _tokens(rng, args.conversation)
            sides = [(off, off_prefill), (on, on_prefill)]
            for llm, into in sides if r % 2 else sides[::-1]:
                into.append(timed_first_token(llm, first)[:2])
            cold.append(on_prefill[-1])
            reply = on.generate([first], SamplingParams(max_tokens=args.reply, temperature=0.0))
            nxt = first + list(reply[0].token_ids) + _tokens(rng, args.turn)
            *t, token = timed_first_token(on, nxt)
            warm.append(tuple(t))
            equal += token == timed_first_token(off, nxt)[2]
        load = os.getloadavg()[0]
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(
        f"tiny Qwen3.5 shape: {args.layers} layers (3 of 4 Gated DeltaNet), hidden {args.hidden},"
        f" fp32, one thread, chunk {args.chunk}; {args.rounds} rounds, load {load:.1f}"
    )
    print("| figure | CPU s | wall s | ratio (CPU) | goal |")
    print("|---|---|---|---|---|")
    c, w = med(cold, 0), med(warm, 0)
    print(f"| cold turn, {args.conversation} tokens | {c:.3f} | {med(cold, 1):.3f} | | |")
    print(
        f"| warm turn (+{args.reply} reply, +{args.turn} question) | {w:.3f} | {med(warm, 1):.3f}"
        f" | {w / c:.3f}x | <= 0.3x |"
    )
    a, b = med(on_prefill, 0), med(off_prefill, 0)
    print(f"| cold prefill, cache off (no snapshots) | {b:.3f} | {med(off_prefill, 1):.3f} | | |")
    print(
        f"| cold prefill, cache on (snapshots) | {a:.3f} | {med(on_prefill, 1):.3f}"
        f" | {a / b - 1:+.1%} | <= +5 % |"
    )
    print(f"warm turns' first token equal to the cache-off engine's: {equal}/{args.rounds}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--conversation", type=int, default=2048)
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--turn", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
