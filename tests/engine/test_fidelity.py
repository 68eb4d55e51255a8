"""Engine greedy output == plain transformers greedy output, token for token.

Tiny random Llama models (GQA and MHA); the engine runs with the prefix cache on and off, with
block sizes 1 / 4 / 16, under eviction pressure (a KV pool a few times smaller than the workload,
so requests are evicted / preempted and recomputed) and with small prefill chunks.
"""

from __future__ import annotations

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

# name: LLM keyword arguments
VARIANTS = {
    "cache-b16": dict(block_size=16, num_blocks=256),
    "cache-b4": dict(block_size=4, num_blocks=512),
    "cache-b1": dict(block_size=1, num_blocks=2048),
    "no-cache": dict(block_size=4, num_blocks=512, enable_prefix_cache=False),
    # ~6 requests x <= 62 tokens = up to ~100 blocks of 4 live at once; 24 forces eviction and
    # preemption by recompute.
    "eviction": dict(block_size=4, num_blocks=24, max_num_seqs=4),
    "chunked": dict(block_size=4, num_blocks=512, chunked_prefill_size=5, max_num_batched_tokens=8),
    # Requests admitted while others decode (4 seats for 6): steps that prefill and do not decode.
    "prefill-first": dict(block_size=4, num_blocks=512, max_num_seqs=4, prefill_first=True),
    # Device pools small enough to evict, a host tier that takes what they evict, loaded back in
    # the second round; "disk": a host tier of 8 blocks spilling to the disk tier.
    "tiers-b1": dict(block_size=1, num_blocks=96, max_num_seqs=4, host_cache_bytes=2**20),
    "tiers-b4": dict(block_size=4, num_blocks=24, max_num_seqs=4, host_cache_bytes=2**20),
    "tiers-b16": dict(block_size=16, num_blocks=8, max_num_seqs=3, host_cache_bytes=2**20),
    "tiers-write-through": dict(
        block_size=4,
        num_blocks=24,
        max_num_seqs=4,
        host_cache_bytes=2**20,
        host_cache_write_through=True,
    ),
    "tiers-disk-chunked": dict(
        block_size=4,
        num_blocks=24,
        max_num_seqs=4,
        host_cache_bytes=8 * 1536,  # 8 blocks of the larger (MHA) model
        kv_cache_dir="<tmp>",
        chunked_prefill_size=5,
        max_num_batched_tokens=8,
    ),
}
# The same with overlapped steps: tier moves run while the previous step is in flight.
VARIANTS["tiers-b4-overlapped"] = {**VARIANTS["tiers-b4"], "async_scheduling": True}
VARIANTS["tiers-disk-chunked-overlapped"] = {
    **VARIANTS["tiers-disk-chunked"],
    "async_scheduling": True,
}


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(seed, 4, shared_prefix=12, max_len=30)
    prompts += random_prompts(seed + 1, 2, max_len=40)
    max_new = [6 + (3 * i) % 16 for i in range(len(prompts))]
    return prompts, max_new


