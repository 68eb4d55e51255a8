"""Per-request cost of the prefix cache on a multi-turn chat, with a per-call breakdown.

Run from the repository root:
    python benchmarks/request_cost.py                    # numpy int32 prompts
    python benchmarks/request_cost.py --tokens list      # Python lists (what the scheduler holds)
    python benchmarks/request_cost.py --tokens packed    # PackedTokens kept per conversation
    python benchmarks/request_cost.py --against f291e1f  # this tree vs a git revision, one run
    python benchmarks/request_cost.py --capacity 0.25 --host-ratio 4 --against f291e1f
                                                         # under pressure over a host tier

`--against REV` exports REV with `git archive` into a temporary folder and runs its own copy of
this script there and this tree's, alternately, `--rounds` times each, then prints both medians and
their ratio (each run keeps its fastest of `--repeat` passes; the ratio uses the fastest run of each
side, so both face the same machine load). With a host tier (`--host-ratio`) both sides run this
script over their own package instead (the cache's constructor has taken `host_blocks=` since the
tiers came in), and must agree on every hit.

N conversations x T turns after one system prompt: prompt_t = written_{t-1} + last reply token +
user_t, so prompts grow to ~1-2k tokens and every turn hits the previous one's cache. Requests go
turn by turn over all conversations (turn t of each, then t + 1), so a conversation's path is cold
when its next turn comes. Each request runs the whole lifecycle of the cache's contract, every
call timed:

    admit(prompt, max_hit=len-1)    match, lock, copy-on-write block, the prompt's uncached blocks
    grow(table, n)                  the reply's blocks
    commit(table, written)          insert, adopt, dedupe
    close(table)                    unlock, free what is still private

(Revisions before this contract ran match -> acquire -> allocate -> insert(handle=) -> release ->
free: `--against` runs each revision's own copy of this script, so totals compare.)

`written` = prompt + reply[:-1] (the last sampled token has no KV). With `--tokens packed` the
client appends to a PackedTokens per conversation, and building the prompt and `written` is
timed with `admit`. Inputs are built before the timed runs, and the cache is large enough that
nothing is evicted, unless `--capacity` sizes the device pool to a fraction of the working set
(the distinct blocks of the conversations' final texts); then `--host-ratio` adds a host tier of
that many times the device pool, whose moves are planned and dropped (the time is what planning
them costs: lookups past the tree, demotions). `--system-tokens` lengthens the shared system
prompt (long prompts).
The runs are identical, so each request keeps its fastest of `--repeat` runs (other tenants of a
shared machine only add time); the table gives medians over the requests with 1k-2k-token
prompts (all requests when none is in that band).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from radixkv import PackedTokens, PrefixCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, run with -P or not
from revision import exported

CALLS = ("admit", "grow", "commit", "close")
VOCAB_SIZE = 32000
SYSTEM_TOKENS = 301  # the shared system prompt's length by default


def make_chat(
    num_conversations: int, num_turns: int, seed: int = 0, system_tokens: int = SYSTEM_TOKENS
) -> list[tuple[int, list[int], list[int]]]:
    """Requests in run order: (conversation, new prompt tokens, reply tokens). The new prompt
    tokens of turn 0 include the shared system prompt; of turn t > 0, the previous reply's last
    token and the user's message."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB_SIZE, system_tokens).tolist()
    turns: list[list[tuple[list[int], list[int]]]] = []
    for _ in range(num_conversations):
        conversation = []
        carry = system
        for _ in range(num_turns):
            user = rng.integers(0, VOCAB_SIZE, int(rng.integers(20, 150))).tolist()
            reply = rng.integers(0, VOCAB_SIZE, int(rng.integers(40, 200))).tolist()
            conversation.append((carry + user, reply))
            carry = reply[-1:]
        turns.append(conversation)
    return [(c, *turns[c][t]) for t in range(num_turns) for c in range(num_conversations)]


