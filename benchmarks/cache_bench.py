"""Trace-driven benchmark of the prefix cache alone: radixkv vs a flat chained-hash block map.

Run from the repository root:
    .venv/bin/python benchmarks/cache_bench.py            # full run (~5 minutes, ~1 GB)
    .venv/bin/python benchmarks/cache_bench.py --quick    # smoke run (seconds)
(`python -m benchmarks.cache_bench` works too.)

Seeded synthetic traces are driven through the request lifecycle of a serving engine, the same for
both caches (each behind a small adapter):

```
match(prompt, max_tokens=len-1) ─► acquire ─► allocate(uncached + reply blocks)  ─► "compute"
   │ radixkv: token-granular hit; a partial last block is copied into the first private block (CoW)
   │ flat:    block-aligned hit, full blocks only
   ▼
insert(prompt + reply[:-1]) ─► release ─► free what the caller still owns
```
(radixkv's own contract runs the same steps: `admit(prompt + reply[:-1], max_hit=len(prompt)-1)`
matches, locks and allocates, in one eviction pass as the others do, `commit` inserts, `close`
releases and frees.)
A window of `--window` requests is in flight (admitted, then finished in trace order), so locked
paths and eviction pressure are real. A request that depends on an earlier one (the next chat turn
contains the previous reply; a branch continues its parent's text) is admitted only once that one
has finished. When an allocation cannot fit even after eviction, in-flight requests are finished
(oldest first) and the admission retried: a stall.

Capacity is a fraction of the trace's working set: the blocks needed to hold every distinct written
token prefix at block granularity (and at least enough for the in-flight window).

Timing covers only the cache calls (`time.perf_counter_ns` around each request's calls, admission
retries included). The whole grid is run `--repeat` times in rounds; the runs are identical
(seeded), so each request's fastest time is kept, which filters out the time slices other tenants
take on a shared machine. A second table times single operations against a full cache of 10^3 ..
10^6 blocks to show how the per-operation cost scales (fastest of `--repeat` timing rounds).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import numpy as np
import xxhash

from radixkv.cache.prefix_cache import BlockTable, PrefixCache

try:
    from benchmarks.flat_hash_cache import FlatHashCache, FlatMatch, token_bytes
    from benchmarks.token_radix_cache import PageRadixCache
except (
    ImportError
):  # run as a script (`python benchmarks/cache_bench.py`): benchmarks/ is on the path
    from flat_hash_cache import FlatHashCache, FlatMatch, token_bytes  # type: ignore[no-redef]
    from token_radix_cache import PageRadixCache  # type: ignore[no-redef]

VOCAB_SIZE = 32000
TOKEN_DTYPE = np.int32


# ----------------------------------------------------------------------------------------------
# Traces


@dataclass(frozen=True, slots=True)
class Request:
    tokens: np.ndarray  # [num_prompt_tokens + num_output_tokens] int32: prompt then generated reply
    num_prompt_tokens: int
    after: int | None  # index of a request that must have finished before this one is admitted

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.num_prompt_tokens]

    @property
    def written(self) -> np.ndarray:
        # NOTE: the last sampled token has no KV yet: a finished request inserts
        # prompt + reply[:-1].
        return self.tokens[:-1]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[Request, ...]

    def working_set_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every distinct written prefix: distinct (prefix, block index) keys,
        a partial tail block counting as its own key."""
        keys: set[int] = set()
        nbytes = 4 * block_size
        for req in self.requests:
            buf = token_bytes(req.written)
            h = 0
            for start in range(0, len(buf), nbytes):
                h = xxhash.xxh64_intdigest(buf[start : start + nbytes], h)
                keys.add(h)
        return len(keys)

    def max_request_blocks(self, block_size: int) -> int:
        return max(math.ceil(len(r.written) / block_size) for r in self.requests)


def _rand_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB_SIZE, n, dtype=TOKEN_DTYPE)


def _interleave(
    rng: np.random.Generator, streams: list[Iterator[tuple[np.ndarray, int, int | None]]]
) -> tuple[Request, ...]:
    """Interleave streams of (tokens, num_prompt_tokens, parent) at random into one trace. `parent`
    is the position of an earlier item in the same stream (or None); it becomes `Request.after`."""
    requests: list[Request] = []
    local_to_global: list[list[int]] = [[] for _ in streams]
    active = list(range(len(streams)))
    while active:
        k = int(rng.integers(len(active)))
        s = active[k]
        try:
            tokens, num_prompt, parent = next(streams[s])
        except StopIteration:
            active.pop(k)
            continue
        after = None if parent is None else local_to_global[s][parent]
        local_to_global[s].append(len(requests))
        requests.append(Request(tokens, num_prompt, after))
    return tuple(requests)


def chat_trace(
    seed: int, num_conversations: int = 64, num_turns: int = 8, system_len: int = 301
) -> Trace:
    """Multi-turn chat: prompt_t = prompt_{t-1} + reply_{t-1} + user_t after one system prompt."""
    rng = np.random.default_rng([seed, 1])
    system = _rand_tokens(rng, system_len)

    def conversation(conv_rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int, int | None]]:
        history = system
        for turn in range(num_turns):
            prompt = np.concatenate(
                [history, _rand_tokens(conv_rng, int(conv_rng.integers(20, 150)))]
            )
            reply = _rand_tokens(conv_rng, int(conv_rng.integers(40, 200)))
            tokens = np.concatenate([prompt, reply])
            yield tokens, len(prompt), (turn - 1 if turn else None)
            history = tokens

    streams = [conversation(np.random.default_rng([seed, 1, c])) for c in range(num_conversations)]
    return Trace("chat", _interleave(rng, streams))