@pytest.mark.parametrize("kind", ["gqa", "mha"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_transformers(kind, variant, tiny_model_dir, reference_generate, tmp_path):
    settings = VARIANTS[variant]
    if "kv_cache_dir" in settings:
        settings = {**settings, "kv_cache_dir": tmp_path}
    llm = LLM(str(tiny_model_dir(kind)), **settings)
    prompts, max_new = _workload(seed=11)
    expected = reference_generate(kind, prompts, max_new)
    params = [SamplingParams(max_tokens=n) for n in max_new]

    first = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in first] == expected
    # Again: now (with the cache on) mostly served from the cache, still the same tokens.
    second = llm.generate(prompts, params)
    assert [list(o.token_ids) for o in second] == expected

    for out, prompt, n in zip(second, prompts, max_new, strict=True):
        assert out.prompt_token_ids == tuple(prompt)
        assert out.stats.num_prompt_tokens == len(prompt)
        assert out.stats.num_output_tokens == len(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == 2 else "length")
        assert out.finish_reason == "stop" or len(out.token_ids) == n
        assert 0 <= out.stats.num_cached_tokens <= len(prompt) - 1
    stats = llm.cache.stats()
    if variant == "eviction" or variant.startswith("tiers"):
        assert stats.num_evicted_blocks > 0
    if variant.startswith("tiers"):  # the second round was served from the lower tiers too
        assert stats.num_host_hit_tokens + stats.num_disk_hit_tokens > 0
    if "disk" in variant:
        assert stats.num_disk_writes > 0 and stats.num_disk_hit_tokens > 0
    if variant == "no-cache":
        assert all(o.stats.num_cached_tokens == 0 for o in first + second)
    elif variant != "eviction" and not variant.startswith("tiers"):
        # The whole prompt bar its last token was cached by the first round.
        assert [o.stats.num_cached_tokens for o in second] == [len(p) - 1 for p in prompts]
    assert not llm.scheduler.has_unfinished()
    llm.cache.check_integrity()


@pytest.mark.parametrize("disk", [False, True])
def test_tiers_with_blocks_of_64_load_back_whole_blocks(
    disk, tiny_model_dir, reference_generate, tmp_path
):
    """Blocks of 64, a device pool of 3 (one request at a time): each conversation's prefix is
    evicted by the next and loaded back from the host (or, with a host of 1 block, from disk)."""
    tiers = dict(host_cache_bytes=49152, kv_cache_dir=tmp_path) if disk else {}
    llm = LLM(
        str(tiny_model_dir("gqa")),
        block_size=64,
        num_blocks=3,
        max_num_seqs=1,
        **(tiers or dict(host_cache_bytes=2**20)),
    )
    prompts = [p for seed in (1, 2, 3) for p in random_prompts(seed, 1, shared_prefix=70)]
    expected = reference_generate("gqa", prompts, [8] * 3)
    params = SamplingParams(max_tokens=8)
    for _ in range(2):
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
    assert all(o.stats.num_cached_tokens >= 64 for o in outs)
    stats = llm.cache.stats()  # the first two were evicted by the third, loaded from below
    assert (stats.num_disk_hit_tokens if disk else stats.num_host_hit_tokens) >= 2 * 64
    llm.cache.check_integrity()


def test_shared_prefix_requests_hit(tiny_model_dir, reference_generate):
    llm = LLM(str(tiny_model_dir("gqa")), block_size=16, num_blocks=128)
    prompts = random_prompts(5, 5, shared_prefix=40, max_len=20)
    max_new = [8] * len(prompts)
    params = SamplingParams(max_tokens=8)
    (warm,) = llm.generate([prompts[0]], params)
    assert warm.stats.num_cached_tokens == 0
    outs = llm.generate(prompts[1:], params)
    # Token-granular matching: the 40-token shared prefix (not a multiple of 16) is fully served.
    for out in outs:
        assert out.stats.num_cached_tokens >= 40
    expected = reference_generate("gqa", prompts, max_new)
    assert [list(o.token_ids) for o in [warm, *outs]] == expected
    assert llm.cache.stats().num_hit_tokens >= 4 * 40
    llm.cache.check_integrity()


def test_streaming_matches_generate(tiny_model_dir, reference_generate):
    llm = LLM(str(tiny_model_dir("mha")), block_size=4, num_blocks=256)
    (prompt,) = random_prompts(3, 1, max_len=25)
    expected = reference_generate("mha", [prompt], [12])[0]
    deltas = list(llm.stream(prompt, SamplingParams(max_tokens=12)))
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
    out = deltas[-1].output
    assert [t for d in deltas for t in d.token_ids] == list(out.token_ids) == expected
    assert "".join(d.text for d in deltas) == out.text == llm.decode(expected)
    assert out.stats.ttft_s > 0 and out.stats.total_s >= out.stats.ttft_s


def test_abandoned_stream_is_aborted(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("mha")), block_size=4, num_blocks=256)
    (prompt,) = random_prompts(4, 1, max_len=25)
    stream = llm.stream(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.scheduler.has_unfinished()
    llm.cache.check_integrity()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=3))
    assert len(out.token_ids) == 3


def test_accepts_a_loaded_model_and_tokenizer(tiny_model_dir, reference_generate):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("gqa")
    model = AutoModelForCausalLM.from_pretrained(path)
    llm = LLM(model, tokenizer=AutoTokenizer.from_pretrained(path), block_size=8, num_blocks=64)
    assert model.config._attn_implementation == "radixkv"
    prompts = random_prompts(13, 2, max_len=20)
    outs = llm.generate([llm.decode(p) for p in prompts], SamplingParams(max_tokens=6))
    assert [list(o.prompt_token_ids) for o in outs] == prompts  # word tokens round-trip
    assert [list(o.token_ids) for o in outs] == reference_generate("gqa", prompts, [6, 6])
    assert outs[0].text == llm.decode(outs[0].token_ids)
