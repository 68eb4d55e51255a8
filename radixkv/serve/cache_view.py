"""What the live page shows, built at a bounded rate and pushed to every page open.

    engine thread                 view thread                    asyncio side
    capture(): cache.summary  ─►  _build(): previews          ─► CacheView.publish: the same
    (bounded), stats, tiers       (tree_payload), one JSON text  text to every subscriber

A snapshot is built only while a page is open, at most `MAX_UPDATES_PER_S` times a second (fewer
when the tree is so large that they would take over `MAX_ENGINE_SHARE` of the engine thread),
and only when something changed (a step ran, a request finished). The engine thread does only the
bounded tree walk; decoding and JSON run in the view's own thread: the event loop only hands
the text on. Each subscriber holds at most one pending snapshot (a slow page skips snapshots,
never slows the others).

Window layers: for a model that has them (Gemma 2/3, Mistral with a window), the snapshot adds
`window_layers`, their KV group's device pool and lower tiers (`window_payload`); `gauges`'
device, host and disk are the full layers' group. A full-attention model's snapshot has no such
key. Recurrent layers: a hybrid model's snapshot adds `state_layers` (`state_payload`: the state
slots, the snapshots held and their bytes, the hits that resumed from one, and the snapshots'
host and disk tiers), and each tree node says how many snapshots end in it (`snapshots`).

Tenants: the tree shown is the shared namespace's alone (`PrefixCache.summary`), and the last
request highlighted is the last one without a `cache_salt`: a salted tenant's tokens, nodes
and requests never reach the page. The gauges are the server's totals, as `/metrics` has them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixkv.cache.state import StateStats
from radixkv.cache.summary import TreeSummary
from radixkv.cache.window import WindowStats
from radixkv.engine.llm import LLM
from radixkv.engine.outputs import RequestOutput, hit_cut_reason
from radixkv.engine.tiers.disk_store import DiskStoreStats
from radixkv.serve.engine_handle import RequestStream
from radixkv.serve.engine_worker import tier_moves

logger = logging.getLogger(__name__)

MAX_UPDATES_PER_S = 4
MAX_NODES = 300  # nodes listed per snapshot; the rest fold into counts
MAX_SUBSCRIBERS = 16  # pages open at once; a page past it ends the longest-open stream
PREVIEW_CHARS = 48  # characters of a node's text shown
MAX_ENGINE_SHARE = 0.02  # of the engine thread's time, the most snapshots may take
REFRESH_S = 1.0  # while requests run, the longest a snapshot goes unrefreshed
RATE_WINDOW_S = 2.0  # output tokens/s is measured over about this long (see `TokenRate`)
CAPTURE_TIMEOUT_S = 5.0  # a capture not done by then (engine stopping) is dropped


@dataclass(frozen=True, slots=True)
class LastRequest:
    """The last finished request of the shared namespace."""

    tokens: tuple[int, ...]  # prompt + the reply's written tokens
    num_prompt_tokens: int
    num_cached_tokens: int
    seq: int  # counts finished shared requests
    num_matched_tokens: int = 0  # what the tree matched (more: the hit was cut back)


@dataclass(frozen=True, slots=True)
class WindowCapture:
    """What the engine thread reads of the window layers' group: the cache's figures, its disk
    store's, and its tier mover's (bytes, seconds) per kind of move, as `/metrics` sums them."""

    stats: WindowStats
    disk: DiskStoreStats | None
    moves: dict[str, tuple[int, float]]


@dataclass(frozen=True, slots=True)
class StateCapture:
    """What the engine thread reads of the recurrent-state group, as `WindowCapture` reads the
    window group."""

    stats: StateStats
    disk: DiskStoreStats | None
    moves: dict[str, tuple[int, float]]


@dataclass(frozen=True, slots=True)
class Capture:
    """What the engine thread reads for one snapshot."""

    tree: TreeSummary
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_evictable_blocks: int
    num_host_blocks: int
    num_host_cached_blocks: int
    num_offloaded_blocks: int
    num_disk_bytes: int
    disk_budget_bytes: int
    window: WindowCapture | None  # None: a model without window layers
    seconds: float  # the engine thread's time on it
    state: StateCapture | None = None  # None: a model without recurrent layers
    snapshot_nodes: dict[int, int] | None = None  # tree node id -> snapshots ending in it


def capture(llm: LLM, last: LastRequest | None) -> Capture:
    """Engine thread only: the bounded summary of the shared tree and the pool's figures."""
    t0 = time.perf_counter()
    prompt = () if last is None else last.tokens
    stats = llm.cache.stats()
    tiers = llm.tier_ios[0]
    disk = None if tiers is None else tiers.disk
    return Capture(
        tree=llm.cache.summary(max_nodes=MAX_NODES, prompt=prompt),
        num_blocks=stats.num_blocks,
        block_size=stats.block_size,
        num_free_blocks=stats.num_free_blocks,
        num_evictable_blocks=stats.num_evictable_blocks,
        num_host_blocks=stats.num_host_blocks,
        num_host_cached_blocks=stats.num_host_cached_blocks,
        num_offloaded_blocks=stats.num_offloaded_blocks,
        num_disk_bytes=0 if disk is None else disk.num_bytes,
        disk_budget_bytes=0 if disk is None else disk.budget_bytes,
        window=_window_capture(llm),
        state=_state_capture(llm),
        snapshot_nodes=llm.cache.snapshot_nodes(),
        seconds=time.perf_counter() - t0,
    )


