"""A model-free cache of a hybrid model: a radix tree of cached KV paths with recurrent-state
snapshots on node ends, driven one request at a time under a snapshot placement policy.

The KV side is the same for every policy, so the comparison is of where snapshots are taken and
which go first:

    match(prompt[:-1]) -> m tokens of cached KV; the hit is the deepest point <= m where the
        policy's snapshots allow a resume (an all-full-attention model: m itself)
    the request computes [hit, written) and takes the policy's snapshots there, each a node end
    insert(written) with every snapshot point a node end; then KV is evicted to its budget

KV eviction evicts whole leaves, least recently used first; for a hybrid model a leaf without a
snapshot at its end goes before any other (its KV past the branch's deepest snapshot cannot serve
a hit: SGLang deletes such leaves at once), and a leaf's snapshot goes with its KV. Snapshots
live in a `SnapshotLedger` (radixkv's eviction order) of the policy's byte budget. One logical
clock: the request's index.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sortedcontainers import SortedList

from radixkv.cache.snapshots import SnapshotLedger, SnapshotPoint, SnapshotPolicy

# ----------------------------------------------------------------------------------------------
# The tree


@dataclass(eq=False, slots=True)
class Node:
    node_id: int
    parent: Node | None
    tokens: np.ndarray  # the segment [start, end) of the path
    start: int
    tick: int = 0
    snapshot: bool = False
    children: dict[int, Node] = field(default_factory=dict)
    leaf_key: tuple | None = None  # its key in the evictable leaves, while listed

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class SimTree:
    """Cached KV paths as a compressed radix tree over token ids (the root holds nothing).

    Invariants: a child's first token keys it in its parent; a non-root node holds >= 1 token;
    `num_tokens` is the tokens of all nodes; exactly the leaves are listed as evictable, keyed
    (not dead, tick, id) where a dead leaf is one without a snapshot (if `dead_first`).
    """

    def __init__(self, dead_first: bool, ledger: SnapshotLedger | None = None) -> None:
        self.dead_first = dead_first
        self.ledger = ledger  # told which snapshots are superseded
        self.root = Node(0, None, np.empty(0, dtype=np.int32), 0)
        self.num_tokens = 0
        self._ids = itertools.count(1)
        self.nodes: dict[int, Node] = {}
        self._leaves: SortedList = SortedList()

    def match(self, tokens: np.ndarray) -> tuple[list[Node], int]:
        """The nodes a prefix of `tokens` runs through (the last maybe partly) and its length."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            common = _common_prefix(child.tokens, tokens[pos:])
            path.append(child)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return path, pos

    def insert(self, tokens: np.ndarray, ends: Sequence[int], tick: int) -> dict[int, Node]:
        """Cache the path `tokens`, every position of `ends` a node end; touch the whole path at
        `tick`. Returns the node ending at each of `ends`."""
        wanted = sorted({e for e in ends if 0 < e <= len(tokens)})
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                child = self._add(node, tokens[pos:], pos)
            common = _common_prefix(child.tokens, tokens[pos:])
            cut = next((e - pos for e in wanted if pos < e < pos + common), common)
            if cut < len(child.tokens):
                child = self._split(child, cut)
            self._touch(child, tick)
            node, pos = child, pos + cut
        at = {}
        path, _ = self.match(tokens)
        for n in path:
            if n.end in wanted:
                at[n.end] = n
        assert set(at) == set(wanted), (sorted(at), wanted)
        return at

    def _add(self, parent: Node, tokens: np.ndarray, start: int) -> Node:
        node = Node(next(self._ids), parent, tokens.copy(), start)
        self._unlist(parent)
        parent.children[int(tokens[0])] = node
        self.nodes[node.node_id] = node
        self.num_tokens += len(tokens)
        self._list(node)
        self._refresh_superseded(parent)
        return node

    def _split(self, node: Node, at: int) -> Node:
        """Split `node` after `at` tokens; returns the new head [start, start + at). The tail
        keeps the node's id, snapshot, children and place among the leaves, so what is keyed by
        a node id (a snapshot in the ledger, a listed leaf) stays valid."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        head = Node(next(self._ids), parent, node.tokens[:at], node.start, node.tick)
        parent.children[int(node.tokens[0])] = head
        head.children = {int(node.tokens[at]): node}
        node.parent = head
        node.tokens = node.tokens[at:]
        node.start += at
        self.nodes[head.node_id] = head
        return head

    def _touch(self, node: Node, tick: int) -> None:
        self._unlist(node)
        node.tick = max(node.tick, tick)
        if not node.children:
            self._list(node)

    def set_snapshot(self, node: Node, value: bool) -> None:
        self._unlist(node)
        node.snapshot = value
        if not node.children:
            self._list(node)
        self._refresh_superseded(node)

    def superseded(self, node: Node) -> bool:
        """Whether a deeper snapshot lies below `node` on an unbranched path."""
        while len(node.children) == 1:
            (node,) = node.children.values()
            if node.snapshot:
                return True
        return False

    def _refresh_superseded(self, changed: Node) -> None:
        """`changed` gained or lost a child or its snapshot: re-mark it and the nearest snapshot
        above it on an unbranched path (the only ones whose status this can change)."""
        if self.ledger is None:
            return
        if changed.snapshot and changed.node_id in self.ledger:
            self.ledger.set_superseded(changed.node_id, self.superseded(changed))
        node = changed.parent
        while node is not None and node is not self.root:
            if node.snapshot:
                if node.node_id in self.ledger:
                    self.ledger.set_superseded(node.node_id, self.superseded(node))
                return
            if len(node.children) != 1:
                return
            node = node.parent

    def _key(self, node: Node) -> tuple:
        alive = node.snapshot or not self.dead_first
        return (alive, node.tick, node.node_id)

    def _list(self, node: Node) -> None:
        if node is self.root or node.children:
            return
        node.leaf_key = self._key(node)
        self._leaves.add(node.leaf_key)

    def _unlist(self, node: Node) -> None:
        if node.leaf_key is not None:
            self._leaves.remove(node.leaf_key)
            node.leaf_key = None

    def evict_to(self, max_tokens: int) -> list[Node]:
        """Evict leaves in order until the tree holds at most `max_tokens`; returns them."""
        evicted = []
        while self.num_tokens > max_tokens and self._leaves:
            node = self.nodes[self._leaves[0][2]]
            self._unlist(node)
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.tokens[0])]
            del self.nodes[node.node_id]
            self.num_tokens -= len(node.tokens)
            evicted.append(node)
            self._list(parent)
            self._refresh_superseded(parent)
        return evicted

    def check_integrity(self) -> None:
        total, leaves = 0, set()
        for node in self.nodes.values():
            assert len(node.tokens) > 0, f"empty node {node.node_id}"
            parent = node.parent
            assert parent is not None and parent.children[int(node.tokens[0])] is node
            assert node.start == parent.end, f"node {node.node_id} does not continue its parent"
            total += len(node.tokens)
            if not node.children:
                leaves.add(self._key(node))
            assert (node.leaf_key is not None) == (not node.children), f"listing {node.node_id}"
        assert total == self.num_tokens, "token count"
        assert leaves == set(self._leaves), "evictable leaves"


# ----------------------------------------------------------------------------------------------
# Policies


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a placement policy sees of a request."""

    num_prompt_tokens: int
    num_written: int  # prompt + reply - 1: the tokens whose KV and state a finished one leaves
    matched: int  # tokens of cached KV the prompt starts with (at most num_prompt - 1)
    hit: int  # where the request resumes


