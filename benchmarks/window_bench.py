"""Memory that follows the window (issue 30 item 2): what the window group saves, in KV bytes.

Run from the repository root:
    .venv/bin/python benchmarks/window_bench.py            # full run (about a minute)
    .venv/bin/python benchmarks/window_bench.py --quick    # smoke run (seconds)

A Gemma-3-like layout: 5 window layers (W = 512) to 1 full layer, against the same model with
every layer full. Only block counts are driven (the cache alone, no model); bytes are layers x
blocks x the bytes of one layer's block, so the ratios do not depend on head counts or dtype.

1. Per running request: one 8k-token prompt, chunked prefill, then decoding, through
   `GroupedCache` of a tree and a window group (window blocks released as they leave the
   window) and `PrefixCache` (all full).
   Printed: the KV bytes the request's tables hold at the end of decoding and at their peak,
   each as a ratio of the all-full layout's at the same step (the full table is allocated for
   the whole prompt at admission, as `PrefixCache.admit` does, in both layouts).
   Floor: (8192 + 5 x 512) / (6 x 8192) = 0.22.
2. Cache capacity at equal KV bytes: the chat and doc-QA traces of `cache_bench.py`, one request
   at a time (prompt chunks of 512, the reply's tokens, a commit of everything written). The
   all-full cache gets a quarter of the trace's working set; the hybrid cache the same bytes,
   split between its full and window pools by `--window-share`. Printed: the prefix tokens the
   cache can serve as hits at the end of the trace (all full: every cached token; hybrid: the
   cached paths up to a point with its window KV) and the hit tokens the trace got, as ratios.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from radixkv.cache.group import GroupSpec
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.kinds import build_cache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.tokens import PackedTokens
from radixkv.cache.window import WindowSpec

try:
    from benchmarks.cache_bench import Trace, chat_trace, doc_qa_trace, machine_line
except ImportError:  # run as a script: benchmarks/ is on the path
    from cache_bench import Trace, chat_trace, doc_qa_trace, machine_line  # type: ignore[no-redef]

WINDOW = 512
NUM_WINDOW_LAYERS = 5
NUM_FULL_LAYERS = 1
NUM_LAYERS = NUM_WINDOW_LAYERS + NUM_FULL_LAYERS


# ----------------------------------------------------------------------------------------------
# 1. One running request


@dataclass(frozen=True, slots=True)
class RequestResult:
    block_size: int
    chunk: int
    end_ratio: float  # held layer-blocks at the end of decoding / all-full's
    peak_ratio: float  # the largest held over the all-full's at the same step


def _held(cache: GroupedCache, table) -> int:
    """Layer-blocks the request's tables hold (a pinned copy source counts: it is held)."""
    full, window = table.tables
    held = window.num_live_blocks + (window.pinned is not None)
    return NUM_FULL_LAYERS * len(full.blocks) + NUM_WINDOW_LAYERS * held


def _held_all_full(table) -> int:
    """What the same table holds with every layer full: its full blocks in every layer."""
    return NUM_LAYERS * len(table.tables[0].blocks)


def _window_cache(num_blocks: int, num_window_blocks: int, block_size: int) -> GroupedCache:
    return build_cache(
        [GroupSpec(), WindowSpec(WINDOW)], [num_blocks, num_window_blocks], block_size
    )


