"""Where to keep recurrent-state snapshots (issue 40 item 3), measured before it is built: a
model-free cache simulation with Qwen3.5-4B's sizes.

Run from the repository root:
    .venv/bin/python benchmarks/snapshot_bench.py            # full run (a few minutes)
    .venv/bin/python benchmarks/snapshot_bench.py --quick    # smoke run (seconds)

Qwen3.5-4B: 32 layers, every 4th full attention (8 layers, 4 KV heads of 256) and 24 Gated
DeltaNet layers (32 value heads, 16 key heads, 128 x 128 per head, a 4-wide conv over q|k|v).
In bf16 one token's KV is 8 x 2 x 4 x 256 x 2 B = 32 KiB and one snapshot (every linear layer's
delta-rule state and conv window) 24 x (32 x 128 x 128 + 3 x 8192) x 2 B = 25.1 MiB, the KV of
804 tokens.

Four caches of the same bytes (KV plus snapshots), the same KV tree and eviction
(`snapshot_sim.py`), one request at a time over the cache benchmark's chat and doc-QA traces and
a multi-turn agent trace (tool calls over a 300-500-token system prompt):

    (a) radixkv: `SnapshotPolicy` (finished ends, divergence points, chunk ends into free budget)
        and `SnapshotLedger` (orphans, then superseded snapshots, then GDSF), snapshots in
        `--share` of the bytes (0.28 by default: 0.59x SGLang's default);
    (b) vLLM's placement: states on the 528-token block grid only, one at every grid line a
        request passes, the same budget as (a);
    (c) SGLang's placement: one state per inserted node (each prefill's end, each finished
        request; its chunks are 8,192 tokens), LRU, with SGLang's default
        mamba_full_memory_ratio 0.9 (states 0.9 x the KV pool: 47 % of the bytes), and again at
        (a)'s budget;
    (d) an all-full-attention model of the same KV per token: every byte KV, no states.

Printed: prefix tokens served from the cache (the hits) per trace and cache, as ratios to (d),
the same over prompts under 1,000 tokens, snapshot budgets and peaks, and the issue's goals
against them. Capacity is a fraction of the trace's working set (its distinct written tokens'
KV bytes).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.cache.snapshots import SnapshotPolicy

try:
    from benchmarks.cache_bench import (
        Trace,
        _interleave,
        _rand_tokens,
        chat_trace,
        doc_qa_trace,
        machine_line,
    )
    from benchmarks.snapshot_sim import (
        FullAttention,
        GridPlacement,
        PerNodePlacement,
        Placement,
        RadixkvPlacement,
        Request,
        SimResult,
        simulate,
        working_set_tokens,
    )
except ImportError:  # run as a script: benchmarks/ is on the path
    from cache_bench import (  # type: ignore[no-redef]
        Trace,
        _interleave,
        _rand_tokens,
        chat_trace,
        doc_qa_trace,
        machine_line,
    )
    from snapshot_sim import (  # type: ignore[no-redef]
        FullAttention,
        GridPlacement,
        PerNodePlacement,
        Placement,
        RadixkvPlacement,
        Request,
        SimResult,
        simulate,
        working_set_tokens,
    )

# Qwen3.5-4B in bf16 (see the module docstring)
KV_BYTES_PER_TOKEN = 8 * 2 * 4 * 256 * 2
SNAPSHOT_BYTES = 24 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2
VLLM_BLOCK = 528  # vLLM's attention block for Qwen3.5, matched to the state's page
SGLANG_CHUNK = 8192  # SGLang's chunked_prefill_size on an 80 GB GPU
SGLANG_STATE_RATIO = 0.9  # SGLang's mamba_full_memory_ratio: state pool / KV pool
RADIXKV_CHUNK = 512  # radixkv's chunked_prefill_size
SHORT_PROMPT = 1000

GOAL_VS_FULL = 0.9
GOAL_VS_GRID_SHORT = 2.0
GOAL_BYTES_VS_PER_NODE = 0.6


def agent_trace(
    seed: int,
    num_agents: int = 4,
    num_sessions: int = 48,
    num_turns: tuple[int, int] = (4, 12),
    system_len: tuple[int, int] = (300, 501),
) -> Trace:
    """Tool-calling agents: each session runs one of `num_agents` agents (its 300-500-token
    system prompt: instructions and tool schemas), a task, then turns of a short tool call by the
    model followed by the tool's result: prompt_t = prompt_{t-1} + call_{t-1} + result_{t-1}."""
    rng = np.random.default_rng([seed, 7])
    systems = [_rand_tokens(rng, int(rng.integers(*system_len))) for _ in range(num_agents)]

    def session(s_rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int, int | None]]:
        history = np.concatenate([systems[int(s_rng.integers(num_agents))]])
        task = _rand_tokens(s_rng, int(s_rng.integers(30, 120)))
        prompt = np.concatenate([history, task])
        for turn in range(int(s_rng.integers(*num_turns))):
            call = _rand_tokens(s_rng, int(s_rng.integers(20, 80)))
            tokens = np.concatenate([prompt, call])
            yield tokens, len(prompt), (turn - 1 if turn else None)
            result = _rand_tokens(s_rng, int(s_rng.integers(50, 400)))
            prompt = np.concatenate([tokens, result])

    streams = [session(np.random.default_rng([seed, 7, s])) for s in range(num_sessions)]
    return Trace("agent", _interleave(rng, streams))