def prepare(
    chat: Sequence[tuple[int, list[int], list[int]]], tokens: str
) -> list[tuple[int, Sequence[int], Sequence[int], list[int], list[int]]]:
    """Per request (conversation, prompt, written, new prompt tokens, reply), built before the
    timed runs like the trace benchmark's arrays; with "packed" the client builds prompt and
    written itself during the request, from the new tokens and the reply."""
    history: dict[int, list[int]] = {}  # conversation -> written + last reply token
    out = []
    for conv, new, reply in chat:
        prompt = history.get(conv, []) + new
        written = prompt + reply[:-1]
        history[conv] = written + reply[-1:]
        if tokens == "numpy":
            out.append((conv, np.array(prompt, np.int32), np.array(written, np.int32), new, reply))
        else:
            out.append((conv, prompt, written, new, reply))
    return out


def pool_size(
    requests: Sequence[tuple[int, Sequence[int], Sequence[int], list[int], list[int]]],
    block_size: int,
    capacity: float | None,
) -> int:
    """Device blocks: enough never to evict (None), else `capacity` x the working set, and never
    less than one request's blocks + 1."""
    need = [-(-len(written) // block_size) + 1 for _, _, written, _, _ in requests]
    if capacity is None:
        return sum(need)
    return max(max(need) + 1, int(capacity * working_set(requests, block_size)))


def working_set(
    requests: Sequence[tuple[int, Sequence[int], Sequence[int], list[int], list[int]]],
    block_size: int,
) -> int:
    """Distinct blocks of the conversations' final texts (the shared system prompt's once)."""
    final = {conv: written for conv, _, written, _, _ in requests}  # the last turn wins
    seen = set()
    for written in final.values():
        tokens = list(written)
        prefix = 0  # stands for the tokens before the block
        for start in range(0, len(tokens), block_size):
            prefix = hash((prefix, tuple(tokens[start : start + block_size])))
            seen.add(prefix)
    return len(seen)


def run(
    requests: Sequence[tuple[int, Sequence[int], Sequence[int], list[int], list[int]]],
    tokens: str,
    block_size: int,
    eviction: str = "gdsf",
    capacity: float | None = None,
    host_ratio: int = 0,
) -> tuple[np.ndarray, int]:
    """One pass over the requests on a fresh cache: ns per call, [num_requests, len(CALLS)], and
    the tokens hit (in every tier)."""
    num_blocks = pool_size(requests, block_size, capacity)
    cache = PrefixCache(
        num_blocks=num_blocks,
        block_size=block_size,
        eviction=eviction,
        host_blocks=host_ratio * num_blocks,
    )
    clock = time.perf_counter_ns
    ns = np.zeros((len(requests), len(CALLS)), dtype=np.int64)
    packed_history: dict[int, PackedTokens] = {}
    for i, (conv, prompt, written, new, reply) in enumerate(requests):
        t0 = clock()
        if tokens == "packed":  # the client's own appends, timed as part of the request
            prompt = packed_history.get(conv, PackedTokens()) + new
            written = prompt + reply[:-1]
            packed_history[conv] = written + reply[-1:]
        table = cache.admit(prompt, max_hit=len(prompt) - 1)
        t1 = clock()
        assert table is not None, "the pool holds any one request"
        cache.grow(table, -(-len(written) // block_size) - len(table.blocks))
        t2 = clock()
        cache.commit(table, written)
        t3 = clock()
        cache.close(table)
        t4 = clock()
        ns[i] = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
        cache.take_moves()  # planned, not run: no KV here
    cache.check_integrity()
    return ns, cache.stats().num_hit_tokens


def pressure_args(args: argparse.Namespace) -> list[str]:
    """The options of a run under pressure (a small pool, a host tier, long prompts); [] when
    none is set."""
    out = []
    if args.capacity is not None:
        out += ["--capacity", str(args.capacity)]
    if args.host_ratio:
        out += ["--host-ratio", str(args.host_ratio)]
    if args.system_tokens != SYSTEM_TOKENS:
        out += ["--system-tokens", str(args.system_tokens)]
    return out


def compare(rev: str, args: argparse.Namespace) -> int:
    """Run this script here and in an export of `rev`, alternately; print the two medians."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    theirs = [
        *("--tokens", args.tokens, "--conversations", str(args.conversations)),
        *("--turns", str(args.turns), "--block-size", str(args.block_size)),
        *("--repeat", str(args.repeat)),
    ]
    ours = [*theirs, "--eviction", args.eviction]  # the revision runs its own order
    pressure = pressure_args(args)
    if pressure:  # both sides run this script: the revision's may predate these options
        theirs = ours = [*ours, *pressure]
    medians: dict[str, list[float]] = {"before": [], "after": []}
    per_call: dict[str, dict[float, str]] = {"before": {}, "after": {}}  # median -> its calls
    hits: dict[str, set[str]] = {"before": set(), "after": set()}
    with exported(rev) as export:
        tmp = str(export)
        sides = {"before": tmp, "after": root}
        for _ in range(args.rounds):
            for side, src in sides.items():
                env = {**os.environ, "PYTHONPATH": src}
                script = os.path.join(root if pressure else src, "benchmarks", "request_cost.py")
                out = subprocess.run(
                    [sys.executable, script, *(ours if side == "after" else theirs)],
                    cwd=src,
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                found = re.search(r"median µs per request, [^:]*: ([0-9.]+)", out)
                assert found, out
                medians[side].append(float(found.group(1)))
                calls = re.search(r"per call: (.*)", out)
                per_call[side][medians[side][-1]] = calls.group(1) if calls else ""
                hit = re.search(r"hit tokens: (.*)", out)
                hits[side].add(hit.group(1) if hit else "")
    before, after = min(medians["before"]), min(medians["after"])
    print(f"{rev} (before): median µs per request {before:.1f}  (runs {medians['before']})")
    print(f"  per call, fastest run: {per_call['before'][before]}")
    print(f"this tree (after): median µs per request {after:.1f}  (runs {medians['after']})")
    print(f"  per call, fastest run: {per_call['after'][after]}")
    print(f"after / before: {after / before:.3f}")
    if pressure:
        assert len(hits["before"]) == 1 and hits["before"] == hits["after"], hits
        print(f"hit tokens, both sides: {hits['after'].pop()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", choices=("numpy", "list", "packed"), default="numpy")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7, help="each request's fastest run counts")
    parser.add_argument(
        "--eviction",
        choices=("gdsf", "lru"),
        default="gdsf",
        help="this tree's eviction order; with --against, the revision keeps its own (LRU before"
        " GDSF came in: lru compares like with like)",
    )
    parser.add_argument(
        "--capacity", type=float, help="device pool as a fraction of the working set (evicts)"
    )
    parser.add_argument(
        "--host-ratio", type=int, default=0, help="a host tier of this many times the device pool"
    )
    parser.add_argument(
        "--system-tokens", type=int, default=SYSTEM_TOKENS, help="system prompt length"
    )
    parser.add_argument("--against", metavar="REV", help="compare with a git revision")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side with --against")
    args = parser.parse_args(argv)
    if args.against:
        return compare(args.against, args)

    chat = make_chat(args.conversations, args.turns, system_tokens=args.system_tokens)
    requests = prepare(chat, args.tokens)
    prompt_lens = np.array([len(prompt) for _, prompt, _, _, _ in requests])
    best: np.ndarray | None = None
    hits = set()
    for _ in range(args.repeat):
        gc.collect()
        ns, num_hit = run(
            requests,
            args.tokens,
            args.block_size,
            args.eviction,
            args.capacity,
            args.host_ratio,
        )
        hits.add(num_hit)
        # Per request, its fastest whole run (so its calls' times add up to its total).
        faster = ns.sum(1) < best.sum(1) if best is not None else True
        best = np.where(np.reshape(faster, (-1, 1)), ns, best if best is not None else ns)
    assert best is not None
    total = best.sum(1)
    sel = (prompt_lens >= 1000) & (prompt_lens <= 2000)
    num_in_band, band = int(sel.sum()), "1k-2k-token prompts"
    if not num_in_band:
        sel, band = np.ones_like(sel), "all prompts"
    print(
        f"{len(requests)} requests ({args.tokens} tokens, block size {args.block_size}),"
        f" prompts {prompt_lens.min()}..{prompt_lens.max()} tokens, {num_in_band} of 1k-2k;"
        f" fastest of {args.repeat} runs"
    )
    assert len(hits) == 1, f"identical runs hit differently: {hits}"
    print(f"hit tokens: {hits.pop()} of {int(prompt_lens.sum())}")
    print(f"median µs per request, {band}: {np.median(total[sel]) / 1e3:.1f}")
    print(
        "  per call: "
        + ", ".join(f"{c} {np.median(best[sel, k]) / 1e3:.1f}" for k, c in enumerate(CALLS))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
