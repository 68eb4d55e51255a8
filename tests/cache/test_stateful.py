"""Random interleavings of the whole API against a reference model (hypothesis, stateful).

The model keeps what the cache cannot check on its own:
* the KV "contents" of every block slot (a hash of the token prefix that produced it), written by
  simulated requests exactly where a model runner would write; every match and every insert result
  is checked slot by slot, so a wrong block id or a write into a shared block is caught;
* every sequence ever inserted (a match is at most the best common prefix with one of them, and
  exactly that while nothing was evicted) and the prefixes held by live locks (a match is at least
  the common prefix with each of them);
* the private blocks each simulated request holds (they must equal the cache's private set).

Requests behave like the scheduler: match with the prefill cap, lock, copy-on-write a partial block,
allocate, write KV in chunks, insert growing prefixes (moving their lock), finish or abort.
`check_integrity()` runs after every step; teardown releases everything and checks no block leaked.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixkv import LockHandle, MatchResult, PackedTokens, PrefixCache
from radixkv.cache.tokens import unpack_tokens

VOCAB = 3  # tiny, so prefixes are shared and nodes split often
MAX_LEN = 48
POOL_BLOCKS = {1: 56, 4: 18, 16: 7}  # small pools: eviction and failed allocations happen
# RADIXKV_STATEFUL_EXAMPLES=200 gives a quick local run (the operation-count floor then is skipped).
MAX_EXAMPLES = int(os.environ.get("RADIXKV_STATEFUL_EXAMPLES", "700"))
STEPS_PER_EXAMPLE = 50
MIN_TOTAL_OPERATIONS = 100_000

SEEDS = st.integers(0, 2**32 - 1)

operations = {"count": 0}  # cache operations run by the machine, summed over all examples


def prefix_keys(tokens: list[int]) -> list[int]:
    """Key of the KV at position j = a hash of tokens[0..j] (KV depends on the whole prefix)."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