def _window_capture(llm: LLM) -> WindowCapture | None:
    groups = llm.cache.group_stats()
    # the window group, if any, is the first after the tree's (a hybrid model's state group,
    # last, shows no window)
    if len(groups) < 2 or not isinstance(groups[1], WindowStats):
        return None
    stats, tiers = groups[1], llm.tier_ios[1]
    disk = None if tiers is None or tiers.disk is None else tiers.disk.stats()
    return WindowCapture(stats, disk, tier_moves(tiers))


def _state_capture(llm: LLM) -> StateCapture | None:
    groups = llm.cache.group_stats()
    # the state group, if any, is the last
    if not isinstance(groups[-1], StateStats):
        return None
    tiers = llm.tier_ios[-1]
    disk = None if tiers is None or tiers.disk is None else tiers.disk.stats()
    return StateCapture(groups[-1], disk, {} if tiers is None else tier_moves(tiers))


def state_payload(c: StateCapture) -> dict[str, Any]:
    """The recurrent layers' part of a snapshot: their slots (running requests' and snapshots'),
    the snapshots' bytes, the hits that resumed from one (of them, from the host or disk tier),
    and the snapshots' host and disk tiers (None: off) with what each kind of move carried."""
    s = c.stats
    host = disk = None
    if s.num_host_blocks:
        host = {
            "snapshots": s.num_host_blocks,
            "held": s.num_host_cached_blocks,
            "loaded": s.num_loaded_blocks,
            "offloaded": s.num_offloaded_blocks,
            "moves": _moves(c.moves, "load", "offload"),
        }
    if c.disk is not None:
        disk = {
            "files": c.disk.num_files,
            "bytes": c.disk.num_bytes,
            "budget": c.disk.budget_bytes,
            "read": s.num_disk_reads,
            "written": s.num_disk_writes,
            "moves": _moves(c.moves, "disk_read", "disk_write"),
        }
    device = {
        "slots": s.num_slots,
        "slot_bytes": s.slot_bytes,
        "running": s.num_running_slots,
        "snapshots": s.num_snapshots,
        "bytes": s.num_snapshot_bytes,
        "free": s.num_free_slots,
        "evicted": s.num_evicted,
    }
    hits = {"hits": s.num_hits, "tokens": s.num_hit_tokens, "lower": s.num_lower_hits}
    return {"device": device, "hits": hits, "host": host, "disk": disk}