def few_shot_trace(seed: int, num_requests: int = 384, prefix_len: int = 1013) -> Trace:
    """One long few-shot prefix (not a multiple of the block size) + distinct questions."""
    rng = np.random.default_rng([seed, 2])
    prefix = _rand_tokens(rng, prefix_len)
    requests = []
    for _ in range(num_requests):
        question = _rand_tokens(rng, int(rng.integers(30, 200)))
        reply = _rand_tokens(rng, int(rng.integers(16, 128)))
        requests.append(
            Request(np.concatenate([prefix, question, reply]), prefix_len + len(question), None)
        )
    return Trace("few-shot", tuple(requests))


def branching_trace(
    seed: int, num_problems: int = 16, num_branches: int = 24, max_prompt_len: int = 2048
) -> Trace:
    """Tree of thought: per problem a root prompt, then branches that each continue a random
    earlier node's text, cut at a random position (mostly mid-block), with a new thought."""
    rng = np.random.default_rng([seed, 3])

    def problem(p_rng: np.random.Generator) -> Iterator[tuple[np.ndarray, int, int | None]]:
        root_len = int(p_rng.integers(600, 1000))
        root = _rand_tokens(p_rng, root_len)
        texts = [np.concatenate([root, _rand_tokens(p_rng, int(p_rng.integers(64, 256)))])]
        yield texts[0], root_len, None
        for _ in range(num_branches - 1):
            parent = int(p_rng.integers(len(texts)))
            thought_len = int(p_rng.integers(32, 256))
            hi = min(len(texts[parent]), max_prompt_len - thought_len)
            cut = int(p_rng.integers(root_len // 2, hi + 1))
            prompt = np.concatenate([texts[parent][:cut], _rand_tokens(p_rng, thought_len)])
            tokens = np.concatenate([prompt, _rand_tokens(p_rng, int(p_rng.integers(64, 256)))])
            texts.append(tokens)
            yield tokens, len(prompt), parent

    streams = [problem(np.random.default_rng([seed, 3, p])) for p in range(num_problems)]
    return Trace("branching", _interleave(rng, streams))


def no_sharing_trace(seed: int, num_requests: int = 256) -> Trace:
    rng = np.random.default_rng([seed, 4])
    requests = []
    for _ in range(num_requests):
        num_prompt = int(rng.integers(800, 2000))
        tokens = _rand_tokens(rng, num_prompt + int(rng.integers(32, 256)))
        requests.append(Request(tokens, num_prompt, None))
    return Trace("no-sharing", tuple(requests))


def doc_qa_trace(
    seed: int,
    num_documents: int = 24,
    num_requests: int = 320,
    system_len: int = 57,
    doc_len: tuple[int, int] = (1200, 2600),
) -> Trace:
    """Questions about long documents: system prompt + one document + a question. Documents are
    picked with Zipf-like popularity (the k-th most popular ~ 1/k), so a few stay hot while the
    tail is asked about rarely: what to keep under pressure matters."""
    rng = np.random.default_rng([seed, 6])
    system = _rand_tokens(rng, system_len)
    documents = [_rand_tokens(rng, int(rng.integers(*doc_len))) for _ in range(num_documents)]
    popularity = 1.0 / np.arange(1, num_documents + 1)
    popularity /= popularity.sum()
    requests = []
    for _ in range(num_requests):
        doc = documents[int(rng.choice(num_documents, p=popularity))]
        question = _rand_tokens(rng, int(rng.integers(16, 96)))
        reply = _rand_tokens(rng, int(rng.integers(16, 160)))
        prompt = np.concatenate([system, doc, question])
        requests.append(Request(np.concatenate([prompt, reply]), len(prompt), None))
    return Trace("doc-qa", tuple(requests))


def make_traces(seed: int, quick: bool) -> list[Trace]:
    if quick:
        return [
            chat_trace(seed, num_conversations=8, num_turns=4),
            few_shot_trace(seed, num_requests=48),
            branching_trace(seed, num_problems=4, num_branches=8),
            no_sharing_trace(seed, num_requests=32),
            doc_qa_trace(seed, num_documents=6, num_requests=40),
        ]
    return [
        chat_trace(seed),
        few_shot_trace(seed),
        branching_trace(seed),
        no_sharing_trace(seed),
        doc_qa_trace(seed),
    ]


# ----------------------------------------------------------------------------------------------
# Adapters: the request lifecycle against each cache


@dataclass(slots=True)
class Ticket:
    """An admitted request: what it holds while in flight."""

    request: Request
    num_cached_tokens: int
    block_table: list[int]  # one block per block index of request.written
    table: BlockTable | None = None  # radixkv
    block_hashes: tuple[int, ...] = ()  # flat
    locked_node: Any = None  # page radix: the node its hit locks
    num_private_pages: int = 0  # page radix


class CacheAdapter(Protocol):
    name: str
    aborted_query_tokens: int  # acquisitions undone because the allocation did not fit
    aborted_hit_tokens: int
    # Written tokens a finished request leaves uncached (the block-granular caches' partial last
    # block): lost like evicted ones, but never counted as evicted.
    num_dropped_tokens: int
    peak_held_blocks: int  # most blocks cached or in use at once (radixkv; 0 where not measured)

    def admit(self, request: Request) -> Ticket | None: ...
    def finish(self, ticket: Ticket) -> None: ...
    def num_evicted_blocks(self) -> int: ...
    def num_evicted_tokens(self) -> int: ...
    def check_idle(self) -> None: ...


class _EvictionCounts:
    """Eviction totals read from a cache whose `stats()` counts evicted blocks and tokens."""

    cache: Any
    num_dropped_tokens = 0
    peak_held_blocks = 0
    # Tokens past the prompt admitted with it (radixkv admits what the request will write, its
    # reply included, and counts them all as query tokens)
    num_reply_tokens_admitted = 0

    def num_evicted_blocks(self) -> int:
        return self.cache.stats().num_evicted_blocks

    def num_evicted_tokens(self) -> int:
        return self.cache.stats().num_evicted_tokens


class RadixAdapter(_EvictionCounts):
    name = "radixkv"

    def __init__(
        self, num_blocks: int, block_size: int, eviction: str = "gdsf", host_ratio: int = 0
    ) -> None:
        """`host_ratio`: a host tier of that many times the device blocks (its moves are planned
        and dropped: the hit rate is what a tier would give, the time what the planning costs)."""
        self.cache = PrefixCache(
            num_blocks=num_blocks,
            block_size=block_size,
            eviction=eviction,
            host_blocks=host_ratio * num_blocks,
        )
        self.block_size = block_size
        self.aborted_query_tokens = 0
        self.aborted_hit_tokens = 0

    def admit(self, request: Request) -> Ticket | None:
        cache = self.cache
        num_prompt = request.num_prompt_tokens
        # NOTE: the last prompt token is always computed (its logits sample the first reply token).
        # Private blocks for everything written, the reply's included: the copy-on-write target
        # of a partial hit block (`table.copy`, the kernels' job), then the uncached part.
        table = cache.admit(request.written, max_hit=num_prompt - 1)
        cache.take_moves()
        if table is None:  # the fit is checked read-only: nothing counted, nothing changed
            return None
        self.num_reply_tokens_admitted += len(request.written) - num_prompt
        held = self.cache.stats()
        self.peak_held_blocks = max(self.peak_held_blocks, held.num_blocks - held.num_free_blocks)
        return Ticket(request, table.num_cached_tokens, list(table.blocks), table=table)

    def finish(self, ticket: Ticket) -> None:
        assert ticket.table is not None
        self.cache.commit(ticket.table, ticket.request.written)
        self.cache.close(ticket.table)

    def check_idle(self) -> None:
        self.cache.check_integrity()
        stats = self.cache.stats()
        assert stats.num_in_use_blocks == 0, f"blocks leaked: {stats}"
        assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_blocks, stats


class FlatAdapter(_EvictionCounts):
    name = "flat"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.cache = FlatHashCache(num_blocks=num_blocks, block_size=block_size)
        self.block_size = block_size
        self.aborted_query_tokens = 0
        self.aborted_hit_tokens = 0

    def admit(self, request: Request) -> Ticket | None:
        cache = self.cache
        m: FlatMatch = cache.match(request.prompt, max_tokens=request.num_prompt_tokens - 1)
        num_blocks = -(-(len(request.tokens) - 1) // self.block_size)
        num_private = num_blocks - len(m.block_ids)
        if not cache.can_allocate(num_private):  # taking the hit blocks only shortens the queue
            return None
        cache.acquire(m)
        private = cache.allocate(num_private)
        if private is None:
            cache.release(m.block_ids)
            self.aborted_query_tokens += m.num_query_tokens
            self.aborted_hit_tokens += m.num_cached_tokens
            return None
        table = list(m.block_ids) + private
        return Ticket(request, m.num_cached_tokens, table, block_hashes=m.block_hashes)

    def finish(self, ticket: Ticket) -> None:
        self.cache.cache_full_blocks(
            ticket.request.written,
            ticket.block_table,
            ticket.block_hashes,
            num_cached_blocks=ticket.num_cached_tokens // self.block_size,
        )
        self.num_dropped_tokens += len(ticket.request.written) % self.block_size
        self.cache.release(ticket.block_table)

    def num_evicted_tokens(self) -> int:
        return self.cache.stats().num_evicted_blocks * self.block_size  # full blocks only

    def check_idle(self) -> None:
        self.cache.check_integrity()
        assert self.cache.num_free_blocks == self.cache.num_blocks, "blocks still referenced"


class PageRadixAdapter(_EvictionCounts):
    """SGLang RadixCache semantics (`PageRadixCache`): page = block ("page") or page = 1 token
    ("token": the same memory, `num_blocks * B` token slots, stored token by token)."""

    def __init__(self, num_blocks: int, block_size: int, *, token_granular: bool) -> None:
        self.name = "token" if token_granular else "page"
        page_size = 1 if token_granular else block_size
        self.cache = PageRadixCache(num_blocks * block_size // page_size, page_size)
        self.page_size = page_size
        self.aborted_query_tokens = 0
        self.aborted_hit_tokens = 0

    def admit(self, request: Request) -> Ticket | None:
        cache = self.cache
        # NOTE: the last prompt token is always computed (its logits sample the first reply token).
        m = cache.match(request.prompt.tobytes(), request.num_prompt_tokens - 1)
        num_written = len(request.tokens) - 1
        num_private = -(-(num_written - m.num_cached_tokens) // self.page_size)
        node = cache.acquire(m)
        if not cache.allocate(num_private):
            cache.unlock(node)
            self.aborted_query_tokens += m.num_query_tokens
            self.aborted_hit_tokens += m.num_cached_tokens
            return None
        return Ticket(
            request, m.num_cached_tokens, [], locked_node=node, num_private_pages=num_private
        )

    def finish(self, ticket: Ticket) -> None:
        written = ticket.request.written.tobytes()
        node = self.cache.insert(written, ticket.num_private_pages, ticket.locked_node)
        self.num_dropped_tokens += len(ticket.request.written) % self.page_size
        self.cache.unlock(node)

    def check_idle(self) -> None:
        self.cache.check_integrity()
        assert self.cache.num_private_pages == 0, "pages still held by requests"
        assert self.cache.root.lock_ref == 1, "a lock was not released"


ADAPTERS: dict[str, Callable[[int, int], CacheAdapter]] = {
    "radixkv": RadixAdapter,
    "radixkv-lru": partial(RadixAdapter, eviction="lru"),  # the order GDSF replaced
    "radixkv-host4": partial(RadixAdapter, host_ratio=4),  # + a host tier of 4x the device
    "flat": FlatAdapter,
    "page": partial(PageRadixAdapter, token_granular=False),
    "token": partial(PageRadixAdapter, token_granular=True),
}
# Block-granular baselines: a hit and what they cache are whole blocks (radixkv must beat them).
BLOCK_BASELINES = ("flat", "page")
TOKEN_BASELINE = "token"  # same memory, stored token by token: the bound radixkv closes on
SCALING_CACHES = ("radixkv", "flat")


# ----------------------------------------------------------------------------------------------
# Driver


@dataclass(frozen=True, slots=True)
class RunResult:
    trace: str
    cache: str
    block_size: int
    capacity_fraction: float
    num_blocks: int
    num_requests: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_evicted_blocks: int
    num_evicted_tokens: int
    num_dropped_tokens: int  # written but never cached (see CacheAdapter)
    peak_held_blocks: int
    num_stalls: int  # requests that found no room at first and waited for in-flight ones
    total_ns: int  # time in cache calls
    request_ns: np.ndarray  # [num_requests] time in cache calls per request
    prompt_lens: np.ndarray  # [num_requests]
    adapter: CacheAdapter

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens

    @property
    def num_lost_tokens(self) -> int:
        """Written tokens the cache did not keep: evicted, or never cached."""
        return self.num_evicted_tokens + self.num_dropped_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / (self.total_ns * 1e-9)

    def percentile_us(self, q: float, lo: int = 0, hi: int | None = None) -> float:
        sel = self.request_ns
        if lo or hi is not None:
            mask = self.prompt_lens >= lo
            if hi is not None:
                mask &= self.prompt_lens <= hi
            sel = sel[mask]
        return float(np.percentile(sel, q)) / 1e3 if len(sel) else float("nan")


def capacity_blocks(trace: Trace, block_size: int, fraction: float, window: int) -> int:
    """fraction x working set, but at least room for `window` requests in flight (+ a CoW block)."""
    floor = window * (trace.max_request_blocks(block_size) + 1)
    return max(math.ceil(fraction * trace.working_set_blocks(block_size)), floor)


def run_trace(
    trace: Trace,
    cache_name: str,
    block_size: int,
    num_blocks: int,
    *,
    capacity_fraction: float = 1.0,
    window: int = 8,
) -> RunResult:
    adapter = ADAPTERS[cache_name](num_blocks, block_size)
    requests = trace.requests
    request_ns = np.zeros(len(requests), dtype=np.int64)
    done = np.zeros(len(requests), dtype=bool)
    in_flight: deque[tuple[int, Ticket]] = deque()
    clock = time.perf_counter_ns
    num_cached = 0
    num_stalls = 0

    def finish_oldest() -> None:
        index, ticket = in_flight.popleft()
        t0 = clock()
        adapter.finish(ticket)
        request_ns[index] += clock() - t0
        done[index] = True

    gc.collect()
    for index, request in enumerate(requests):
        if request.after is not None:
            while not done[request.after]:
                finish_oldest()
        if len(in_flight) >= window:
            finish_oldest()
        stalled = False
        while True:
            t0 = clock()
            ticket = adapter.admit(request)
            request_ns[index] += clock() - t0
            if ticket is not None:
                break
            if not in_flight:
                raise RuntimeError(f"{trace.name}: request {index} does not fit in an idle cache")
            stalled = True
            finish_oldest()
        num_stalls += stalled
        num_cached += ticket.num_cached_tokens
        in_flight.append((index, ticket))
    while in_flight:
        finish_oldest()
    adapter.check_idle()

    prompt_lens = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
    return RunResult(
        trace=trace.name,
        cache=cache_name,
        block_size=block_size,
        capacity_fraction=capacity_fraction,
        num_blocks=num_blocks,
        num_requests=len(requests),
        num_prompt_tokens=int(prompt_lens.sum()),
        num_cached_tokens=num_cached,
        num_evicted_blocks=adapter.num_evicted_blocks(),
        num_evicted_tokens=adapter.num_evicted_tokens(),
        num_dropped_tokens=adapter.num_dropped_tokens,
        peak_held_blocks=adapter.peak_held_blocks,
        num_stalls=num_stalls,
        total_ns=int(request_ns.sum()),
        request_ns=request_ns,
        prompt_lens=prompt_lens,
        adapter=adapter,
    )


def merge_fastest(best: RunResult, run: RunResult) -> RunResult:
    """Fold another identical run into `best`, keeping each request's fastest time. The runs are
    deterministic (same trace, cache and capacity), so every request does the same work each time;
    on a shared machine the fastest time is the one least disturbed by other tenants."""
    assert (run.num_cached_tokens, run.num_evicted_blocks, run.num_stalls) == (
        best.num_cached_tokens,
        best.num_evicted_blocks,
        best.num_stalls,
    ), "runs of the same configuration must be identical"
    request_ns = np.minimum(best.request_ns, run.request_ns)
    return replace(best, request_ns=request_ns, total_ns=int(request_ns.sum()))


# ----------------------------------------------------------------------------------------------
# Scaling: per-operation cost against a full cache of 10^3 .. 10^6 blocks


SCALING_OPS = ("match", "request", "allocate(4)", "evict(4)")


@dataclass(frozen=True, slots=True)
class ScalingResult:
    cache: str
    num_cached_blocks: int
    fill_s: float
    # op -> (median, mean) ns per call of each timing round
    round_stats: dict[str, list[tuple[float, float]]]

    def best_us(self, op: str) -> tuple[float, float]:
        """(median, mean) µs per call of the fastest round: the rounds do the same work, spread
        over the whole run, so the fastest is the one least disturbed by other tenants."""
        stats = self.round_stats[op]
        return min(p50 for p50, _ in stats) / 1e3, min(mean for _, mean in stats) / 1e3


class _ScalingDriver:
    """The operations of one cache, each timed on its own."""

    def __init__(self, cache_name: str, num_blocks: int, block_size: int) -> None:
        self.cache_name = cache_name
        self.block_size = block_size
        if cache_name == "radixkv":
            self.radix = PrefixCache(num_blocks=num_blocks, block_size=block_size)
        else:
            self.flat = FlatHashCache(num_blocks=num_blocks, block_size=block_size)

    @property
    def num_free_blocks(self) -> int:
        if self.cache_name == "radixkv":
            return self.radix.stats().num_free_blocks
        return self.flat.num_free_blocks

    def num_cached_blocks(self) -> int:
        if self.cache_name == "radixkv":
            return self.radix.stats().num_evictable_blocks
        return self.flat.stats().num_cached_blocks

    def match(self, tokens: np.ndarray) -> int:
        """Time one match; returns ns."""
        clock = time.perf_counter_ns
        if self.cache_name == "radixkv":
            t0 = clock()
            self.radix.match(tokens, max_tokens=len(tokens) - 1)
            return clock() - t0
        t0 = clock()
        self.flat.match(tokens, max_tokens=len(tokens) - 1)
        return clock() - t0

    def request(self, tokens: np.ndarray) -> tuple[int, int] | None:
        """Insert a whole sequence the way a request does (radixkv: admit, commit, close; flat:
        match, acquire, allocate, insert, release). Returns (ns of the whole request, ns of its
        allocation: radixkv's admit, which matches, locks and allocates; flat's allocate), or
        None if it did not fit."""
        clock = time.perf_counter_ns
        if self.cache_name == "radixkv":
            cache = self.radix
            t0 = clock()
            table = cache.admit(tokens, max_hit=len(tokens) - 1)
            t1 = clock()
            if table is None:
                return None
            cache.commit(table, tokens)
            cache.close(table)
            return clock() - t0, t1 - t0
        flat = self.flat
        t0 = clock()
        fm = flat.match(tokens, max_tokens=len(tokens) - 1)
        flat.acquire(fm)
        t1 = clock()
        private = flat.allocate(-(-len(tokens) // self.block_size) - len(fm.block_ids))
        t2 = clock()
        if private is None:
            flat.release(fm.block_ids)
            return None
        table = list(fm.block_ids) + private
        flat.cache_full_blocks(tokens, table, fm.block_hashes, num_cached_blocks=len(fm.block_ids))
        flat.release(table)
        return clock() - t0, t2 - t1

    def evict(self, num_blocks: int) -> int:
        clock = time.perf_counter_ns
        if self.cache_name == "radixkv":
            t0 = clock()
            self.radix.evict(num_blocks)
            return clock() - t0
        t0 = clock()
        self.flat.evict(num_blocks)
        return clock() - t0

    def check(self) -> None:
        if self.cache_name == "radixkv":
            self.radix.check_integrity()
        else:
            self.flat.check_integrity()


class ScalingBench:
    """One cache filled to `target_blocks` blocks, then timed in rounds (`time_round`).

    The fill is made of groups of `group_size` distinct sequences of `seq_len` tokens: the first of
    a group is fresh, each next one continues a random earlier one of its group, cut at a random
    (mostly mid-block) position below seq_len / 2. Every group has the same shape, so a larger cache
    holds more groups, not deeper paths: the table shows cost against cache size alone. The cache is
    filled until full; the timed operations then run in steady state (every allocation evicts LRU
    blocks, and what is evicted is refilled, so the cache stays full).
    """

    def __init__(
        self,
        cache_name: str,
        target_blocks: int,
        *,
        seed: int,
        block_size: int = 16,
        seq_len: int = 512,
        group_size: int = 8,
    ) -> None:
        self.cache_name = cache_name
        self.block_size = block_size
        self.seq_len = seq_len
        self.rng = np.random.default_rng([seed, 5, target_blocks])
        self.driver = _ScalingDriver(cache_name, target_blocks, block_size)
        self.round_stats: dict[str, list[tuple[float, float]]] = {op: [] for op in SCALING_OPS}
        rng = self.rng
        min_new_blocks = (seq_len - seq_len // 2) // block_size  # a branch shares < seq_len / 2
        max_seqs = target_blocks // max(min_new_blocks, 1) + group_size
        seqs = np.empty((max_seqs, seq_len), dtype=TOKEN_DTYPE)
        num_seqs = 0
        gc.collect()
        t_fill = time.perf_counter()
        blocks_per_seq = seq_len // block_size
        while self.driver.num_free_blocks >= blocks_per_seq + 1 and num_seqs < max_seqs:
            row = seqs[num_seqs]
            in_group = num_seqs % group_size
            shared = int(rng.integers(0, seq_len // 2)) if in_group else 0
            if shared:
                row[:shared] = seqs[num_seqs - 1 - int(rng.integers(in_group))][:shared]
            row[shared:] = rng.integers(0, VOCAB_SIZE, seq_len - shared, dtype=TOKEN_DTYPE)
            if self.driver.request(row) is None:
                break
            num_seqs += 1
        self.fill_s = time.perf_counter() - t_fill
        self.seqs = seqs[:num_seqs]
        self.num_cached_blocks = self.driver.num_cached_blocks()
        self.driver.check()

    def _fresh(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB_SIZE, n, dtype=TOKEN_DTYPE)

    def time_round(self, num_ops: int) -> None:
        """Restore the fill, then time `num_ops` of each operation (twice as many matches), each
        phase after a few untimed ones.

        Restore (untimed): every filled sequence goes through the request lifecycle again, so it is
        fully cached (what the previous round's churn evicted is re-inserted) and recently used.
        Queries come from the more recently restored half of the fill, which the small churn of a
        round (at most num_ops * 2 blocks before the allocate phase) cannot evict.

        * match: a filled sequence (at most seq_len - 1 tokens served).
        * request: prefix of a filled sequence + 16 new tokens, its whole life timed (match to
          release).
        * allocate(4): 4 blocks out of a full cache (evicting 4) for a new 64-token sequence
          (radixkv: its admit, which also walks and locks); then (untimed) it is inserted into
          them so the cache stays full.
        * evict(4): evict 4 blocks, then (untimed) refill them the same way.
        """
        driver, rng = self.driver, self.rng
        for row in self.seqs:
            assert driver.request(row) is not None, "the fill must fit in the cache"
        queries = self.seqs[len(self.seqs) // 2 :]
        warmup = max(num_ops // 10, 5)
        op_ns: dict[str, list[int]] = {op: [] for op in SCALING_OPS}
        gc.collect()
        for _ in range(warmup + 2 * num_ops):
            op_ns["match"].append(driver.match(queries[int(rng.integers(len(queries)))]))
        for _ in range(warmup + num_ops):
            base = queries[int(rng.integers(len(queries)))]
            cut = int(rng.integers(self.seq_len // 4, self.seq_len))
            timed = driver.request(np.concatenate([base[:cut], self._fresh(16)]))
            assert timed is not None, "a small request must fit in a full, unlocked cache"
            op_ns["request"].append(timed[0])
        refill = 4 * self.block_size
        for _ in range(warmup + num_ops):
            timed = driver.request(self._fresh(refill))  # its allocate(4) evicts 4 blocks
            assert timed is not None
            op_ns["allocate(4)"].append(timed[1])
        for _ in range(warmup + num_ops):
            op_ns["evict(4)"].append(driver.evict(4))
            assert driver.request(self._fresh(refill)) is not None
        for op, samples in op_ns.items():
            ns = np.array(samples[warmup:], dtype=np.int64)
            self.round_stats[op].append((float(np.median(ns)), float(ns.mean())))

    def result(self) -> ScalingResult:
        self.driver.check()
        return ScalingResult(
            cache=self.cache_name,
            num_cached_blocks=self.num_cached_blocks,
            fill_s=self.fill_s,
            round_stats=self.round_stats,
        )


def run_scaling(
    sizes: Sequence[int], *, seed: int, rounds: int, num_ops: int
) -> list[ScalingResult]:
    """Fill one cache per (cache kind, size), then time them in interleaved rounds, so that every
    size of every cache is measured at several moments of the run (the machine is shared and its
    speed drifts); each row reports its fastest round."""
    benches = [ScalingBench(name, size, seed=seed) for name in SCALING_CACHES for size in sizes]
    for _ in range(rounds):
        for bench in benches:
            bench.time_round(num_ops)
    return [bench.result() for bench in benches]


# ----------------------------------------------------------------------------------------------
# Tables


def _fmt_int(n: float) -> str:
    return f"{int(n):,}"


_SHORT = {
    "radixkv": "rkv",
    "radixkv-lru": "lru",
    "radixkv-host4": "host4",
    "flat": "flat",
    "page": "page",
    "token": "tok",
}


def _grouped(results: Sequence[RunResult]) -> tuple[list[str], dict[tuple, dict[str, RunResult]]]:
    """The cache names present (in ADAPTERS order) and results by (trace, B, capacity)."""
    by_key: dict[tuple[str, int, float], dict[str, RunResult]] = {}
    for r in results:
        by_key.setdefault((r.trace, r.block_size, r.capacity_fraction), {})[r.cache] = r
    names = [n for n in ADAPTERS if any(r.cache == n for r in results)]
    return names, by_key


def format_results(results: Sequence[RunResult]) -> str:
    """One row per (trace, block size, capacity); per metric one column per cache."""
    names, by_key = _grouped(results)
    metrics: list[tuple[str, int, Callable[[RunResult], str]]] = [
        ("hit%", 6, lambda r: f"{r.hit_rate:.1%}"),
        ("evicted tokens", 9, lambda r: _fmt_int(r.num_evicted_tokens)),
        ("lost tokens (evicted + never cached)", 9, lambda r: _fmt_int(r.num_lost_tokens)),
        ("stalls", 4, lambda r: str(r.num_stalls)),
        ("req/s", 7, lambda r: _fmt_int(r.requests_per_s)),
        ("p50 µs", 6, lambda r: f"{r.percentile_us(50):.1f}"),
        ("p99 µs", 6, lambda r: f"{r.percentile_us(99):.1f}"),
    ]
    lead = f"{'trace':<10} {'B':>3} {'cap':>4} {'blocks':>7}"
    header1 = " " * len(lead)
    header2 = lead
    for title, width, _ in metrics:
        group = " ".join(f"{_SHORT.get(n, n):>{width}}" for n in names)
        header1 += f" | {title:^{len(group)}}"
        header2 += f" | {group}"
    lines = [header1, header2, "-" * len(header2)]
    for (trace, block_size, fraction), row in by_key.items():
        first = row[names[0]]
        line = f"{trace:<10} {block_size:>3} {fraction:>4.0%} {first.num_blocks:>7}"
        for _, width, cell in metrics:
            line += " | " + " ".join(f"{cell(row[n]) if n in row else '-':>{width}}" for n in names)
        lines.append(line)
    return "\n".join(lines)


def _times(a: int, b: int) -> str:
    """a as a multiple of b: `-` when both are 0, `inf` when only b is."""
    if b:
        return f"{a / b:.2f}"
    return "inf" if a else "-"


GAP_GOAL = 0.5  # share of the gap to the token-granular baseline to close at 25 % capacity
EVICTED_GOAL = 1.5  # evicted tokens at most this multiple of each block-granular baseline's


def format_goals(results: Sequence[RunResult], cache: str = "radixkv") -> str:
    """`cache` against the goals of fewer tokens lost at large blocks, per cell:
    * hit rate >= the best block-granular baseline's (BLOCK_BASELINES) at the same block size;
    * share of the gap between that baseline and the token-granular one that it closes (goal at
      25 % capacity: >= GAP_GOAL; `-` where there is no gap);
    * evicted tokens as a multiple of the block-granular baselines' (most and fewest; goal
      <= EVICTED_GOAL against each; `inf` where a baseline evicted nothing and it did);
    * for comparison only (no goal), lost tokens (evicted + never cached) likewise: the
      block-granular caches never cache a request's partial last block, which no eviction count
      shows.
    A `!` marks a missed goal; the last line counts the misses. Under a row where a baseline
    evicted nothing and `cache` did, a note compares `cache`'s peak blocks at 100 % capacity (no
    eviction there) with this row's pool: when the peak is larger, every eviction order must evict
    here (the runs of all orders are the same until the first eviction)."""
    names, by_key = _grouped(results)
    if cache not in names or TOKEN_BASELINE not in names:
        return f"(goals need the {cache} and token caches)"
    header = (
        f"{'trace':<10} {'B':>3} {'cap':>4} | {'hit%':>6} {'best blk':>8} {'token':>6}"
        f" {'>= blk':>6} {'gap closed':>10} | {'evicted x blk (max, min)':>24}"
        f" | {'lost x blk (max, min)':>21}"
    )
    lines = [header, "-" * len(header)]
    misses = {"hit": 0, "gap": 0, "evicted": 0}
    for (trace, block_size, fraction), row in by_key.items():
        rk, tok = row[cache], row[TOKEN_BASELINE]
        blocks = [row[n] for n in BLOCK_BASELINES if n in row]
        best = max(r.num_cached_tokens for r in blocks)
        hit_ok = rk.num_cached_tokens >= best
        gap = tok.num_cached_tokens - best
        closed = "-"
        if gap > 0:
            share = (rk.num_cached_tokens - best) / gap
            gap_ok = fraction > 0.25 or share >= GAP_GOAL
            closed = f"{share:.0%}{'' if gap_ok else '!'}"
            misses["gap"] += not gap_ok
        evicted = sorted(r.num_evicted_tokens for r in blocks)
        ev_ok = all(rk.num_evicted_tokens <= EVICTED_GOAL * e for e in evicted)
        ratios = ", ".join(_times(rk.num_evicted_tokens, e) for e in evicted)
        lost = sorted(r.num_lost_tokens for r in blocks)
        lost_ratios = ", ".join(_times(rk.num_lost_tokens, e) for e in lost)
        misses["hit"] += not hit_ok
        misses["evicted"] += not ev_ok
        lines.append(
            f"{trace:<10} {block_size:>3} {fraction:>4.0%} |"
            f" {rk.hit_rate:>6.1%} {best / rk.num_prompt_tokens:>8.1%} {tok.hit_rate:>6.1%}"
            f" {'yes' if hit_ok else 'NO!':>6} {closed:>10} |"
            f" {ratios + ('' if ev_ok else ' !'):>24} | {lost_ratios:>21}"
        )
        full = by_key.get((trace, block_size, 1.0), {}).get(cache)
        if evicted[0] == 0 and rk.num_evicted_tokens and full is not None:
            lines.append(
                f"  (forced: {cache} holds {full.peak_held_blocks} blocks at 100 % without"
                f" evicting; this pool has {rk.num_blocks})"
            )
    lines.append(
        f"missed goals ({len(by_key)} cells): hit < best block baseline in {misses['hit']},"
        f" gap closed < {GAP_GOAL:.0%} at 25 % in {misses['gap']},"
        f" evicted tokens > {EVICTED_GOAL}x in {misses['evicted']}"
    )
    return "\n".join(lines)


def format_scaling(results: Sequence[ScalingResult]) -> str:
    """µs per operation (median and mean), each also as a ratio to the first size of its cache."""
    cell = " {:>6} {:>6} {:>5} {:>6}"
    width = len(cell.format("", "", "", ""))
    header = f"{'':<8} {'':>13} {'':>6} |" + " |".join(f"{op:^{width}}" for op in SCALING_OPS)
    header2 = f"{'cache':<8} {'cached blocks':>13} {'fill s':>6} |" + " |".join(
        cell.format("p50", "mean", "x p50", "x mean") for _ in SCALING_OPS
    )
    lines = [header, header2, "-" * len(header2)]
    base: dict[tuple[str, str], tuple[float, float]] = {}
    for r in results:
        cells = []
        for op in SCALING_OPS:
            p50_us, mean_us = r.best_us(op)
            ref_p50, ref_mean = base.setdefault((r.cache, op), (p50_us, mean_us))
            cells.append(
                cell.format(
                    f"{p50_us:.1f}",
                    f"{mean_us:.1f}",
                    f"{p50_us / ref_p50:.2f}",
                    f"{mean_us / ref_mean:.2f}",
                )
            )
        lines.append(
            f"{r.cache:<8} {_fmt_int(r.num_cached_blocks):>13} {r.fill_s:>6.1f} |"
            + " |".join(cells)
        )
    return "\n".join(lines)


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} CPUs visible, Python {platform.python_version()},"
        f" numpy {np.__version__}"
    )


def calibration_us() -> tuple[float, float]:
    """(fastest, median) of 9 timings of a fixed pure-Python workload (dict + list operations):
    printed before and after the run, so a reader can tell how much of the machine the run had."""
    times = []
    for _ in range(9):
        t0 = time.perf_counter_ns()
        d: dict[int, int] = {}
        for i in range(20000):
            d[i * 7919 % 20011] = i
        acc = 0
        for i in range(20000):
            acc += d.get(i, 0)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return min(times), float(np.median(times))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small traces and scaling sizes")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=8, help="requests in flight")
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="rounds over the whole grid / scaling table; each request's fastest counts",
    )
    parser.add_argument("--traces", nargs="+", default=None, help="subset of trace names")
    parser.add_argument(
        "--caches", nargs="+", default=list(ADAPTERS), choices=list(ADAPTERS), help="caches to run"
    )
    parser.add_argument(
        "--scaling-sizes",
        type=int,
        nargs="*",
        default=None,
        help="cached blocks (default 10^3..10^6)",
    )
    parser.add_argument("--scaling-rounds", type=int, default=10, help="timing rounds per size")
    parser.add_argument("--no-trace", action="store_true", help="only the scaling table")
    args = parser.parse_args(argv)

    print(f"# machine: {machine_line()}")
    fastest, median = calibration_us()
    print(
        "# calibration before (a fixed Python loop, fastest / median of 9):"
        f" {fastest:.0f} / {median:.0f} µs"
    )
    print(f"# command: {' '.join(['python benchmarks/cache_bench.py', *sys.argv[1:]])}")
    if not args.no_trace:
        traces = make_traces(args.seed, args.quick)
        if args.traces:
            traces = [t for t in traces if t.name in args.traces]
        configs: list[tuple[Trace, int, float, int]] = []
        for trace in traces:
            prompt_lens = [r.num_prompt_tokens for r in trace.requests]
            working_sets = ", ".join(
                f"{trace.working_set_blocks(b)} @B={b}" for b in args.block_sizes
            )
            print(
                f"# trace {trace.name}: {len(trace.requests)} requests, prompt tokens"
                f" {min(prompt_lens)}..{max(prompt_lens)} (median {int(np.median(prompt_lens))}),"
                f" working set (blocks) {working_sets}"
            )
            for block_size in args.block_sizes:
                for fraction in args.capacities:
                    num_blocks = capacity_blocks(trace, block_size, fraction, args.window)
                    configs.append((trace, block_size, fraction, num_blocks))
        # The whole grid is run `repeat` times over (rounds spread over the run, caches alternated)
        # so that every row gets measured at several moments of a machine whose speed drifts.
        best: dict[tuple[int, str], RunResult] = {}
        for _ in range(args.repeat):
            for k, (trace, block_size, fraction, num_blocks) in enumerate(configs):
                for cache_name in args.caches:
                    run = run_trace(
                        trace,
                        cache_name,
                        block_size,
                        num_blocks,
                        capacity_fraction=fraction,
                        window=args.window,
                    )
                    key = (k, cache_name)
                    best[key] = merge_fastest(best[key], run) if key in best else run
        print(
            f"\n## Trace results ({args.window} requests in flight; time = cache calls only,"
            f" per request the fastest of {args.repeat} identical runs)"
        )
        print(format_results(list(best.values())))
        for name in ("radixkv", "radixkv-lru"):
            if name in args.caches:
                print(f"\n## Goals: {name} vs the best block-granular and token-granular caches")
                print(format_goals(list(best.values()), name))

    sizes = args.scaling_sizes
    if sizes is None:
        sizes = [10**3, 10**4] if args.quick else [10**3, 10**4, 10**5, 10**6]
    if sizes:
        rounds = 2 if args.quick else args.scaling_rounds
        scaling = run_scaling(
            sizes, seed=args.seed, rounds=rounds, num_ops=50 if args.quick else 100
        )
        print(
            "\n## Per-operation scaling (block size 16, full cache in LRU steady state;"
            f" µs per operation, fastest of {rounds} rounds; x = ratio to the first size)"
        )
        print(format_scaling(scaling))
    fastest, median = calibration_us()
    print(f"\n# calibration after (fastest / median of 9): {fastest:.0f} / {median:.0f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
