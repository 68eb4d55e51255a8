"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own per app.

Request-level counters and latency histograms are updated on the asyncio side as updates arrive;
block, queue and preemption figures come from the engine thread's latest `EngineSnapshot`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.cache import hit_rate
from radixkv.engine.outputs import RequestOutput
from radixkv.serve.engine_snapshot import EngineSnapshot
from radixkv.serve.protocol import APIError
from radixkv.serve.served_model import KVPool
from radixkv.serve.vllm_metrics import CacheInfo, vllm_families

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Request outcomes: the engine's finish reasons, plus refusals answered before the engine saw them
# (bad_request: any 4xx; overloaded: 503, the queue was full; shutdown: 503, the server was
# shutting down) and errors (any other 5xx, engine faults included).
OUTCOMES = ("stop", "length", "abort", "error", "bad_request", "overloaded", "shutdown")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Sub-millisecond resolution where the server's own work (goal: under 2 ms) is measured.
_FINE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, *_LATENCY_BUCKETS[1:])


class ServerMetrics:
    """Counters and histograms of one server; `render()` gives the Prometheus text format."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        queue_depth: Callable[[], int],
        cache_info: CacheInfo,
        kv_pools: Sequence[KVPool] = (),
    ):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixkv_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export every outcome from the start, at 0
        self.prompt_tokens = Counter(
            "radixkv_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.cached_tokens = Counter(
            "radixkv_cached_tokens",
            "Prompt tokens served by the prefix cache",
            registry=self.registry,
        )
        # vllm-router's cache_aware and kv_aware render each request on every worker: work a
        # replica does for requests another replica may serve.
        self.renders = Counter(
            "radixkv_render_requests",
            "Render calls (/v1/chat/completions/render, /v1/completions/render)",
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "radixkv_generated_tokens",
            "Tokens generated (counted as each step's tokens reach the server)",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "radixkv_time_to_first_token_seconds",
            "HTTP request in -> first token out of the engine",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "radixkv_inter_token_latency_seconds",
            "Time between two tokens of one request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.receive = Histogram(
            "radixkv_request_receive_seconds",
            "HTTP headers in -> whole request body in (the client's sending time)",
            buckets=_FINE_BUCKETS,
            registry=self.registry,
        )
        self.overhead = Histogram(
            "radixkv_server_overhead_seconds",
            "HTTP request (headers and body) in -> handed to the engine thread (parse, chat "
            "template, tokenize)",
            buckets=_FINE_BUCKETS,
            registry=self.registry,
        )
        self.admission = Histogram(
            "radixkv_admission_seconds",
            "HTTP request (headers and body) in -> queued in the engine (waits for the current "
            "step to end)",
            buckets=_FINE_BUCKETS,
            registry=self.registry,
        )
        # Totals behind the hit-rate gauge and the live page (prometheus_client counters have
        # no public getter); read-only outside this class.
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_generated_tokens = 0
        self.registry.register(
            _EngineCollector(snapshot, queue_depth, self, cache_info, tuple(kv_pools))
        )

    def record_finished(self, output: RequestOutput, outcome: str) -> None:
        stats = output.stats
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.cached_tokens.inc(stats.num_cached_tokens)
        self.num_prompt_tokens += stats.num_prompt_tokens
        self.num_cached_tokens += stats.num_cached_tokens

    def record_generated(self, num_tokens: int) -> None:
        """Tokens a step brought one request: counted as they come, as vLLM does, so that a
        rate of them moves while replies stream (not in bursts as they finish)."""
        self.generated_tokens.inc(num_tokens)
        self.num_generated_tokens += num_tokens

    def record_refusal(self, exc: APIError) -> None:
        """Count an error answer (a refusal, or a failure of the server or engine)."""
        if exc.status_code < 500:
            outcome = "bad_request"
        elif exc.type == "server_overloaded":
            outcome = "overloaded"
        elif exc.type == "server_shutting_down":
            outcome = "shutdown"
        else:
            outcome = "error"
        self.requests.labels(outcome).inc()

    def hit_rate(self) -> float:
        return hit_rate(self.num_cached_tokens, self.num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _snapshot_families(snap: EngineSnapshot) -> Iterator[Metric]:
    """A hybrid model's recurrent-state snapshots (zeros for a model without recurrent layers)."""
    yield GaugeMetricFamily(
        "radixkv_state_snapshots", "Recurrent-state snapshots held", value=snap.num_snapshots
    )
    yield GaugeMetricFamily(
        "radixkv_state_snapshot_bytes",
        "Bytes of the recurrent-state snapshots held",
        value=snap.num_snapshot_bytes,
    )
    yield CounterMetricFamily(
        "radixkv_state_snapshot_hits",
        "Requests that resumed from a recurrent-state snapshot",
        value=snap.num_snapshot_hits,
    )
    yield CounterMetricFamily(
        "radixkv_state_snapshot_hit_tokens",
        "Prompt tokens those requests resumed past",
        value=snap.num_snapshot_hit_tokens,
    )


