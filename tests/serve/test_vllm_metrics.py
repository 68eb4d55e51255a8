"""`/metrics` under vLLM's names: the figures llm-d's scheduler, the Gateway API inference
extension and vLLM dashboards read, equal to radixkv's own in the same scrape."""

from __future__ import annotations

import threading

import pytest
from serve_helpers import metric, read_metrics, user_message, wait_until

pytest.importorskip("openai")  # a test extra: absent on the GPU machine

MODEL = (("engine", "0"), ("model_name", "tiny"))


def vllm(samples: dict, name: str) -> float:
    return samples[(f"vllm:{name}", MODEL)]


def test_vllm_names_carry_radixkv_figures(server) -> None:
    client = server.client()
    for i in range(3):
        messages = [{"role": "user", "content": user_message(500 + i % 2)}]
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    s = read_metrics(server.base_url)
    assert vllm(s, "prefix_cache_queries_total") == metric(s, "radixkv_prompt_tokens_total")
    assert vllm(s, "prefix_cache_hits_total") == metric(s, "radixkv_cached_tokens_total") > 0
    assert vllm(s, "prompt_tokens_total") == metric(s, "radixkv_prompt_tokens_total")
    assert vllm(s, "generation_tokens_total") == metric(s, "radixkv_generated_tokens_total")
    assert vllm(s, "num_preemptions_total") == metric(s, "radixkv_preemptions_total")
    assert vllm(s, "num_requests_waiting") == metric(s, "radixkv_queue_depth")
    assert vllm(s, "num_requests_running") == metric(s, "radixkv_running_requests") == 0
    assert vllm(s, "kv_cache_usage_perc") == vllm(s, "gpu_cache_usage_perc") == 0.0
    config = server.llm.config
    info = {
        ("block_size", str(config.block_size)),
        ("num_gpu_blocks", str(server.llm.cache.num_blocks)),
        ("enable_prefix_caching", "True"),
        ("engine", "0"),
    }
    assert s[("vllm:cache_config_info", tuple(sorted(info)))] == 1


def test_kv_usage_is_the_share_held_by_running_requests(server) -> None:
    """While a long reply streams, usage is its blocks over the pool (cached blocks no request
    holds are free capacity, as in vLLM), and it is running."""
    client = server.client()
    streaming = threading.Event()
    done = threading.Event()

    def stream() -> None:
        messages = [{"role": "user", "content": user_message(600, n=20)}]
        chunks = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in chunks:
            streaming.set()
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert streaming.wait(30)
        seen = []

        def running_scrape() -> bool:
            s = read_metrics(server.base_url)
            seen.append(s)
            return vllm(s, "num_requests_running") == 1 and not done.is_set()

        wait_until(running_scrape, what="a scrape with the reply running")
        s = seen[-1]
        blocks = [metric(s, "radixkv_blocks", state=k) for k in ("free", "evictable", "in_use")]
        assert blocks[2] > 0
        assert vllm(s, "kv_cache_usage_perc") == blocks[2] / sum(blocks)
        assert vllm(s, "num_requests_running") == metric(s, "radixkv_running_requests")
    finally:
        thread.join(60)
