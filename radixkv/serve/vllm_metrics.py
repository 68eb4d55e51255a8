"""vLLM's names for the server's load and cache figures, exported at `GET /metrics` beside
radixkv's own, for what was written against vLLM: llm-d's inference scheduler and the Gateway
API inference extension pick a replica by `vllm:num_requests_waiting`, `vllm:num_requests_running`
and `vllm:kv_cache_usage_perc` (older releases `vllm:gpu_cache_usage_perc`) and size it by
`vllm:cache_config_info`; routers' load monitors and dashboards read the rest.

Each figure is one radixkv already keeps (the engine's snapshot, the server's token counters),
under vLLM's name, type and labels (`model_name`, `engine`); nothing is counted twice.
KV usage is vLLM's: the share of the device pool held by running requests, cached blocks no
request holds counting as free (they are capacity).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from radixkv.serve.engine_snapshot import EngineSnapshot

LABELS = ["model_name", "engine"]


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """The server's fixed labels: the model's name and what `vllm:cache_config_info` states."""

    model_name: str
    block_size: int
    enable_prefix_caching: bool


class TokenTotals(Protocol):
    """The server's token counts (`ServerMetrics`): prompt and cached tokens of finished
    requests, generated tokens as each step brings them."""

    num_prompt_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int


def vllm_families(
    info: CacheInfo, snap: EngineSnapshot, queue_depth: int, totals: TokenTotals
) -> Iterator[Metric]:
    """vLLM's families from one scrape's snapshot, queue depth and the server's token totals."""
    num_blocks = snap.num_free_blocks + snap.num_evictable_blocks + snap.num_in_use_blocks
    usage = snap.num_in_use_blocks / num_blocks if num_blocks else 0.0
    for name, value, about in (
        ("num_requests_running", snap.num_running, "Requests running."),
        ("num_requests_waiting", queue_depth, "Requests waiting for admission."),
        ("kv_cache_usage_perc", usage, "KV-cache usage. 1 means 100 percent usage."),
        ("gpu_cache_usage_perc", usage, "KV-cache usage (vLLM's older name)."),
    ):
        yield _labelled(GaugeMetricFamily(f"vllm:{name}", about, labels=LABELS), info, value)
    for name, value, about in (
        ("prefix_cache_queries", totals.num_prompt_tokens, "Prefix cache queries, in tokens."),
        ("prefix_cache_hits", totals.num_cached_tokens, "Prefix cache hits, in cached tokens."),
        ("prompt_tokens", totals.num_prompt_tokens, "Prompt tokens of finished requests."),
        ("generation_tokens", totals.num_generated_tokens, "Tokens generated."),
        ("num_preemptions", snap.num_preemptions, "Requests preempted (by recompute)."),
    ):
        yield _labelled(CounterMetricFamily(f"vllm:{name}", about, labels=LABELS), info, value)
    config = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"],
    )
    prefix = str(info.enable_prefix_caching)
    config.add_metric([str(info.block_size), str(num_blocks), prefix, "0"], 1)
    yield config


def _labelled(
    family: GaugeMetricFamily | CounterMetricFamily, info: CacheInfo, value: float
) -> Metric:
    family.add_metric([info.model_name, "0"], value)
    return family
