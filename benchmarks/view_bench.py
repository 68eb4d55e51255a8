"""Time to build one snapshot of the live page (`radixkv serve`'s `/`) over a large tree: the
engine thread's part (`PrefixCache.summary`: every node visited, `MAX_NODES` listed, the rest
folded into counts) and the view thread's (text previews, JSON). The goal: <= 20 ms for a
10,000-node tree. Run it on an otherwise idle machine; a loaded one times its neighbours.

    .venv/bin/python -m benchmarks.view_bench                      # 10,000 nodes
    .venv/bin/python -m benchmarks.view_bench --nodes 50000 --tokenizer DIR

The tree: stems of 40 tokens, each with branches of 20 random tokens (two nodes per request:
the stem, split once, and the branch), as many conversations sharing system prompts would
make. Previews are decoded by the tokenizer of `--tokenizer` (a model folder), else spelled as
token ids.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixkv import PrefixCache
from radixkv.serve.cache_view import MAX_NODES, NodeAliases, tree_payload

BRANCHES_PER_STEM = 99
STEM_TOKENS = 40
BRANCH_TOKENS = 20


@dataclass(frozen=True)
class Timing:
    num_nodes: int
    summary_ms: list[float]  # engine thread
    payload_ms: list[float]  # view thread: previews + JSON

    def row(self, name: str, values: list[float]) -> str:
        return f"{name:<22} median {statistics.median(values):7.2f} ms   max {max(values):7.2f} ms"


def build_tree(num_nodes: int, seed: int = 0) -> tuple[PrefixCache, list[int]]:
    """A cache whose shared tree has about `num_nodes` nodes; returns it and its last prompt."""
    rng = random.Random(seed)
    num_requests = max(1, num_nodes - num_nodes // (BRANCHES_PER_STEM + 1))
    tokens = num_requests * (STEM_TOKENS + BRANCH_TOKENS)
    cache = PrefixCache(num_blocks=tokens // 16 + 64, block_size=16)
    prompt: list[int] = []
    for i in range(num_requests):
        stem = [(i // BRANCHES_PER_STEM) * 1000 + t for t in range(STEM_TOKENS)]
        prompt = stem + [rng.randrange(50_000) for _ in range(BRANCH_TOKENS)]
        table = cache.admit(prompt, max_hit=len(prompt) - 1)
        assert table is not None, "the pool is sized to hold every request"
        cache.commit(table, prompt)
        cache.close(table)
    return cache, prompt


def snapshot(
    cache: PrefixCache, prompt: Sequence[int], decode: Callable[[Sequence[int]], str] | None
) -> tuple[float, float, str]:
    """(engine ms, view ms, JSON text) of one snapshot."""
    t0 = time.perf_counter()
    tree = cache.summary(max_nodes=MAX_NODES, prompt=prompt)
    t1 = time.perf_counter()
    text = json.dumps({"tree": tree_payload(tree, decode, NodeAliases())}, ensure_ascii=True)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, text


def run(
    num_nodes: int, repeats: int, decode: Callable[[Sequence[int]], str] | None = None
) -> Timing:
    cache, prompt = build_tree(num_nodes)
    snapshot(cache, prompt, decode)  # warm-up: never time the first call
    engine, view = [], []
    for _ in range(repeats):
        e, v, _ = snapshot(cache, prompt, decode)
        engine.append(e)
        view.append(v)
    return Timing(cache.stats().num_nodes, engine, view)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tokenizer", default=None, help="a model folder with a tokenizer")
    args = parser.parse_args(argv)
    decode = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        decode = AutoTokenizer.from_pretrained(args.tokenizer).decode
    timing = run(args.nodes, args.repeats, decode)
    total = [e + v for e, v in zip(timing.summary_ms, timing.payload_ms, strict=True)]
    print(f"tree of {timing.num_nodes} nodes, {MAX_NODES} listed, {args.repeats} snapshots")
    print(timing.row("engine thread (summary)", timing.summary_ms))
    print(timing.row("view thread (payload)", timing.payload_ms))
    print(timing.row("snapshot", total))
    print(f"goal: <= 20 ms a snapshot; median {statistics.median(total):.2f} ms")


if __name__ == "__main__":
    main()
