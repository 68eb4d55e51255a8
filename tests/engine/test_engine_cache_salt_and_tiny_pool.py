"""Tenant isolation through the engine (`cache_salt`), and a pool that fits one request alone."""

from __future__ import annotations

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, RequestUpdate, SamplingParams


def run_one(llm: LLM, prompt: list[int], params: SamplingParams, **kw: object) -> RequestUpdate:
    rid = llm.add_request(prompt, params, **kw)
    last = None
    while llm.has_unfinished_requests():
        for u in llm.step():
            assert u.request_id == rid and u.error is None
            last = u
        llm.scheduler.check_integrity()
    assert last is not None and last.output is not None
    assert llm.cache.stats().num_in_use_blocks == 0
    return last


def test_different_salts_share_nothing_and_equal_salts_share(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=64)
    prompt = random_prompts(7, 1, min_len=18, max_len=18)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = run_one(llm, prompt, params, cache_salt="alice").output
    assert first.stats.num_cached_tokens == 0
    for salt in ("bob", None):  # another tenant, or the shared namespace: nothing cached
        out = run_one(llm, prompt, params, cache_salt=salt).output
        assert out.stats.num_cached_tokens == 0 and out.token_ids == first.token_ids
    again = run_one(llm, prompt, params, cache_salt="alice").output
    assert again.stats.num_cached_tokens == len(prompt) - 1  # the last token is always computed
    assert again.token_ids == first.token_ids
    shared = run_one(llm, prompt, params).output  # no salt: shares with the earlier no-salt run
    assert shared.stats.num_cached_tokens == len(prompt) - 1
    llm.cache.check_integrity()


def test_generate_and_stream_take_a_salt(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=64)
    prompt = random_prompts(9, 1, min_len=18, max_len=18)[0]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    (first,) = llm.generate([prompt], params, cache_salt="alice")
    (other,) = llm.generate([prompt], params, cache_salt="bob")
    assert first.stats.num_cached_tokens == other.stats.num_cached_tokens == 0
    last = list(llm.stream(prompt, params, cache_salt="alice"))[-1].output
    assert last is not None and last.stats.num_cached_tokens == len(prompt) - 1
    assert last.token_ids == other.token_ids == first.token_ids
    for bad in (b"alice", 7):  # refused with nothing queued, through either door
        with pytest.raises(TypeError, match="cache_salt"):
            llm.generate([prompt], params, cache_salt=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="cache_salt"):
            llm.stream(prompt, params, cache_salt=bad)  # type: ignore[arg-type]
    assert not llm.has_unfinished_requests()
    assert llm.cache.stats().num_in_use_blocks == 0
    llm.check_integrity()


def test_a_partial_hit_in_a_pool_that_fits_the_request_alone_completes(tiny_model_dir) -> None:
    """Block 4, 12 blocks, chunks of 5: the request hits mid-block inside a cached node, then
    generates up to the pool's last slot (issue 11, F2)."""
    llm = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=12, chunked_prefill_size=5)
    big = LLM(str(tiny_model_dir("gqa")), block_size=4, num_blocks=256, chunked_prefill_size=5)
    shared = random_prompts(8, 1, min_len=22, max_len=22)[0]
    run_one(llm, [*shared, 9, 9, 9], SamplingParams(max_tokens=1, ignore_eos=True))
    prompt = [*shared, 7, 7, 7]
    params = SamplingParams(max_tokens=12 * 4 + 1 - len(prompt), ignore_eos=True)
    out = run_one(llm, prompt, params).output
    assert out.stats.num_cached_tokens == 22
    assert out.token_ids == run_one(big, prompt, params).output.token_ids
    assert len(out.token_ids) == params.max_tokens
