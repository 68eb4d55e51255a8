"""Latent attention under the tree: a tiny DeepSeek V3 (`tiny_archs`) through the whole engine.

Its layers keep one latent vector a token (`kv_lora_rank + qk_rope_head_dim` values) in the
tree's group's blocks; the fidelity matrix of every latent family is `test_architectures.py`'s.
Here: a step's requests split between the two attention forms (a prefill chunk expanded beside
an absorbed decode or extend) with `n` > 1 choices, the cache's bytes per token, the latent
blocks through the host and disk tiers and a restart, and what /stats says of them.
"""

from __future__ import annotations

import json

import pytest
from tiny_archs import build_arch, greedy_tokens
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.chat.cli import stats_text
from radixkv.engine.tiers.kv_fingerprint import HOST_BLOCK_LAYOUTS

PROMPTS = random_prompts(31, 4, shared_prefix=20, min_len=4, max_len=12)
PROMPTS += random_prompts(32, 2, min_len=30, max_len=40)
MAX_NEW = [4 + i % 3 for i in range(len(PROMPTS))]
LATENT_DIM = 96 + 8  # kv_lora_rank + qk_rope_head_dim of tiny_archs' MLA models
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = build_arch("deepseek-v3", tmp_path_factory.mktemp("deepseek-v3"))
    return str(path), greedy_tokens(path, PROMPTS, MAX_NEW)


def run(llm: LLM, n: int = 1) -> list[list[int]]:
    outs = llm.generate(PROMPTS, [SamplingParams(n=n, max_tokens=m) for m in MAX_NEW])
    llm.check_integrity()
    return [list(o.token_ids) for o in outs]


def test_a_step_mixes_the_forms_and_n_choices_are_each_greedy(deepseek_v3):
    """Chunks of 5 under a budget of 8 tokens: prefill chunks from position 0 attend expanded,
    later chunks and the decodes beside them absorbed (the CPU's cost rule), in one step;
    every one of 2 choices a prompt equals transformers' greedy tokens, cold and warm."""
    path, expected = deepseek_v3
    llm = LLM(path, block_size=4, num_blocks=256, chunked_prefill_size=5, max_num_batched_tokens=8)
    (plan,) = llm.runner.step_plans
    forms: set[tuple[bool, ...]] = set()

    def recording_plan(metadata, host_block_tables):
        step = plan(metadata, host_block_tables)
        forms.add(tuple(part.absorbed for part in step.parts))
        return step

    llm.runner.step_plans = (recording_plan,)
    for _ in range(2):
        assert run(llm, n=2) == [tokens for tokens in expected for _ in range(2)]
    assert {(False,), (True,)} <= forms  # steps of one form
    assert forms & {(True, False), (False, True), (True, False, True)}  # and of both
    assert llm.cache.stats().num_in_use_blocks == 0


def test_a_token_costs_one_latent_vector_a_layer(deepseek_v3):
    path, _ = deepseek_v3
    llm = LLM(path, block_size=16, num_blocks=64)
    layout = llm.runner.layout
    assert layout.latent_layers == tuple(range(NUM_LAYERS))
    assert layout.latent is not None and layout.latent.latent_dim == LATENT_DIM
    assert layout.describe() == f"{NUM_LAYERS} full (latent {LATENT_DIM}) layers"
    (kv,) = llm.runner.kv
    assert kv.layout == "latent" and kv.label == "full latent"
    assert tuple(kv.k_cache.shape) == (NUM_LAYERS, 64, 16, 1, LATENT_DIM)
    # fp32: exactly the latent's floor, (L + R) x layers x 4 bytes a token
    assert kv.bytes_per_block == 16 * LATENT_DIM * NUM_LAYERS * 4
    # each layer reads its own tensor: views, no copies
    caches = [views[0] for views in llm.runner.layer_kv]
    assert [c.shape for c in caches] == [(64, 16, LATENT_DIM)] * NUM_LAYERS
    assert [c.data_ptr() for c in caches] == [kv.k_cache[i].data_ptr() for i in range(NUM_LAYERS)]
    line = f"KV blocks     full latent: 64 blocks of {kv.bytes_per_block / 1024:.1f} KiB (4 layers)"
    assert line in stats_text(llm).splitlines()


def test_latent_blocks_through_the_host_and_disk_tiers_and_a_restart(deepseek_v3, tmp_path):
    """A device pool of 24 blocks of 4 under 6 prompts of up to 46 tokens: every round evicts the
    last one's prefixes into a host tier of 8 blocks and the rest to disk; greedy output equals
    transformers' with hits from both, and after a restart over the folder."""
    path, expected = deepseek_v3
    device = dict(block_size=4, num_blocks=24, max_num_seqs=2, chunked_prefill_size=16)
    bytes_per_block = 4 * LATENT_DIM * NUM_LAYERS * 4
    settings = dict(device, host_cache_bytes=8 * bytes_per_block, kv_cache_dir=tmp_path)
    first = LLM(path, **settings)
    (tiers,) = first.tier_ios
    assert tiers is not None and tiers.host.num_blocks == 8
    assert tuple(tiers.host.data.shape) == (8, NUM_LAYERS, 1, 4, 1, LATENT_DIM)  # one part
    for _ in range(2):
        assert run(first) == expected
    stats = first.cache.stats()
    assert stats.num_host_hit_tokens > 0 and stats.num_disk_hit_tokens > 0
    assert tiers.totals["load"].nbytes == tiers.totals["load"].num_blocks * bytes_per_block
    (fingerprint,) = tmp_path.rglob("fingerprint.json")
    assert json.loads(fingerprint.read_text())["block_layout"] == HOST_BLOCK_LAYOUTS["latent"]
    first.save_kv_cache()
    del first
    restarted = LLM(path, **settings)
    assert run(restarted) == expected
    assert restarted.cache.stats().num_disk_hit_tokens > 0