class Placement:
    """A snapshot placement policy: where a request may resume and which snapshots it takes."""

    name: str
    hybrid = True

    def resume(self, path: list[Node], matched: int) -> Node | None:
        """The node whose end is the deepest usable snapshot within `matched` (None: from 0)."""
        best = None
        for node in path:
            if node.end <= matched and node.snapshot and self.usable(node.end):
                best = node
        return best

    def usable(self, position: int) -> bool:
        return True

    def points(self, r: RequestView) -> list[SnapshotPoint]:
        raise NotImplementedError


class FullAttention(Placement):
    """An all-full-attention model: every cached token is a hit; no states."""

    name = "(d) all full attention"
    hybrid = False

    def points(self, r: RequestView) -> list[SnapshotPoint]:
        return []


class RadixkvPlacement(Placement):
    """radixkv's `SnapshotPolicy`: divergence, chunk ends as the budget allows, finished ends."""

    name = "(a) radixkv"

    def __init__(self, policy: SnapshotPolicy, chunk: int) -> None:
        self.policy, self.chunk = policy, chunk

    def points(self, r: RequestView) -> list[SnapshotPoint]:
        chunk_ends = range(r.hit + self.chunk, r.num_prompt_tokens, self.chunk)
        points = list(
            self.policy.prefill_points(
                resume=r.hit,
                divergence=r.matched,
                num_prompt_tokens=r.num_prompt_tokens,
                chunk_ends=chunk_ends,
            )
        )
        last = points[-1].position if points else r.hit
        end = self.policy.finish_point(last_point=last, num_written=r.num_written)
        return points + ([end] if end is not None else [])