def window_payload(w: WindowCapture) -> dict[str, Any]:
    """The window layers' part of a snapshot: their device pool (blocks in use by requests, held
    only by tails, free), and their host and disk tiers (None: off) with the window blocks hits
    loaded from each (the hits' tokens are the full group's) and the bytes each kind of move
    carried."""
    s = w.stats
    host = disk = None
    if s.num_host_blocks:
        host = {
            "blocks": s.num_host_blocks,
            "held": s.num_host_cached_blocks,
            "loaded_blocks": s.num_loaded_blocks,
            "offloaded_blocks": s.num_offloaded_blocks,
            "moves": _moves(w.moves, "load", "offload"),
        }
    if w.disk is not None:
        disk = {
            "files": w.disk.num_files,
            "bytes": w.disk.num_bytes,
            "budget": w.disk.budget_bytes,
            "read_blocks": s.num_disk_reads,
            "written_blocks": s.num_disk_writes,
            "moves": _moves(w.moves, "disk_read", "disk_write"),
        }
    device = {
        "blocks": s.num_blocks,
        "in_use": s.num_in_use_blocks,
        "tails": s.num_tail_blocks,
        "free": s.num_free_blocks,
        "num_tails": s.num_tails,
        "evicted_tails": s.num_evicted_tails,
    }
    return {"window": s.window, "device": device, "host": host, "disk": disk}


def _moves(moves: dict[str, tuple[int, float]], *kinds: str) -> dict[str, dict[str, float]]:
    return {k: {"bytes": moves[k][0], "seconds": moves[k][1]} for k in kinds}


class NodeAliases:
    """Node ids as one view shows them: numbered in the order the view first lists each node.
    The cache numbers the nodes of all namespaces in one sequence, so its own ids would tell
    how many nodes other tenants made in between.

    Invariant (`check_integrity`): aliases are distinct, each below `next_alias`."""

    def __init__(self) -> None:
        self._aliases: dict[int, int] = {}  # cache node id -> alias, for the nodes listed last
        self.next_alias = 0

    def __call__(self, node_id: int) -> int:
        alias = self._aliases.get(node_id)
        if alias is None:
            alias = self._aliases[node_id] = self.next_alias
            self.next_alias += 1
        return alias

    def __len__(self) -> int:
        """How many nodes have an alias now."""
        return len(self._aliases)

    def keep_only(self, node_ids: set[int]) -> None:
        """Forget the nodes no longer listed (one listed again later gets a new alias)."""
        self._aliases = {k: v for k, v in self._aliases.items() if k in node_ids}

    def check_integrity(self) -> None:
        values = list(self._aliases.values())
        assert len(set(values)) == len(values), "two nodes share an alias"
        assert all(0 <= v < self.next_alias for v in values), "an alias was never issued"


