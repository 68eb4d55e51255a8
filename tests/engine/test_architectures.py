"""Every architecture of the README's table: greedy output equals transformers', token for token.

Tiny random models saved by transformers (`tiny_archs`) and loaded with `LLM(path)`; the
reference is transformers' own `generate` with its eager attention (masks built by transformers,
windows included). The workload's prompts are 4-5 windows long and share a 28-token prefix, so
cache hits, chunk boundaries and blocks all fall inside, across and past windows.

The matrix covers each property without the full cross product: the architectures with windows,
soft-capping, query scaling and sinks (Mistral-window, Gemma 2, Gemma 3, GPT-OSS) and one with
latent attention (DeepSeek V3) run every engine variant (block sizes 1 / 16 / 64, cache off,
eviction pressure, chunked prefill); every other architecture runs one variant, in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_archs import (
    ARCHITECTURES,
    WINDOW,
    build_arch,
    build_config,
    greedy_tokens,
    save_tiny_model,
)
from tiny_llama import random_prompts

from radixkv import LLM, ModelLoadError, SamplingParams
from radixkv.cache.group import GroupSpec
from radixkv.cache.window import WindowSpec

# Pools of 2048 tokens at block sizes 1 / 16 / 64, with the cache on and off.
VARIANTS = {f"b{size}": dict(block_size=size, num_blocks=2048 // size) for size in (1, 16, 64)}
VARIANTS["no-cache"] = dict(VARIANTS["b16"], enable_prefix_cache=False)
# 6 requests of up to 50 tokens: ~80 blocks of 4 live at once; 24 forces eviction and preemption
# by recompute. A window model's window pool of 10 blocks (one request's needs 8 with chunks of
# 16) runs short too: its tails are evicted and running requests preempted for window blocks.
VARIANTS["eviction"] = dict(
    block_size=4, num_blocks=24, max_num_seqs=4, chunked_prefill_size=16, num_window_blocks=10
)
# Chunks of 5 tokens against windows of 8: chunk, window and block edges all disagree.
VARIANTS["chunked"] = dict(
    block_size=4, num_blocks=512, chunked_prefill_size=5, max_num_batched_tokens=8
)
EVERY_VARIANT = ("mistral-window", "gemma2", "gemma3", "gpt-oss", "deepseek-v3")
OTHERS = [arch for arch in ARCHITECTURES if arch not in EVERY_VARIANT]
CASES = [(arch, variant) for arch in EVERY_VARIANT for variant in VARIANTS]
CASES += [(arch, list(VARIANTS)[i % len(VARIANTS)]) for i, arch in enumerate(OTHERS)]


def _workload() -> tuple[list[list[int]], list[int]]:
    prompts = random_prompts(21, 4, shared_prefix=28, min_len=4, max_len=12)
    prompts += random_prompts(22, 2, min_len=4 * WINDOW, max_len=5 * WINDOW)
    return prompts, [6 + (3 * i) % 5 for i in range(len(prompts))]


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    """arch -> (folder of its tiny model, transformers' greedy tokens for the workload)."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]]]:
        if arch not in made:
            path = build_arch(arch, tmp_path_factory.mktemp(arch))
            made[arch] = (path, greedy_tokens(path, *_workload()))
        return made[arch]

    return get


@pytest.mark.parametrize(("arch", "variant"), CASES)
def test_greedy_matches_transformers(arch, variant, arch_model):
    path, expected = arch_model(arch)
    llm = LLM(str(path), **VARIANTS[variant])
    prompts, max_new = _workload()
    params = [SamplingParams(max_tokens=n) for n in max_new]
    for _ in range(2):  # cold, then (cache on) served mostly from the cache
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
        llm.check_integrity()
    stats = llm.cache.stats()
    if variant == "eviction":
        assert stats.num_evicted_blocks > 0
        if len(llm.cache.groups) > 1:  # a window group
            assert llm.cache.groups[1].num_evicted_tails > 0
    if variant == "no-cache":
        assert all(o.stats.num_cached_tokens == 0 for o in outs)
    elif variant != "eviction":
        assert [o.stats.num_cached_tokens for o in outs] == [len(p) - 1 for p in prompts]
    assert not llm.scheduler.has_unfinished()


_LAYER_TYPES = ("full_attention", "sliding_attention")
_GLOBAL_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


@pytest.mark.parametrize(
    ("arch", "change"),
    [
        ("mistral-window", dict(sliding_window=None)),
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=16)),
        ("gemma3", dict(layer_types=["full_attention"] * 4)),
        ("gemma3", dict(rope_parameters=dict.fromkeys(_LAYER_TYPES, _GLOBAL_ROPE))),
        ("gpt-oss", "zero sinks"),
    ],
)
def test_each_property_changes_the_output(arch, change, arch_model, tmp_path):
    """Without its window, soft-cap, query scale, local RoPE base or sinks, the model's greedy
    output on the workload differs: the fidelity test above would see an engine that ignored
    one."""
    path, expected = arch_model(arch)
    model_type, fields = ARCHITECTURES[arch]
    config = build_config(model_type, **{**fields, **(change if isinstance(change, dict) else {})})
    other = save_tiny_model(config, tmp_path)
    if change == "zero sinks":  # the same weights with the sinks at transformers' zeros
        from safetensors.torch import load_file, save_file

        weights = load_file(path / "model.safetensors")
        save_file(
            {k: v * 0 if k.endswith(".sinks") else v for k, v in weights.items()},
            other / "model.safetensors",
            metadata={"format": "pt"},
        )
    assert greedy_tokens(other, *_workload()) != expected