class GridPlacement(Placement):
    """vLLM's: states kept on its block grid only, at every boundary a request passes, so a hit
    resumes at a multiple of the block (528 tokens for Qwen3.5)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.name = f"(b) vLLM ({block}-token grid)"

    def usable(self, position: int) -> bool:
        return position % self.block == 0

    def points(self, r: RequestView) -> list[SnapshotPoint]:
        first = (r.hit // self.block + 1) * self.block
        return [
            SnapshotPoint(p, True, "chunk") for p in range(first, r.num_written + 1, self.block)
        ]


class PerNodePlacement(Placement):
    """SGLang's: a state with every node a request inserts: each prefill chunk's end, the prompt's
    end, the finished request's end; least recently used first."""

    name = "(c) SGLang (per inserted node)"

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk

    def points(self, r: RequestView) -> list[SnapshotPoint]:
        ends = [*range(r.hit + self.chunk, r.num_prompt_tokens, self.chunk), r.num_prompt_tokens]
        if r.num_written > r.num_prompt_tokens:
            ends.append(r.num_written)
        return [SnapshotPoint(p, True, "chunk") for p in ends]


# ----------------------------------------------------------------------------------------------
# The driver


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    num_requests: int
    num_prompt_tokens: int
    served: int  # prompt tokens served from the cache (the hits)
    served_short: int  # of prompts under `short_prompt` tokens
    prompt_tokens_short: int
    snapshot_budget: int  # bytes
    peak_snapshot_bytes: int
    num_taken: int
    num_evicted: int
    num_refused: int
    num_hits: int  # requests that resumed from a snapshot


@dataclass(frozen=True, slots=True)
class Request:
    tokens: np.ndarray  # prompt then reply
    num_prompt_tokens: int


def simulate(
    requests: Sequence[Request],
    placement: Placement,
    *,
    total_bytes: int,
    snapshot_budget: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    short_prompt: int = 1000,
    supersede: bool = False,
    eviction: str = "lru",
    check_every: int = 0,
) -> SimResult:
    """Serve `requests` in order from a cache of `total_bytes`: `snapshot_budget` of them for
    snapshots, the rest for KV. `supersede` and `eviction` ("gdsf" or "lru"): the snapshots'
    eviction order (radixkv's: superseded ones first, then GDSF)."""
    if not placement.hybrid:
        snapshot_budget = 0
    kv_tokens = (total_bytes - snapshot_budget) // kv_bytes_per_token
    ledger = SnapshotLedger(snapshot_budget, snapshot_bytes, eviction)  # type: ignore[arg-type]
    tree = SimTree(dead_first=placement.hybrid, ledger=ledger if supersede else None)
    served = served_short = prompt_short = peak = 0
    for tick, request in enumerate(requests, start=1):
        n_prompt = request.num_prompt_tokens
        written = request.tokens[:-1]  # the last sampled token has no KV or state yet
        path, matched = tree.match(request.tokens[: n_prompt - 1])
        if placement.hybrid:
            node = placement.resume(path, matched)
            hit = 0 if node is None else node.end
            if node is not None:
                ledger.touch(node.node_id, tick, hit=True)
        else:
            hit = matched
        served += hit
        if n_prompt < short_prompt:
            served_short += hit
            prompt_short += n_prompt
        view = RequestView(n_prompt, len(written), matched, hit)
        points = placement.points(view)
        at = tree.insert(written, [p.position for p in points], tick)
        for point in points:
            _take(tree, ledger, at[point.position], tick, point.required)
        peak = max(peak, len(ledger) * snapshot_bytes)
        for gone in tree.evict_to(kv_tokens):
            if gone.snapshot:  # no tiers here: a snapshot without its KV is dropped with it
                ledger.drop(gone.node_id)
        if check_every and tick % check_every == 0:
            tree.check_integrity()
            ledger.check_integrity()
            held = {n.node_id: n for n in tree.nodes.values() if n.snapshot}
            assert set(ledger.keys()) == set(held), "snapshots on the tree != in the ledger"
            for key, node in held.items():
                assert ledger.is_superseded(key) == (supersede and tree.superseded(node)), key
    stats = ledger.stats()
    return SimResult(
        policy=placement.name,
        num_requests=len(requests),
        num_prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        served=served,
        served_short=served_short,
        prompt_tokens_short=prompt_short,
        snapshot_budget=snapshot_budget,
        peak_snapshot_bytes=peak,
        num_taken=stats.num_taken,
        num_evicted=stats.num_evicted,
        num_refused=stats.num_refused,
        num_hits=stats.num_hits,
    )


def _take(tree: SimTree, ledger: SnapshotLedger, node: Node, tick: int, required: bool) -> None:
    if node.snapshot:
        ledger.touch(node.node_id, tick)
        return
    evicted = ledger.take(node.node_id, tick, required=required)
    if evicted is None:
        return
    tree.set_snapshot(node, True)
    for key in evicted:
        tree.set_snapshot(tree.nodes[key], False)


def working_set_tokens(requests: Sequence[Request]) -> int:
    """Distinct written tokens of the trace: what a cache without eviction would hold."""
    tree = SimTree(dead_first=False)
    for tick, request in enumerate(requests, start=1):
        tree.insert(request.tokens[:-1], [], tick)
    return tree.num_tokens