class _EngineCollector:
    """Exports the engine thread's latest snapshot at scrape time, under radixkv's names and
    vLLM's (`vllm_metrics`), from one read of each figure."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        queue_depth: Callable[[], int],
        metrics: ServerMetrics,
        cache_info: CacheInfo,
        kv_pools: tuple[KVPool, ...],
    ) -> None:
        self._snapshot = snapshot
        self._queue_depth = queue_depth
        self._metrics = metrics
        self._cache_info = cache_info
        self._kv_pools = kv_pools

    def collect(self) -> Iterator[Metric]:
        snap, queue_depth = self._snapshot(), self._queue_depth()
        blocks = GaugeMetricFamily(
            "radixkv_blocks", "KV blocks of the tree's cache group by state", labels=["state"]
        )
        blocks.add_metric(["free"], snap.num_free_blocks)
        blocks.add_metric(["evictable"], snap.num_evictable_blocks)
        blocks.add_metric(["in_use"], snap.num_in_use_blocks)
        yield blocks
        yield from _pool_families(self._kv_pools)
        yield GaugeMetricFamily(
            "radixkv_queue_depth", "Requests waiting for admission", value=queue_depth
        )
        yield GaugeMetricFamily(
            "radixkv_running_requests", "Requests admitted and running", value=snap.num_running
        )
        yield GaugeMetricFamily(
            "radixkv_cache_hit_rate",
            "Prompt tokens served by the cache / prompt tokens, finished requests",
            value=self._metrics.hit_rate(),
        )
        yield CounterMetricFamily(
            "radixkv_evicted_blocks", "KV blocks evicted", value=snap.num_evicted_blocks
        )
        hits = CounterMetricFamily(
            "radixkv_cache_hit_tokens", "Prompt tokens served by each tier", labels=["tier"]
        )
        for tier, n in snap.hit_tokens_by_tier.items():
            hits.add_metric([tier], n)
        yield hits
        moved = CounterMetricFamily(
            "radixkv_tier_moved_bytes", "KV bytes moved between tiers", labels=["move"]
        )
        seconds = CounterMetricFamily(
            "radixkv_tier_move_seconds", "Time spent moving KV between tiers", labels=["move"]
        )
        for move, (nbytes, s) in snap.tier_moves.items():
            moved.add_metric([move], nbytes)
            seconds.add_metric([move], s)
        yield moved
        yield seconds
        yield CounterMetricFamily(
            "radixkv_preemptions", "Requests preempted (by recompute)", value=snap.num_preemptions
        )
        yield from _snapshot_families(snap)
        yield from vllm_families(self._cache_info, snap, queue_depth, self._metrics)


def _pool_families(pools: tuple[KVPool, ...]) -> Iterator[Metric]:
    """Each KV cache group's pool: its blocks and what one holds (a latent model's blocks are
    one MLA vector a token and layer, several times smaller than keys and values)."""
    labels = ["group", "layout"]
    size = GaugeMetricFamily(
        "radixkv_kv_pool_blocks", "Device KV blocks of each cache group's pool", labels=labels
    )
    nbytes = GaugeMetricFamily(
        "radixkv_kv_block_bytes",
        "Bytes of one KV block over its group's layers (layout: kv, keys and values; latent, "
        "one multi-head latent attention vector a token)",
        labels=labels,
    )
    for pool in pools:
        size.add_metric([pool.group, pool.layout], pool.num_blocks)
        nbytes.add_metric([pool.group, pool.layout], pool.bytes_per_block)
    yield size
    yield nbytes