def lcp(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    tokens: list[int]  # everything it will ever write (prompt + reply)
    keys: list[int]
    handle: LockHandle
    locked: int  # its handle protects tokens[0:locked]
    written: int  # KV written for tokens[0:written]
    table: list[int]
    private: set[int] = field(default_factory=set)


class Counted:
    """The cache under test: each operation is counted and followed by check_integrity(); every
    other match / insert gets its tokens as a PackedTokens."""

    OPERATIONS = frozenset({"match", "acquire", "release", "allocate", "free", "insert", "evict"})

    def __init__(self, cache: PrefixCache) -> None:
        self.inner = cache

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.OPERATIONS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            operations["count"] += 1
            if name in ("match", "insert") and operations["count"] % 2:
                args = (PackedTokens(args[0]), *args[1:])  # every other call: packed tokens
            try:
                return attr(*args, **kwargs)
            finally:
                self.inner.check_integrity()

        return call


class CacheMachine(RuleBasedStateMachine):
    """Rules draw one seed each and make their choices with it: drawing every token through
    hypothesis made the machine spend most of its time inside hypothesis."""

    def __init__(self) -> None:
        super().__init__()
        self.B = 0
        self.cache: Any = None
        self.kv: dict[int, list[int | None]] = {}
        self.inserted: list[tuple[int, ...]] = []
        self.seen: list[list[int]] = []
        self.requests: dict[int, Request] = {}
        self.next_request = 0
        self.loose: list[int] = []  # private blocks held outside requests
        self.plain: list[tuple[LockHandle, list[int]]] = []  # acquire() handles + locked tokens

    # ------------------------------------------------------------ model
    def fresh(self, blocks: list[int]) -> None:
        """Newly allocated blocks hold garbage: forget what was there."""
        for b in blocks:
            self.kv[b] = [None] * self.B

    def tokens(self, rng: random.Random) -> list[int]:
        """A cut of a recently seen sequence plus a short random tail: sharing at any position."""
        base: list[int] = []
        if self.seen and rng.random() < 0.7:
            src = rng.choice(self.seen)
            base = src[: rng.randint(0, len(src))]
        tail = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 14))]
        tokens = (base + tail)[:MAX_LEN] or [0]
        self.seen = [*self.seen[-15:], tokens]
        return tokens

    def tree_paths(self) -> list[list[int]]:
        """Every root-to-leaf token sequence, read from the tree's nodes."""
        out: list[list[int]] = []
        stack: list[tuple[Any, list[int]]] = [(self.cache.inner._tree.root, [])]
        while stack:
            node, prefix = stack.pop()
            path = prefix + list(unpack_tokens(node.tokens))
            if not node.children:
                out.append(path)
            stack.extend((c, path) for c in node.children.values())
        return out

    def live_locks(self) -> list[list[int]]:
        locks = [r.tokens[: r.locked] for r in self.requests.values()]
        return locks + [t for _, t in self.plain]

    def check_blocks(self, table: Sequence[int], keys: list[int], n: int) -> None:
        B = self.B
        assert len(table) >= ceil_div(n, B)
        for j in range(n):
            got = self.kv[table[j // B]][j % B]
            assert got == keys[j], f"block {table[j // B]} slot {j % B} holds the wrong KV"

    def check_match(self, tokens: list[int], cap: int | None, m: MatchResult) -> None:
        limit = len(tokens) if cap is None else min(cap, len(tokens))
        got = m.num_cached_tokens
        assert m.num_query_tokens == len(tokens)
        assert got <= limit
        best = max((lcp(tokens, s) for s in self.inserted), default=0)
        assert got <= best
        for locked in self.live_locks():
            assert got >= min(limit, lcp(tokens, locked))
        exact = max((lcp(tokens, p) for p in self.tree_paths()), default=0)
        assert got == min(limit, exact)
        if self.cache.stats().num_evicted_tokens == 0:
            assert got == min(limit, best)
        assert len(m.block_ids) == ceil_div(got, self.B)
        assert m.num_partial_slots == got % self.B
        self.check_blocks(m.block_ids, prefix_keys(tokens), got)

    # --------------------------------------------------- request steps
    def admit(self, rng: random.Random) -> int | None:
        """Match the prompt (prefill cap), lock, copy-on-write a partial block; the request id."""
        tokens = self.tokens(rng)
        prompt = rng.randint(1, len(tokens))
        m = self.cache.match(tokens[:prompt], max_tokens=prompt - 1)
        self.check_match(tokens[:prompt], prompt - 1, m)
        fits = self.can_allocate(1, m)  # the copy-on-write block, if a partial one is matched
        handle = self.cache.acquire(m)
        req = Request(
            tokens=tokens,
            keys=prefix_keys(tokens),
            handle=handle,
            locked=m.num_cached_tokens,
            written=m.num_cached_tokens,
            table=list(m.block_ids),
        )
        if m.last_block_partial:
            got = self.cache.allocate(1)
            assert (got is not None) == fits
            if got is None:
                self.cache.release(handle)
                return None
            self.fresh(got)
            src, dst = req.table[-1], got[0]
            self.kv[dst][: m.num_partial_slots] = self.kv[src][: m.num_partial_slots]
            req.table[-1] = dst
            req.private.add(dst)
        rid = self.next_request
        self.requests[rid] = req
        self.next_request += 1
        return rid

    def can_allocate(self, n: int, m: MatchResult) -> bool:
        """can_allocate(n, reserve=m), checked to be read-only (the caller checks it is exact)."""
        cache = self.cache
        before = (cache.stats(), cache.version, cache.inner._clock)
        fits = cache.can_allocate(n, reserve=m)
        assert (cache.stats(), cache.version, cache.inner._clock) == before
        return fits

    def advance(self, req: Request, end: int) -> None:
        """A forward step writes KV for tokens [written, end), allocating blocks as needed."""
        need = ceil_div(end, self.B) - len(req.table)
        if need > 0:
            got = self.cache.allocate(need)
            if got is None:
                return
            self.fresh(got)
            req.table += got
            req.private.update(got)
        for j in range(req.written, end):
            slot = self.kv[req.table[j // self.B]]
            assert slot[j % self.B] is None, "a request would overwrite KV it does not own"
            slot[j % self.B] = req.keys[j]
        req.written = end

    def store(self, req: Request, upto: int) -> None:
        """Insert tokens[0:upto) (upto >= what its lock covers: it must keep its blocks)."""
        n_idx = ceil_div(upto, self.B)
        r = self.cache.insert(req.tokens[:upto], req.table[:n_idx], handle=req.handle)
        assert r.handle.num_tokens == upto
        assert len(r.block_ids) == n_idx
        self.check_blocks(r.block_ids, req.keys, upto)
        assert set(r.owned_block_ids) <= req.private
        req.private -= set(req.table[:n_idx])
        req.private |= set(r.owned_block_ids)
        req.table[:n_idx] = r.block_ids
        req.handle = r.handle
        req.locked = upto
        self.inserted.append(tuple(req.tokens[:upto]))

    def end(self, rid: int, store: bool) -> None:
        """Finish (insert everything written) or abort; release the lock, free private blocks."""
        req = self.requests.pop(rid)
        if store:
            self.store(req, req.written)
        self.cache.release(req.handle)
        self.cache.free(sorted(req.private))

    def step(self, rng: random.Random, rid: int) -> None:
        """One random scheduler action for a running request."""
        req = self.requests[rid]
        action = rng.random()
        if action < 0.5 and req.written < len(req.tokens):
            self.advance(req, rng.randint(req.written + 1, len(req.tokens)))
        elif action < 0.8:
            self.store(req, rng.randint(req.locked, req.written))
        else:
            self.end(rid, store=rng.random() < 0.8)

    # -------------------------------------------------------------- rules
    @initialize(block_size=st.sampled_from(sorted(POOL_BLOCKS)))
    def setup(self, block_size: int) -> None:
        self.B = block_size
        self.cache = Counted(PrefixCache(POOL_BLOCKS[block_size], block_size))

    @rule(seed=SEEDS)
    def peek(self, seed: int) -> None:
        """match() alone: read-only, and right."""
        rng = random.Random(seed)
        tokens = self.tokens(rng)
        cap = None if rng.random() < 0.3 else rng.randint(0, MAX_LEN)
        before = (self.cache.stats(), self.cache.version, self.cache.inner._clock)
        m = self.cache.match(tokens, max_tokens=cap)
        assert (self.cache.stats(), self.cache.version, self.cache.inner._clock) == before
        self.check_match(tokens, cap, m)

    @rule(seed=SEEDS)
    def start(self, seed: int) -> None:
        self.admit(random.Random(seed))

    @precondition(lambda self: self.requests)
    @rule(seed=SEEDS)
    def progress(self, seed: int) -> None:
        rng = random.Random(seed)
        self.step(rng, rng.choice(sorted(self.requests)))

    @rule(seed=SEEDS)
    def batch(self, seed: int) -> None:
        """A few requests admitted together and run interleaved to the end, like a scheduler."""
        rng = random.Random(seed)
        ids = [self.admit(rng) for _ in range(rng.randint(1, 4))]
        running = [rid for rid in ids if rid is not None]
        while running:
            rid = rng.choice(running)
            self.step(rng, rid)
            running = [r for r in running if r in self.requests]

    @rule(seed=SEEDS)
    def lock(self, seed: int) -> None:
        tokens = self.tokens(random.Random(seed))
        m = self.cache.match(tokens)
        self.check_match(tokens, None, m)
        self.plain.append((self.cache.acquire(m), tokens[: m.num_cached_tokens]))

    @rule(seed=SEEDS)
    def reserve(self, seed: int) -> None:
        """can_allocate(n, reserve=m) == (allocate(n) is not None right after acquire(m))."""
        rng = random.Random(seed)
        tokens = self.tokens(rng)
        m = self.cache.match(tokens, max_tokens=rng.randint(0, len(tokens)))
        n = rng.randint(0, 8)
        fits = self.can_allocate(n, m)
        handle = self.cache.acquire(m)
        got = self.cache.allocate(n)
        assert (got is not None) == fits
        if got is not None:
            self.fresh(got)
            self.loose += got
        if rng.random() < 0.5:  # keep the lock (more locked paths), or let it go
            self.plain.append((handle, tokens[: m.num_cached_tokens]))
        else:
            self.cache.release(handle)

    @precondition(lambda self: self.plain)
    @rule(seed=SEEDS)
    def unlock(self, seed: int) -> None:
        handle, _ = self.plain.pop(random.Random(seed).randrange(len(self.plain)))
        self.cache.release(handle)

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        can = self.cache.can_allocate(n)
        before = self.cache.stats()
        got = self.cache.allocate(n)
        assert (got is not None) == can
        if got is None:
            assert self.cache.stats() == before
            return
        assert len(got) == n
        self.fresh(got)
        self.loose += got

    @precondition(lambda self: self.loose)
    @rule(seed=SEEDS)
    def free(self, seed: int) -> None:
        rng = random.Random(seed)
        chosen = rng.sample(self.loose, rng.randint(1, len(self.loose)))
        self.cache.free(chosen)
        self.loose = [b for b in self.loose if b not in chosen]

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(n)
        assert len(freed) == min(n, evictable)
        assert all(self.cache.inner._pool.is_free(b) for b in freed)

    # ----------------------------------------------------------- checks
    @invariant()
    def consistent(self) -> None:
        if not self.B:
            return
        cache = self.cache
        cache.check_integrity()
        mine = set(self.loose).union(*(r.private for r in self.requests.values()))
        assert cache.inner._private == mine
        total = cache.num_free_blocks + cache.num_evictable_blocks + cache.num_in_use_blocks
        assert total == cache.num_blocks

    def teardown(self) -> None:
        if not self.B:
            return
        cache = self.cache
        for req in self.requests.values():
            cache.release(req.handle)
            cache.free(sorted(req.private))
        for handle, _ in self.plain:
            cache.release(handle)
        cache.free(self.loose)
        assert cache.num_in_use_blocks == 0 and cache.num_live_handles == 0
        cache.evict(cache.num_blocks)
        assert cache.num_free_blocks == cache.num_blocks
        assert cache.num_nodes == 0 and cache.num_cached_tokens == 0
        assert cache.stats().num_leaked_handles == 0


CI_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    stateful_step_count=STEPS_PER_EXAMPLE,
    derandomize=True,  # the same examples on every run: CI is deterministic
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_random_interleavings_against_the_model() -> None:
    operations["count"] = 0
    run_state_machine_as_test(CacheMachine, settings=CI_SETTINGS)
    total = operations["count"]
    print(f"stateful test ran {total} cache operations")
    if "RADIXKV_STATEFUL_EXAMPLES" not in os.environ:
        assert total >= MIN_TOTAL_OPERATIONS, f"only {total} operations: raise MAX_EXAMPLES"
