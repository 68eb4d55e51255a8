"""A new kind of KV cache group plugs in by its own module and a registry entry alone.

The test-only `last_tokens_group.LastTokensGroup` (each request keeps the blocks of its last W
tokens, nothing outlives the request) is registered in place of the window group
(`GROUP_KINDS["window"]`); a tiny Gemma-3-like model (3 window-8 layers, 1 full) then runs with
its window layers' KV in that group through the scheduler (one block table and plan per group),
the runner (the group's own tensors, sized by the kind's rule) and the tier movers (the budgets
split between the groups), with no file above `radixkv/cache` changed: greedy output equals
transformers', every block of the new group comes back, and a prompt seen before resumes at
its start (the group keeps nothing for it), while the tree's group still offloads to the host
tier and saves to disk.
"""

from __future__ import annotations

import random

import pytest
from group_sim import GroupSim
from last_tokens_group import LastTokensGroup, LastTokensKind
from tiny_archs import WINDOW, build_arch, greedy_tokens
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.cache.grouped import GroupedCache
from radixkv.cache.kinds import GROUP_KINDS
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.window import WindowSpec


@pytest.fixture
def last_tokens(monkeypatch):
    monkeypatch.setitem(GROUP_KINDS, WindowSpec.kind, LastTokensKind())


def test_a_registered_kind_runs_through_the_scheduler_runner_and_tiers(
    last_tokens, tmp_path_factory
):
    path = build_arch("gemma3", tmp_path_factory.mktemp("gemma3"))
    prompts = random_prompts(7, 5, shared_prefix=2 * WINDOW, min_len=WINDOW, max_len=4 * WINDOW)
    max_new = [6] * len(prompts)
    expected = greedy_tokens(path, prompts, max_new)
    settings = dict(block_size=4, num_blocks=48, chunked_prefill_size=16, max_num_seqs=2)
    disk = tmp_path_factory.mktemp("kv")
    llm = LLM(str(path), **settings, host_cache_bytes=2**20, kv_cache_dir=str(disk))
    group = llm.cache.groups[1]
    assert isinstance(group, LastTokensGroup) and group.window == WINDOW
    assert [kv.layers for kv in llm.runner.kv] == [(3,), (0, 1, 2)]
    assert llm.runner.kv[1].num_blocks == group.num_blocks == 2 * (-(-(WINDOW + 16) // 4) + 2)
    params = [SamplingParams(max_tokens=n) for n in max_new]
    for _ in range(2):  # the second round: the same prompts, each resumed at its start
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
        llm.check_integrity()
    assert all(o.stats.num_cached_tokens == 0 for o in outs)
    assert group.pool.num_free == group.num_blocks, "every block of the new group came back"
    full_io, group_io = llm.tier_ios
    assert group_io is not None and group_io.host.num_blocks == full_io.host.num_blocks
    assert full_io.totals["offload"].num_blocks > 0
    llm.save_kv_cache()
    assert full_io.disk is not None and full_io.disk.num_files > 0


@pytest.mark.parametrize("seed", range(4))
def test_every_read_of_the_new_group_finds_its_kv(seed):
    """The grouped cache over the tree's group and the new one, against the simulated KV of
    `group_sim`: every query finds the last W tokens' KV in the new group's blocks, and the
    hit is where both groups resume (the prompt's start)."""
    rng = random.Random(seed)
    B, W = rng.choice([1, 4]), rng.choice([3, 8])
    group = LastTokensGroup(3 * (W // B + 2) + 64 // B, B, W)
    cache = GroupedCache([PrefixCache(200 // B + 8, B), group])
    sim = GroupSim(cache)
    stems = [[rng.randrange(30) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    for _ in range(15):
        tokens = rng.choice(stems) + [rng.randrange(30) for _ in range(rng.randrange(1, 20))]
        assert sim.serve(rng, tokens, rng.randrange(1, len(tokens) + 1), rng.choice([1, 5])) <= 0
        assert group.pool.num_free == group.num_blocks