def traces(seed: int, quick: bool) -> list[Trace]:
    if quick:
        return [
            chat_trace(seed, num_conversations=8, num_turns=4),
            doc_qa_trace(seed, num_documents=6, num_requests=40),
            agent_trace(seed, num_sessions=8),
        ]
    return [chat_trace(seed), doc_qa_trace(seed), agent_trace(seed)]


@dataclass(frozen=True, slots=True)
class Row:
    trace: str
    capacity: float  # of the working set
    total_bytes: int
    results: dict[str, SimResult]  # by label


def run_trace(trace: Trace, capacity: float, share: float, check_every: int = 0) -> Row:
    requests = [Request(r.tokens, r.num_prompt_tokens) for r in trace.requests]
    total = int(capacity * working_set_tokens(requests) * KV_BYTES_PER_TOKEN)
    ours = int(share * total)
    sglang = int(total * SGLANG_STATE_RATIO / (1 + SGLANG_STATE_RATIO))
    # the snapshots' eviction order: radixkv's (superseded first, then GDSF) or plain LRU
    runs: list[tuple[str, Placement, int, str]] = [
        ("a", RadixkvPlacement(SnapshotPolicy(), RADIXKV_CHUNK), ours, "radixkv"),
        ("b", GridPlacement(VLLM_BLOCK), ours, "lru"),
        ("c", PerNodePlacement(SGLANG_CHUNK), sglang, "lru"),
        ("c@a", PerNodePlacement(SGLANG_CHUNK), ours, "lru"),
        ("d", FullAttention(), 0, "lru"),
    ]
    results = {
        label: simulate(
            requests,
            placement,
            total_bytes=total,
            snapshot_budget=budget,
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            snapshot_bytes=SNAPSHOT_BYTES,
            short_prompt=SHORT_PROMPT,
            supersede=order == "radixkv",
            eviction="gdsf" if order == "radixkv" else "lru",
            check_every=check_every,
        )
        for label, placement, budget, order in runs
    }
    return Row(trace.name, capacity, total, results)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def format_rows(rows: Sequence[Row]) -> str:
    lines = [
        "| trace | capacity | cache | tokens served | / (d) | under 1k tok: served | / (d) "
        "| snapshot budget MiB | peak MiB | taken | evicted | resumed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        full = row.results["d"]
        for label, r in row.results.items():
            name = r.policy + (" at (a)'s budget" if label == "c@a" else "")
            lines.append(
                f"| {row.trace} | {row.capacity:.2f} | {name} | {r.served:,} "
                f"| {r.served / max(full.served, 1):.3f} | {r.served_short:,} "
                f"| {r.served_short / max(full.served_short, 1):.3f} "
                f"| {_mib(r.snapshot_budget)} | {_mib(r.peak_snapshot_bytes)} | {r.num_taken} "
                f"| {r.num_evicted} | {r.num_hits} |"
            )
    return "\n".join(lines)


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else ("inf (c serves none)" if a else "n/a")


def goal_lines(rows: Sequence[Row]) -> tuple[str, bool]:
    """The issue's three goals per trace and capacity; returns the text and whether all hold."""
    out, ok = [], True
    for row in rows:
        a, b, c, d = (row.results[k] for k in ("a", "b", "c", "d"))
        vs_full = a.served / max(d.served, 1)
        vs_grid = a.served_short / b.served_short if b.served_short else math.inf
        bytes_ratio = a.snapshot_budget / max(c.snapshot_budget, 1)
        checks = [
            (vs_full >= GOAL_VS_FULL, f"(a)/(d) {vs_full:.3f} (goal >= {GOAL_VS_FULL})"),
            (
                vs_grid >= GOAL_VS_GRID_SHORT or not a.prompt_tokens_short,
                f"(a)/(b) under {SHORT_PROMPT} tok "
                + (f"{vs_grid:.2f}" if a.prompt_tokens_short else "n/a (no such prompts)")
                + f" (goal >= {GOAL_VS_GRID_SHORT})",
            ),
            (
                a.served >= c.served and bytes_ratio <= GOAL_BYTES_VS_PER_NODE,
                f"(a)/(c) {_ratio(a.served, c.served)} at {bytes_ratio:.2f}x its snapshot "
                f"bytes (goal >= 1 at <= {GOAL_BYTES_VS_PER_NODE})",
            ),
        ]
        ok &= all(met for met, _ in checks)
        marks = "; ".join(("met: " if met else "MISSED: ") + text for met, text in checks)
        out.append(f"- {row.trace} at {row.capacity:.2f} of its working set: {marks}")
    return "\n".join(out), ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small traces")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--capacity",
        type=float,
        nargs="+",
        default=[0.5, 1.0, 2.0, 4.0],
        help="cache bytes as fractions of the trace's working set (its KV bytes)",
    )
    parser.add_argument(
        "--share", type=float, default=0.28, help="(a)'s and (b)'s snapshot share of the bytes"
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}")
    print(
        f"Qwen3.5-4B bf16: KV {KV_BYTES_PER_TOKEN // 1024} KiB/token, snapshot "
        f"{SNAPSHOT_BYTES / 2**20:.1f} MiB (= {SNAPSHOT_BYTES / KV_BYTES_PER_TOKEN:.0f} tokens "
        f"of KV); (a) and (b) keep snapshots in {args.share:.0%} of the bytes, (c) in "
        f"{SGLANG_STATE_RATIO / (1 + SGLANG_STATE_RATIO):.0%}\n"
    )
    rows = []
    for trace in traces(args.seed, args.quick):
        tokens = working_set_tokens(
            [Request(r.tokens, r.num_prompt_tokens) for r in trace.requests]
        )
        print(
            f"{trace.name}: {len(trace.requests)} requests, working set {tokens:,} tokens "
            f"({tokens * KV_BYTES_PER_TOKEN / 2**30:.2f} GiB of KV)"
        )
        rows += [run_trace(trace, capacity, args.share) for capacity in args.capacity]
    print()
    print(format_rows(rows))
    text, ok = goal_lines(rows)
    print("\nGoals (issue 40):\n" + text)
    print("\nall goals met" if ok else "\nsome goals missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
