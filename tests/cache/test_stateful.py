"""Random interleavings of the whole contract against a reference model (hypothesis, stateful).

The model keeps what the cache cannot check on its own:
* the KV "contents" of every block slot (a hash of the token prefix that produced it), written by
  simulated requests exactly where a model runner would write; every match and every table after
  a commit is checked slot by slot, so a wrong block id or a write into a shared block is caught;
* every sequence inserted since the last reset (a match is at most the best common prefix with
  one of them, and exactly that while nothing was evicted) and the prefixes held by locking tables
  (a match is at least the common prefix with each of them);
* the private blocks of every open table, from the contract's rules alone (they must equal the
  cache's own record);
* whether an admission fits, from the evictable count recomputed after locking the hit on a copy
  of the cache (`admit` decides read-only, before it locks anything).

Requests behave like the scheduler: admit the prompt with the prefill cap (a copy-on-write of a
partial hit block), write KV in chunks, grow for more, commit growing prefixes (moving their lock),
finish or abort. Other tables lock a hit and hold it, or hold private blocks only. `reset` and
`evict` interleave. `check_integrity()` runs after every step; teardown closes every table and
checks no block leaked.
"""

from __future__ import annotations

import copy
import os
import random
from collections import Counter
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

from radixkv import BlockTable, MatchResult, PackedTokens, PrefixCache
from radixkv.cache.tokens import pack_tokens, unpack_tokens

VOCAB = 3  # tiny, so prefixes are shared and nodes split often
MAX_LEN = 48
POOL_BLOCKS = {1: 56, 4: 18, 16: 7}  # small pools: eviction and failed allocations happen
# RADIXKV_STATEFUL_EXAMPLES=200 gives a quick local run (the operation-count floor then is skipped).
MAX_EXAMPLES = int(os.environ.get("RADIXKV_STATEFUL_EXAMPLES", "700"))
STEPS_PER_EXAMPLE = 50
# The count moves a few percent with the process's imports (hypothesis draws constants from the
# local modules loaded): 96.6k run alone, above 100k inside the whole suite.
MIN_TOTAL_OPERATIONS = 90_000

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
    table: BlockTable
    locked: int  # its lock protects tokens[0:locked]
    written: int  # KV written for tokens[0:written]
    private: set[int] = field(default_factory=set)