def run_request(
    block_size: int, chunk: int, num_prompt: int = 8192, num_decode: int = 256
) -> RequestResult:
    B = block_size
    n = num_prompt + num_decode
    blocks = -(-n // B) + 2
    cache = _window_cache(blocks, blocks, B)
    tokens = PackedTokens(range(n))
    table = cache.admit(tokens, max_hit=num_prompt - 1, first_chunk=0)
    assert table is not None
    steps = [(p, min(p + chunk, num_prompt)) for p in range(0, num_prompt, chunk)]
    steps += [(p, p + 1) for p in range(num_prompt, n)]
    peak = 0.0
    for pos, end in steps:
        cache.slide(table, pos)  # what the step's first query no longer reads goes first
        assert cache.extend(table, end)
        peak = max(peak, _held(cache, table) / _held_all_full(table))
    cache.check_integrity()
    end_ratio = _held(cache, table) / _held_all_full(table)
    cache.close(table)
    return RequestResult(B, chunk, end_ratio, peak)


# ----------------------------------------------------------------------------------------------
# 2. Capacity at equal bytes


@dataclass(frozen=True, slots=True)
class CapacityResult:
    trace: str
    window_share: float  # of the bytes, given to the window pool
    budget: int  # layer-blocks (one layer's KV of B tokens), the same for both layouts
    servable_all_full: int
    servable_hybrid: int
    hits_all_full: int
    hits_hybrid: int


def _serve_all_full(cache: PrefixCache, trace: Trace) -> int:
    hits = 0
    for req in trace.requests:
        written = PackedTokens(req.written)
        table = cache.admit(written, max_hit=req.num_prompt_tokens - 1)
        assert table is not None, "a request larger than the cache"
        hits += table.num_cached_tokens
        cache.commit(table, written)
        cache.close(table)
    cache.check_integrity()
    return hits


def _serve_hybrid(cache: GroupedCache, trace: Trace, chunk: int) -> int:
    hits = 0
    for req in trace.requests:
        written = PackedTokens(req.written)
        table = cache.admit(written, max_hit=req.num_prompt_tokens - 1, first_chunk=0)
        assert table is not None, "a request larger than the cache"
        hit = table.num_cached_tokens
        hits += hit
        pos = hit
        while pos < req.num_prompt_tokens:  # prefill chunks
            end = min(pos + chunk, req.num_prompt_tokens)
            cache.slide(table, pos)
            assert cache.extend(table, end)
            pos = end
        cache.slide(table, pos)
        assert cache.extend(table, len(written))  # the reply's tokens, one block at a time
        cache.slide(table, len(written))
        cache.commit(table, written)
        cache.close(table)
    cache.check_integrity()
    return hits


def _servable(cache: GroupedCache) -> int:
    """Tokens of the cached paths that lie up to a point with its window KV: the union of the
    tails' prefixes that the full tree still holds."""
    prefixes = [
        (namespace, PackedTokens.frombytes(prefix))
        for namespace, prefix in cache.groups[1].tail_prefixes()
    ]
    full = cache.tree
    held = [p for ns, p in prefixes if full.match(p, namespace=ns).num_cached_tokens == len(p)]
    union = PrefixCache(sum(len(p) for p in held) + 1, 1)
    for p in held:
        table = union.admit(p, max_hit=len(p))
        assert table is not None
        union.commit(table, p)
        union.close(table)
    return union.stats().num_cached_tokens


def run_capacity(trace: Trace, block_size: int, window_share: float, chunk: int) -> CapacityResult:
    B = block_size
    # at least room for a request beside a cached path it matches only partly (a lock pins the
    # whole node it ends in)
    floor = 2 * (trace.max_request_blocks(B) + 1)
    num_full = max(math.ceil(0.25 * trace.working_set_blocks(B)), floor)
    budget = NUM_LAYERS * num_full  # layer-blocks
    need = -(-(WINDOW + chunk) // B) + 2  # one request's live window and its copy
    num_window = max(int(window_share * budget / NUM_WINDOW_LAYERS), need)
    all_full = PrefixCache(num_full, B)
    hits_full = _serve_all_full(all_full, trace)
    hybrid = _window_cache(budget - NUM_WINDOW_LAYERS * num_window, num_window, B)
    hits_hybrid = _serve_hybrid(hybrid, trace, chunk)
    return CapacityResult(
        trace.name,
        NUM_WINDOW_LAYERS * num_window / budget,
        budget,
        all_full.stats().num_cached_tokens,
        _servable(hybrid),
        hits_full,
        hits_hybrid,
    )


# ----------------------------------------------------------------------------------------------


def _long_doc_qa(seed: int) -> Trace:
    """doc-QA over documents of 6k to 10k tokens (the per-request figure's prompt length)."""
    trace = doc_qa_trace(seed, num_documents=12, num_requests=160, doc_len=(6000, 10000))
    return Trace("doc-qa-8k", trace.requests)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small traces, one block size")
    parser.add_argument(
        "--window-share", type=float, nargs="+", default=[0.2, 0.3, 0.45, 0.6, 0.75]
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}")
    print(
        f"layout: {NUM_WINDOW_LAYERS} window layers (W = {WINDOW}) to {NUM_FULL_LAYERS} full, "
        f"against {NUM_LAYERS} full layers\n"
    )
    print("## One running request: 8192-token prompt, chunked prefill, 256 decoded tokens\n")
    print("| block size | prefill chunk | KV held at the end / all full | peak / all full |")
    print("|---:|---:|---:|---:|")
    for B in (16,) if args.quick else (1, 16, 64):
        for chunk in (512, 2048):
            r = run_request(B, chunk)
            print(f"| {B} | {chunk} | {r.end_ratio:.3f} | {r.peak_ratio:.3f} |")
    print("\n## Capacity at equal KV bytes (block size 16, prefill chunk 512)\n")
    print(
        "| trace | window pool share | servable prefix tokens: all full | hybrid | ratio "
        "| hit tokens: all full | hybrid | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    seed = 0
    traces = (
        [chat_trace(seed, num_conversations=8, num_turns=4), doc_qa_trace(seed, 6, 40)]
        if args.quick
        else [chat_trace(seed), doc_qa_trace(seed), _long_doc_qa(seed)]
    )
    for trace in traces:
        for share in args.window_share:
            c = run_capacity(trace, 16, share, 512)
            print(
                f"| {c.trace} | {c.window_share:.2f} | {c.servable_all_full} | {c.servable_hybrid} "
                f"| {c.servable_hybrid / c.servable_all_full:.2f} | {c.hits_all_full} "
                f"| {c.hits_hybrid} | {c.hits_hybrid / max(c.hits_all_full, 1):.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