# ------------------------------------------------------------------- what the runner reads


def test_kv_heads_come_from_the_attention_not_the_config(arch_model):
    """GPT-NeoX's config carries num_key_value_heads=2; its attention has 4 KV heads."""
    path, _ = arch_model("gpt-neox")
    llm = LLM(str(path), block_size=4, num_blocks=64)
    assert llm.model.config.num_key_value_heads == 2
    layout = llm.runner.layout
    assert (layout.num_q_heads, layout.num_kv_heads, layout.head_dim) == (4, 4, 16)
    assert tuple(llm.runner.kv[0].k_cache.shape) == (4, 64, 4, 4, 16)


def test_a_window_is_not_the_context(arch_model):
    path, _ = arch_model("mistral-window")
    llm = LLM(str(path), block_size=4, num_blocks=64)
    assert llm.config.max_model_len == 512  # max_position_embeddings, not sliding_window (8)
    assert [k.window for k in llm.runner.layout.layers] == [WINDOW] * 4
    (prompt,) = random_prompts(30, 1, min_len=12 * WINDOW, max_len=12 * WINDOW)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=4))
    assert list(out.token_ids) == greedy_tokens(path, [prompt], [4])[0]


def test_layout_of_gemma2_and_gpt_oss(arch_model):
    gemma2 = LLM(str(arch_model("gemma2")[0]), block_size=4, num_blocks=64).runner.layout
    assert [(k.window, k.softcap) for k in gemma2.layers] == [(WINDOW, 1.0), (None, 1.0)] * 2
    groups = [(g.spec, g.layers) for g in gemma2.cache_groups()]
    assert groups == [(GroupSpec(), (1, 3)), (WindowSpec(WINDOW), (0, 2))]
    assert gemma2.describe() == f"2 full + 2 window-{WINDOW} layers"
    llm = LLM(str(arch_model("gpt-oss")[0]), block_size=4, num_blocks=64)
    attention = [m for m in llm.model.modules() if hasattr(m, "sinks")]
    layers = llm.runner.layout.layers
    assert len(attention) == len(layers) == 4
    assert all(k.sinks is m.sinks for k, m in zip(layers, attention, strict=True))
    assert all(k.sinks.abs().sum() > 0 for k in layers)


@pytest.mark.parametrize(
    ("model_type", "fields", "reason"),
    [
        ("falcon", {}, "do not attend through transformers' attention interface"),
        ("bloom", {}, "do not attend through transformers' attention interface"),
        ("llama4_text", {}, "chunked_attention layers"),
        (
            "deepseek_v32",  # its indexer picks the positions each query attends to
            dict(
                num_key_value_heads=4,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_group=1,
                topk_group=1,
            ),
            "deepseek_v32: DeepSeek sparse attention",
        ),
        ("gemma3_text", dict(head_dim=16, use_bidirectional_attention=True), "not causal"),
        ("stablelm", {}, "does not pass the forward's keywords on"),
        ("nemotron", {}, "does not pass the forward's keywords on"),
        ("phimoe", dict(sliding_window=WINDOW), "sets sliding_window=8 but no layer passes"),
    ],
)
def test_unsupported_architectures_are_refused_in_one_line(model_type, fields, reason, tmp_path):
    path = save_tiny_model(build_config(model_type, **fields), tmp_path)
    with pytest.raises(ModelLoadError, match=reason) as caught:
        LLM(str(path), block_size=4, num_blocks=64)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"cannot run model {str(path)!r}")
