"""Latent attention under the tree: a tiny DeepSeek V3 (`tiny_archs`) through the whole engine.

Its layers keep one latent vector a token (`kv_lora_rank + qk_rope_head_dim` values) in the
tree's group's blocks; the fidelity matrix of every latent family is `test_architectures.py`'s.
Here: a step's requests split between the two attention forms (a prefill chunk expanded beside
an absorbed decode or extend) with `n` > 1 choices, the cache's bytes per token, the latent
blocks through the host and disk tiers and a restart, what /stats says of them, and the
layouts a latent group refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_archs import ARCHITECTURES, build_arch, build_config, greedy_tokens, tiny_model
from tiny_llama import random_prompts
from transformers import LlamaConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
from transformers.models.llama.modeling_llama import LlamaAttention

from radixkv import LLM, ModelLoadError, SamplingParams
from radixkv.cache.events import BlockStored
from radixkv.chat.cli import stats_text
from radixkv.engine import EngineConfig
from radixkv.engine.step.latent_attention import PagedLatentAttention
from radixkv.engine.step.model_runner import ModelRunner
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
    # W_UK / W_UV stay views of kv_b_proj's weight, which keeps its row-major layout on a CPU
    # (the other linears go column-major): no second copy of it, and the expanded kernel takes it
    for module in llm.model.modules():
        if isinstance(module, PagedLatentAttention):
            weight = module.kv_b_proj.weight
            assert weight.is_contiguous() and module.w_uk.data_ptr() == weight.data_ptr()
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
    events: list = []
    first = LLM(path, **settings, kv_events=events.append)
    (tiers,) = first.tier_ios
    assert tiers is not None and tiers.host.num_blocks == 8
    assert tuple(tiers.host.data.shape) == (8, NUM_LAYERS, 1, 4, 1, LATENT_DIM)  # one part
    for _ in range(2):
        assert run(first) == expected
    stats = first.cache.stats()
    assert stats.num_host_hit_tokens > 0 and stats.num_disk_hit_tokens > 0
    # KV events of the latent blocks, as of any model's: one group, each tier named; replayed,
    # the host tier's events leave what it holds
    stored = {(e.medium, e.group_idx) for e in events if isinstance(e, BlockStored)}
    assert {(None, 0), ("CPU", 0)} <= stored and {g for _, g in stored} == {0}
    held: set[int] = set()
    for e in events:
        if getattr(e, "medium", None) == "CPU":
            (held.update if isinstance(e, BlockStored) else held.difference_update)(e.block_hashes)
    assert held == set(first.cache.groups[0].tiers.entries)
    assert tiers.totals["load"].nbytes == tiers.totals["load"].num_blocks * bytes_per_block
    (fingerprint,) = tmp_path.rglob("fingerprint.json")
    assert json.loads(fingerprint.read_text())["block_layout"] == HOST_BLOCK_LAYOUTS["latent"]
    first.save_kv_cache()
    del first
    restarted = LLM(path, **settings)
    assert run(restarted) == expected
    assert restarted.cache.stats().num_disk_hit_tokens > 0


def _v3_with_layer_1(attention: Callable[[Any], torch.nn.Module]) -> torch.nn.Module:
    """A two-layer tiny DeepSeek V3 whose layer 1 attends with `attention(its config)`."""
    model_type, fields = ARCHITECTURES["deepseek-v3"]
    model = tiny_model(build_config(model_type, **{**fields, "num_hidden_layers": 2}))
    model.model.layers[1].self_attn = attention(model.config)
    return model


def _llama_attention(config: Any) -> torch.nn.Module:
    """Llama's attention with DeepSeek's RoPE width as its head size (the rotary tables fit):
    it stores K and V."""
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.hidden_size // config.qk_rope_head_dim,
        num_key_value_heads=2,
        head_dim=config.qk_rope_head_dim,
    )
    attention = LlamaAttention(llama, layer_idx=1)
    attention.config = config  # the model's: the attention implementation the runner sets
    return attention


def _narrower_latent(config: Any) -> torch.nn.Module:
    return DeepseekV3Attention(replace_config(config, kv_lora_rank=64), layer_idx=1)


def replace_config(config: Any, **fields: Any) -> Any:
    return type(config)(**{**config.to_dict(), **fields})


@pytest.mark.parametrize(
    ("attention", "reason"),
    [
        (_llama_attention, r"full-attention layers \[1\] keep keys and values beside latent"),
        (_narrower_latent, "latent layers of different sizes"),
    ],
)
def test_layers_that_do_not_share_the_latent_layout_are_refused(attention, reason):
    """One KV layout a cache group: a full layer keeping K and V beside latent layers, or latent
    layers of two sizes, is refused at load in one line."""
    model = _v3_with_layer_1(attention)
    with pytest.raises(ModelLoadError, match=reason) as caught:
        ModelRunner(model, EngineConfig(block_size=4, num_blocks=16))
    assert "\n" not in str(caught.value)
