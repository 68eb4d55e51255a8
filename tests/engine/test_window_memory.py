"""A model with sliding-window layers: what a running request holds follows the window.

The tiny Gemma-3-like model of `tiny_archs` (3 window-8 layers, 1 full layer); its greedy output
against transformers is `test_architectures`' matrix. Here: the window layers' blocks a request
holds stay about W / B + chunk / B however long it grows, its full blocks grow with it; the
window pool has a tensor of its own, sized by `num_window_blocks`; KV events name both groups;
what the engine refuses.
"""

from __future__ import annotations

import pytest
from router_index import BlockHashIndex
from tiny_archs import WINDOW, build_arch
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache.events import BlockStored
from radixkv.cache.keys import chain_hashes
from radixkv.cache.window import first_live_index, window_budget

B, CHUNK = 4, 16
SETTINGS = dict(block_size=B, num_blocks=256, chunked_prefill_size=CHUNK)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return str(build_arch("gemma3", tmp_path_factory.mktemp("gemma3")))


@pytest.mark.parametrize("cache", [True, False])
def test_a_running_request_holds_its_window_not_its_length(gemma3, cache):
    llm = LLM(gemma3, **SETTINGS, enable_prefix_cache=cache)
    (prompt,) = random_prompts(31, 1, min_len=20 * WINDOW, max_len=20 * WINDOW)
    llm.add_request(prompt, SamplingParams(max_tokens=24))
    window, pool = llm.cache.groups[1], llm.cache.groups[1].pool
    peak_window = peak_full = 0
    while llm.has_unfinished_requests():
        llm.step()
        for req in llm.scheduler.running_requests:
            peak_window = max(peak_window, req.table.tables[1].num_live_blocks)
            peak_full = max(peak_full, len(req.table.tables[0].blocks))
            if not cache:  # nothing but the running table holds window blocks
                assert pool.num_blocks - pool.num_free == req.table.tables[1].num_live_blocks
        llm.check_integrity()
    assert peak_window <= window_budget(WINDOW, B, CHUNK) == 8
    assert peak_full == -(-(len(prompt) + 23) // B) == 46
    assert (window.num_tails > 0) == cache


def test_window_layers_have_a_smaller_tensor_of_their_own(gemma3):
    llm = LLM(gemma3, **SETTINGS, max_num_seqs=2)
    runner = llm.runner
    default = 2 * 2 * window_budget(WINDOW, B, CHUNK)
    assert runner.kv[1].num_blocks == default
    assert tuple(runner.kv[0].k_cache.shape) == (1, 256, B, 2, 16)  # the full layer
    assert tuple(runner.kv[1].k_cache.shape) == (3, default, B, 2, 16)
    assert [k.data_ptr() for k, _ in runner.layer_kv] == [
        runner.kv[1].k_cache[0].data_ptr(),
        runner.kv[1].k_cache[1].data_ptr(),
        runner.kv[1].k_cache[2].data_ptr(),
        runner.kv[0].k_cache[0].data_ptr(),
    ]
    assert LLM(gemma3, **SETTINGS, num_window_blocks=9).runner.kv[1].num_blocks == 9


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(num_window_blocks=7), "num_window_blocks=7 holds not one request's window"),
    ],
)
def test_what_a_window_model_refuses(gemma3, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(gemma3, **SETTINGS, **settings)


def test_a_byte_budget_is_split_between_the_pools(gemma3):
    """The default window pool takes at most half of `kv_cache_bytes`; the full pool the rest."""
    budget = 2**20
    runner = LLM(gemma3, block_size=B, chunked_prefill_size=CHUNK, kv_cache_bytes=budget).runner
    full, window = 2 * runner.kv[0].k_cache.nbytes, 2 * runner.kv[1].k_cache.nbytes
    full_block = 2 * runner.kv[0].k_cache[:, 0].nbytes
    assert window_budget(WINDOW, B, CHUNK) < runner.kv[1].num_blocks
    assert window <= budget // 2 and budget - full_block < full + window <= budget


def test_kv_events_name_both_groups_and_change_no_token(gemma3):
    """Full blocks as group 0, the window tails' full blocks as group 1 (with the window), one
    queue drained after each step; greedy output is what the engine gives without events."""
    events: list = []
    settings = dict(SETTINGS, num_blocks=40, num_window_blocks=24)
    llm = LLM(gemma3, **settings, kv_events=events.append)
    plain = LLM(gemma3, **settings)
    prompts = random_prompts(5, 6, shared_prefix=3 * WINDOW, min_len=WINDOW, max_len=3 * WINDOW)
    params = SamplingParams(max_tokens=6)
    for prompt in [*prompts, *prompts[:3]]:  # the repeats resume at the kept tails
        (out,) = llm.generate([prompt], params)
        assert out.token_ids == plain.generate([prompt], params)[0].token_ids
        llm.check_integrity()
    index = BlockHashIndex()  # strict, per group
    for event in events:
        index.apply(event)
    cache = llm.cache
    kept = set()
    for _, prefix in cache.groups[1].tail_prefixes():
        end = len(prefix) // 4
        kept.update(
            chain_hashes(None, prefix[: 4 * (end // B * B)], B)[first_live_index(end, WINDOW, B) :]
        )
    assert index.window_hashes == kept and kept
    for prompt in prompts:
        held = cache.tree.match(prompt).num_cached_tokens // B
        assert index.longest_prefix_blocks(prompt, B) == held
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert {(e.group_idx, e.sliding_window) for e in stored} == {(0, None), (1, WINDOW)}
    assert cache.groups[1].num_evicted_tails > 0 and llm.cache.stats().num_evicted_blocks > 0