class Counted:
    """The cache under test: each operation is counted and followed by check_integrity(); every
    other call that takes tokens gets them as a PackedTokens."""

    OPERATIONS = frozenset({"match", "admit", "grow", "commit", "close", "evict", "reset"})

    def __init__(self, cache: PrefixCache) -> None:
        self.inner = cache

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self.OPERATIONS:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            operations["count"] += 1
            if name in ("match", "admit") and operations["count"] % 2:
                args = (PackedTokens(args[0]), *args[1:])  # every other call: packed tokens
            elif name == "commit" and operations["count"] % 2:
                args = (args[0], PackedTokens(args[1]))
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
        self.loose: list[BlockTable] = []  # tables of private blocks only (admitted unlocked)
        self.plain: list[tuple[BlockTable, list[int]]] = []  # tables locking a hit + its tokens

    # ------------------------------------------------------------ model
    def fresh(self, blocks: Sequence[int]) -> None:
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

    def expected_fit(self, tokens: list[int], max_hit: int | None) -> bool:
        """Whether `admit(tokens, max_hit=max_hit)` can get its blocks: on a copy of the cache,
        lock the hit's path the way admission does, recompute the evictable count from scratch
        (the tree's own integrity check) and compare free + evictable with the blocks needed."""
        inner = copy.deepcopy(self.cache.inner)
        tree, blocks, hit = inner._tree, [], 0
        if max_hit is not None:
            hit, node, blocks = tree.walk(pack_tokens(tokens), min(max_hit, len(tokens)))
            node = node or tree.root
            tree.lock_path(node, inner._clock + 1)
            locks = Counter(t.node.node_id for t in inner._open if t.node is not None)
            locks[node.node_id] += 1
            tree.check_integrity(locks, inner._clock + 1)
        need = ceil_div(len(tokens), self.B) - len(blocks) + (hit % self.B != 0)
        return inner._pool.num_free + tree.num_evictable_blocks >= need

    def admitted(self, table: BlockTable | None, fits: bool, hit: MatchResult | None) -> bool:
        """Check an admission against the model: it fits exactly when expected, takes the hit,
        copies a partial hit block, and everything else in it is fresh. Returns whether it got in
        (the new blocks are then fresh in the model, the copy done)."""
        assert (table is not None) == fits
        if table is None:
            return False
        hit_blocks = () if hit is None else hit.block_ids
        m = 0 if hit is None else hit.num_cached_tokens
        assert table.num_cached_tokens == m and table.locked == (hit is not None)
        num_full = len(hit_blocks) - (m % self.B != 0)
        assert table.blocks[:num_full] == hit_blocks[:num_full]
        new = table.blocks[num_full:]
        assert table.private == set(new) and len(set(new)) == len(new)
        self.fresh(new)
        if m % self.B:
            src, dst, slots = table.copy
            assert (src, dst, slots) == (hit_blocks[-1], new[0], m % self.B)
            self.kv[dst][:slots] = self.kv[src][:slots]
        else:
            assert table.copy is None
        return True

    # --------------------------------------------------- request steps
    def admit(self, rng: random.Random) -> int | None:
        """Admit a prompt (prefill cap): its hit, a copy of a partial hit block, the rest fresh."""
        tokens = self.tokens(rng)
        prompt = rng.randint(1, len(tokens))
        m = self.cache.match(tokens[:prompt], max_tokens=prompt - 1)
        self.check_match(tokens[:prompt], prompt - 1, m)
        fits = self.expected_fit(tokens[:prompt], prompt - 1)
        table = self.cache.admit(tokens[:prompt], max_hit=prompt - 1)
        if not self.admitted(table, fits, m):
            return None
        hit = m.num_cached_tokens
        req = Request(tokens, prefix_keys(tokens), table, hit, hit, set(table.private))
        rid = self.next_request
        self.requests[rid] = req
        self.next_request += 1
        return rid

    def advance(self, req: Request, end: int) -> None:
        """A forward step writes KV for tokens [written, end), growing the table as needed."""
        need = max(0, ceil_div(end, self.B) - len(req.table.blocks))
        stats = self.cache.stats()
        fits = stats.num_free_blocks + stats.num_evictable_blocks >= need
        before = req.table.blocks
        assert self.cache.grow(req.table, need) == fits
        if not fits:
            assert req.table.blocks == before
            return
        new = req.table.blocks[len(before) :]
        assert req.table.blocks[: len(before)] == before and len(new) == need
        self.fresh(new)
        req.private.update(new)
        for j in range(req.written, end):
            slot = self.kv[req.table.blocks[j // self.B]]
            assert slot[j % self.B] is None, "a request would overwrite KV it does not own"
            slot[j % self.B] = req.keys[j]
        req.written = end

    def store(self, req: Request, upto: int) -> None:
        """Commit tokens[0:upto) (upto >= what its lock covers: it must keep its blocks). By the
        contract, the table's blocks of [0, upto) leave its private set, except a partial last
        block when the tree held all of it already: the request writes on there."""
        n_idx = ceil_div(upto, self.B)
        before = req.table.blocks
        cached = self.cache.match(req.tokens[:upto]).num_cached_tokens
        self.cache.commit(req.table, req.tokens[:upto])
        after = req.table.blocks
        assert len(after) == len(before) and after[n_idx:] == before[n_idx:]
        self.check_blocks(after, req.keys, upto)
        kept = n_idx - 1 if cached == upto and upto % self.B else None
        if kept is not None:
            assert after[kept] == before[kept], "the partial last block stays the request's"
        req.private -= set(before[:n_idx]) - ({before[kept]} if kept is not None else set())
        assert req.table.private == req.private
        req.locked = upto
        self.inserted.append(tuple(req.tokens[:upto]))

    def end(self, rid: int, store: bool) -> None:
        """Finish (commit everything written) or abort; close the table."""
        req = self.requests.pop(rid)
        if store:
            self.store(req, req.written)
        self.cache.close(req.table)
        assert req.table.blocks == () and not req.table.locked

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
        before = (self.cache.stats(), list(self.cache.nodes()), self.cache.inner._clock)
        m = self.cache.match(tokens, max_tokens=cap)
        assert (self.cache.stats(), list(self.cache.nodes()), self.cache.inner._clock) == before
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
        """A table that locks the whole hit of some tokens (and copies a partial hit block)."""
        rng = random.Random(seed)
        tokens = self.tokens(rng)
        m = self.cache.match(tokens, max_tokens=rng.randint(0, len(tokens)))
        self.check_match(tokens, m.num_cached_tokens, m)
        hit = tokens[: m.num_cached_tokens]
        fits = self.expected_fit(hit, len(hit))
        table = self.cache.admit(hit, max_hit=len(hit))
        if self.admitted(table, fits, m):
            self.plain.append((table, hit))

    @rule(seed=SEEDS)
    def hold(self, seed: int) -> None:
        """A table of private blocks only (admitted without the cache), grown or not."""
        rng = random.Random(seed)
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3 * self.B))]
        fits = self.expected_fit(tokens, None)
        table = self.cache.admit(tokens, max_hit=None)
        if self.admitted(table, fits, None):
            self.loose.append(table)

    @precondition(lambda self: self.loose or self.plain)
    @rule(seed=SEEDS, n=st.integers(0, 6))
    def grow(self, seed: int, n: int) -> None:
        tables = [t for t, _ in self.plain] + self.loose
        table = random.Random(seed).choice(tables)
        stats, before = self.cache.stats(), table.blocks
        fits = stats.num_free_blocks + stats.num_evictable_blocks >= n
        assert self.cache.grow(table, n) == fits
        new = table.blocks[len(before) :]
        assert len(new) == (n if fits else 0) and table.private >= set(new)
        self.fresh(new)

    @precondition(lambda self: self.plain)
    @rule(seed=SEEDS)
    def unlock(self, seed: int) -> None:
        table, _ = self.plain.pop(random.Random(seed).randrange(len(self.plain)))
        self.cache.close(table)

    @precondition(lambda self: self.loose)
    @rule(seed=SEEDS)
    def free(self, seed: int) -> None:
        self.cache.close(self.loose.pop(random.Random(seed).randrange(len(self.loose))))

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        evictable = self.cache.stats().num_evictable_blocks
        freed = self.cache.evict(n)
        assert len(freed) == min(n, evictable)
        assert all(self.cache.inner._pool.ref_count(b) == 0 for b in freed)

    @rule()
    def reset(self) -> None:
        locked = self.requests or self.plain
        before = (self.cache.stats(), list(self.cache.nodes()))
        done = self.cache.reset()
        assert done == (not locked)
        if not done:
            assert (self.cache.stats(), list(self.cache.nodes())) == before
            return
        s = self.cache.stats()
        assert s.num_nodes == s.num_cached_tokens == s.num_evictable_blocks == 0
        assert s.num_free_blocks == s.num_blocks - s.num_private_blocks
        self.inserted = []  # nothing inserted before is cached any more

    # ----------------------------------------------------------- checks
    @invariant()
    def consistent(self) -> None:
        if not self.B:
            return
        cache = self.cache
        cache.check_integrity()
        mine = set().union(*(r.private for r in self.requests.values()))
        tables = self.loose + [t for t, _ in self.plain]
        mine |= set().union(*(t.private for t in tables))
        assert cache.inner._private == mine
        for table in self.loose:
            assert table.private == set(table.blocks)
        s = cache.stats()
        assert s.num_free_blocks + s.num_evictable_blocks + s.num_in_use_blocks == s.num_blocks
        assert s.num_locked_tables == len(self.requests) + len(self.plain)

    def teardown(self) -> None:
        if not self.B:
            return
        cache = self.cache
        for req in self.requests.values():
            cache.close(req.table)
        for table, _ in self.plain:
            cache.close(table)
        for table in self.loose:
            cache.close(table)
        s = cache.stats()
        assert s.num_in_use_blocks == 0 and s.num_locked_tables == 0
        cache.evict(cache.num_blocks)
        s = cache.stats()
        assert s.num_free_blocks == cache.num_blocks
        assert s.num_nodes == 0 and s.num_cached_tokens == 0


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