def tree_payload(
    tree: TreeSummary,
    decode: Callable[[Sequence[int]], str] | None,
    alias: NodeAliases,
    snapshots: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """The tree part of a snapshot: plain numbers and text (the page sets text, never HTML);
    node ids are `alias`'s, and nothing in it depends on another namespace. `snapshots`: node
    id -> the recurrent-state snapshots ending in it (a hybrid model's)."""
    recency = _recency(tree)
    snapshots = snapshots or {}
    listed = {n.node_id for n in tree.nodes}
    nodes = [
        {
            "id": alias(n.node_id),
            "parent": None if n.parent_id is None else alias(n.parent_id),
            "start": n.start,
            "end": n.end,
            "blocks": n.num_blocks,
            "shared_head": n.head_shared,
            "locks": n.lock_ref,
            "recency": recency[n.last_use],
            "host": n.num_host_blocks,
            "snapshots": snapshots.get(n.node_id, 0),
            "text": _preview(n.head_tokens, decode) if n.parent_id is not None else "",
        }
        for n in tree.nodes
    ]
    folded = [
        {
            "parent": alias(f.parent_id),
            "subtrees": f.num_subtrees,
            "nodes": f.num_nodes,
            "tokens": f.num_tokens,
            "recency": recency[f.last_use],
        }
        for f in tree.folded
    ]
    payload = {
        "nodes": nodes,
        "folded": folded,
        "num_nodes": tree.num_nodes,
        "num_tokens": tree.num_tokens,
        "path": [alias(i) for i in tree.path if i in listed],
        "path_tokens": tree.num_path_tokens,
    }
    alias.keep_only(listed)  # a long-lived page lists a bounded number of nodes, never all ever
    return payload


def _recency(tree: TreeSummary) -> dict[int, int]:
    """Last use -> how many later uses the listing shows (0: the latest). Ranks, not clock
    ticks: the cache's clock also counts other namespaces' uses, which must not show."""
    uses = {n.last_use for n in tree.nodes} | {f.last_use for f in tree.folded}
    return {use: rank for rank, use in enumerate(sorted(uses, reverse=True))}


def _preview(tokens: Sequence[int], decode: Callable[[Sequence[int]], str] | None) -> str:
    if decode is None:
        return " ".join(map(str, tokens))[:PREVIEW_CHARS]
    try:
        text = decode(tokens)
    except Exception:  # a token id the tokenizer cannot spell shows as ids
        return " ".join(map(str, tokens))[:PREVIEW_CHARS]
    return text[:PREVIEW_CHARS]


class TokenRate:
    """Output tokens per second over about the last RATE_WINDOW_S, from (time, total tokens)
    samples: one snapshot's worth (a quarter second) would swing by a token in three at a
    decode rate of a dozen a second.

    Invariant: samples in time order; the first is the only one before the window."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def __call__(self, now: float, total: int) -> float:
        """Record `total` tokens at `now` (time.monotonic()); the rate since the window's
        start (its first sample at or before it)."""
        self._samples.append((now, total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def check_integrity(self) -> None:
        times = [t for t, _ in self._samples]
        assert times == sorted(times), "samples out of order"


class CacheView:
    """The page's snapshots and their subscribers (one per app, asyncio side).

    A page that comes when MAX_SUBSCRIBERS are open ends the longest-open stream (its queue
    gets None): streams that never end would otherwise let any process that holds them all
    keep the owner's page out for good; now it must keep reopening them, and the page's own
    reconnection gets it back in.

    Invariants (`check_integrity`): at most MAX_SUBSCRIBERS subscribers, each queue holds at
    most one item; the builder task runs only while someone subscribes."""

    def __init__(self, server: Any) -> None:
        self.server = server  # the app's OpenAIServer: engine loop, metrics, stopping
        self.last: LastRequest | None = None
        # insertion order: the first is the longest open; None in a queue ends its stream
        self._subscribers: dict[asyncio.Queue[str | None], None] = {}
        self._latest: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._seen: tuple[Any, ...] | None = None  # what the latest snapshot was built from
        self._built_at = 0.0  # time.monotonic() of the latest snapshot
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-view")
        self._aliases = NodeAliases()  # the view thread's
        self._rate = TokenRate()
        self._tokens_per_s = 0.0  # the latest snapshot's
        self.num_displaced = 0  # streams ended by a newer page
        tokenizer = server.model.text.tokenizer
        self._decode = None if tokenizer is None else tokenizer.decode
        server.on_finished.append(self.record)

    # ------------------------------------------------------------------ requests

    def record(self, stream: RequestStream, output: RequestOutput) -> None:
        """A request finished: the last shared one is highlighted; salted ones are not seen."""
        if stream.cache_salt is not None:
            return
        written = output.prompt_token_ids + output.token_ids[:-1]  # the last has no KV yet
        seq = 1 if self.last is None else self.last.seq + 1
        stats = output.stats
        self.last = LastRequest(
            written, stats.num_prompt_tokens, stats.num_cached_tokens, seq, stats.num_matched_tokens
        )

    # ------------------------------------------------------------------ subscribers

    def subscribe(self) -> asyncio.Queue[str | None]:
        """A queue of snapshot texts (the latest first, if any), then None if a newer page
        displaced this one."""
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            oldest = next(iter(self._subscribers))
            del self._subscribers[oldest]
            _replace(oldest, None)
            self.num_displaced += 1
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1)
        if self._latest is not None:
            queue.put_nowait(self._latest)
        self._subscribers[queue] = None
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str | None]) -> None:
        self._subscribers.pop(queue, None)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def check_integrity(self) -> None:
        assert len(self._subscribers) <= MAX_SUBSCRIBERS, "too many subscribers"
        for queue in self._subscribers:
            assert queue.qsize() <= 1, "a subscriber holds more than one snapshot"
        if self._subscribers:
            assert self._task is not None, "subscribers but no builder"
        self._aliases.check_integrity()
        self._rate.check_integrity()

    # ------------------------------------------------------------------ building

    async def _run(self) -> None:
        while self._subscribers and not self.server.is_stopping:
            started = time.monotonic()
            period = 1.0 / MAX_UPDATES_PER_S
            try:
                engine_s = await self._update()
            except asyncio.CancelledError:
                raise
            except Exception:  # a snapshot that fails is skipped; the page keeps the last
                logger.exception("building the cache view failed")
            else:
                # A tree large enough to take the engine thread long gets fewer snapshots.
                period = max(period, engine_s / MAX_ENGINE_SHARE)
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    async def _update(self) -> float:
        """Build and publish a snapshot if something changed; returns the engine thread's time
        it took (0.0 when nothing changed)."""
        started = time.time()  # the snapshot's time: two are at least a period apart
        server = self.server
        # The engine's published counters, the last request and the totals move with every
        # change of the tree that matters here; while requests run (a prefill chunk inserts
        # without moving a counter) the view is refreshed at least every REFRESH_S anyway.
        snap = server.engine.snapshot
        metrics = server.metrics
        state = (snap, self.last, metrics.num_prompt_tokens, metrics.num_generated_tokens)
        # While requests run, and until the token rate it shows has come down to 0:
        moving = snap.num_running > 0 or self._tokens_per_s > 0
        stale = moving and time.monotonic() - self._built_at > REFRESH_S
        if state == self._seen and not stale:
            return 0.0
        last = self.last
        done = server.engine.call(capture, last)  # a module-level function: it pickles
        cap = await asyncio.wait_for(asyncio.wrap_future(done), CAPTURE_TIMEOUT_S)
        gauges = self._gauges(cap, started)
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(self._thread, self._build, cap, last, gauges)
        self._seen = state
        self._built_at = time.monotonic()
        self.publish(text)
        return cap.seconds

    def _gauges(self, cap: Capture, now: float) -> dict[str, Any]:
        """The server's counters now (asyncio side: the metrics live here)."""
        metrics, engine = self.server.metrics, self.server.engine
        snap = engine.snapshot
        self._tokens_per_s = self._rate(time.monotonic(), metrics.num_generated_tokens)
        return {
            "time": now,
            "prompt_tokens": metrics.num_prompt_tokens,
            "cached_tokens": metrics.num_cached_tokens,
            "generated_tokens": metrics.num_generated_tokens,
            "tokens_per_s": self._tokens_per_s,  # output, over about RATE_WINDOW_S
            "hit_rate": metrics.hit_rate(),
            "blocks": cap.num_blocks,
            "block_size": cap.block_size,
            "device_used": cap.num_blocks - cap.num_free_blocks,
            "device_evictable": cap.num_evictable_blocks,
            "host_blocks": cap.num_host_blocks,
            "host_used": cap.num_host_cached_blocks,
            "disk_bytes": cap.num_disk_bytes,
            "disk_budget": cap.disk_budget_bytes,
            "evicted_blocks": snap.num_evicted_blocks,
            "offloaded_blocks": cap.num_offloaded_blocks,
            "queue": engine.num_queued,
            "running": snap.num_running,
        }

    def _build(self, cap: Capture, last: LastRequest | None, gauges: dict[str, Any]) -> str:
        """View thread: the snapshot's JSON text."""
        request = None
        if last is not None:
            request = {
                "seq": last.seq,
                "prompt_tokens": last.num_prompt_tokens,
                "cached_tokens": last.num_cached_tokens,
                "matched_tokens": max(last.num_matched_tokens, last.num_cached_tokens),
                # why the tree matched more than was served (None: it did not)
                "cut_reason": hit_cut_reason(last.num_cached_tokens, last.num_matched_tokens),
            }
        body = {
            "model": self.server.config.model_name,
            "tree": tree_payload(cap.tree, self._decode, self._aliases, cap.snapshot_nodes),
            "last_request": request,
            "gauges": gauges,
            "limits": {"max_nodes": MAX_NODES, "updates_per_s": MAX_UPDATES_PER_S},
        }
        if cap.window is not None:
            body["window_layers"] = window_payload(cap.window)
        if cap.state is not None:
            body["state_layers"] = state_payload(cap.state)
        return json.dumps(body, ensure_ascii=True)

    def publish(self, text: str) -> None:
        """Hand `text` to every subscriber; one that has not taken the previous one loses it."""
        self._latest = text
        for queue in self._subscribers:
            _replace(queue, text)


def _replace(queue: asyncio.Queue[str | None], item: str | None) -> None:
    """Put `item` in a one-item queue, dropping what it held."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)
