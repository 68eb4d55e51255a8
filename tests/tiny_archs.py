"""Tiny randomly initialised models of every architecture the README lists as supported.

Each is a config of transformers' own class with the sizes of `tiny_llama` (vocab 256, hidden 64,
word-level tokenizer), and where the architecture has them: sliding windows of WINDOW tokens (so
the tests' prompts are several windows long), Gemma's query_pre_attn_scalar set apart from the
head size and Gemma 2's logit soft-cap low enough to bind, GPT-OSS's sinks drawn at random
(transformers initialises them to zero), multi-head latent attention whose latent is wide
enough that both attention forms run (`LATENT`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_llama import EOS_ID, VOCAB_SIZE, build_tokenizer, random_prompts

WINDOW = 8
_SIZES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # wider than the default: greedy choices are not float-noise ties
    bos_token_id=1,
    eos_token_id=EOS_ID,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=64)  # scale 1/8, not head_dim ** -0.5 = 1/4
_ALTERNATING = ["sliding_attention", "full_attention"] * 2
# Multi-head latent attention (MLA): every head's keys and values from one latent of
# kv_lora_rank values, wide against the heads' parts (qk_nope 16 + v 12) as in DeepSeek V3
# (512 against 128 + 128), so that by the CPU's cost rule too prefills from position 0 attend
# expanded and extends over a cached prefix absorbed (`LatentDims.prefers_absorbed`).
_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=96,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
)
_MLA_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1
)
# DeepSeek V3's routing: 8 experts in 2 groups, the top-1 group's top-2 experts; layer 0 dense.
_V3_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
)
# YaRN past 8 positions, and Mistral 4's query scale past them (the tests' prompts reach ~45).
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

# test id: (model_type, config fields over _SIZES)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-window": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    ),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3-moe": ("qwen3_moe", dict(head_dim=16, **_MOE)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "mixtral-window": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    ),
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": (
        "gemma2",
        dict(sliding_window=WINDOW, attn_logit_softcapping=1.0, layer_types=_ALTERNATING, **_GEMMA),
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            **_GEMMA,
        ),
    ),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "olmo3-window": ("olmo3", dict(sliding_window=WINDOW)),
    "granite": ("granite", {}),
    "cohere2-window": ("cohere2", dict(sliding_window=WINDOW)),
    "starcoder2-window": ("starcoder2", dict(sliding_window=WINDOW)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=4, n_head=4, n_positions=512)),
    "gpt-neox": ("gpt_neox", {}),  # its config carries num_key_value_heads=2; it has 4
    "gpt-bigcode": ("gpt_bigcode", dict(n_embd=64, n_layer=4, n_head=4, n_positions=512)),
    "gpt-oss": (
        "gpt_oss",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=_ALTERNATING,
        ),
    ),
    "phi": ("phi", {}),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    # Further decoders of transformers that fit the same hooks.
    "olmo": ("olmo", {}),
    "cohere": ("cohere", {}),
    "gpt-j": ("gptj", dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=512)),
    "codegen": ("codegen", dict(n_embd=64, n_layer=4, n_head=4, rotary_dim=8, n_positions=512)),
    "opt": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "persimmon": ("persimmon", {}),
    "ernie4.5": ("ernie4_5", dict(head_dim=16)),
    "apertus": ("apertus", {}),
    "bitnet": ("bitnet", {}),
    "seed-oss": ("seed_oss", dict(head_dim=16)),
    "arcee": ("arcee", {}),
    "qwen2-moe": ("qwen2_moe", dict(shared_expert_intermediate_size=32, **_MOE)),
    "glm": ("glm", dict(head_dim=16)),
    "glm4": ("glm4", dict(head_dim=16)),
    "glm4-moe": (
        "glm4_moe",
        dict(
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
        ),
    ),
    "smollm3": ("smollm3", {}),
    "helium": ("helium", dict(head_dim=16)),
    "hunyuan-dense": ("hunyuan_v1_dense", dict(head_dim=16)),
    "granite-moe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
    "exaone4-window": ("exaone4", dict(sliding_window=WINDOW)),
    "ministral-window": ("ministral", dict(sliding_window=WINDOW, head_dim=16)),
    "ministral3-window": ("ministral3", dict(sliding_window=WINDOW, head_dim=16)),
    "vaultgemma-window": ("vaultgemma", dict(sliding_window=WINDOW, head_dim=16)),
    "afmoe-window": ("afmoe", dict(sliding_window=WINDOW)),
    # Multi-head latent attention over the paged latent cache.
    "deepseek-v2": (
        "deepseek_v2",
        dict(_MLA, q_lora_rank=None, first_k_dense_replace=1, **_MLA_MOE),
    ),
    "deepseek-v3": ("deepseek_v3", dict(_MLA, **_V3_MOE)),
    "sarvam-mla": ("sarvam_mla", dict(_MLA, **_V3_MOE)),  # DeepSeek V3's classes
    "glm4-moe-lite": ("glm4_moe_lite", dict(_MLA, n_group=1, topk_group=1, **_MLA_MOE)),
    "mistral4": (
        "mistral4",
        dict(
            _MLA,
            architectures=["Mistral4ForCausalLM"],  # not among AutoModelForCausalLM's
            rope_parameters={**YARN, "llama_4_scaling_beta": 0.1},
            **_MLA_MOE,
        ),
    ),
    "minicpm3": ("minicpm3", dict(_MLA)),
    "longcat-flash": (  # two attention modules a decoder layer; head_dim is the RoPE width
        "longcat_flash",
        dict(
            _MLA,
            head_dim=8,
            n_routed_experts=4,
            moe_topk=2,
            expert_ffn_hidden_size=32,
            ffn_hidden_size=64,
            zero_expert_num=1,
        ),
    ),
    "axk1": ("axk1", dict(_MLA, n_group=1, topk_group=1, **_MLA_MOE)),
    "youtu": ("youtu", dict(_MLA)),
}
# Hybrid models: recurrent layers (Gated DeltaNet, KDA, Mamba-2, short convolutions) beside full
# (or latent) attention, which resume only where the state group kept a snapshot
# (`test_hybrid_models`), so they stay out of ARCHITECTURES' matrix, whose warm round expects a
# hit at every prompt.
_GDN = dict(
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"] * 2,
)
_GDN_MOE = dict(_GDN, **_MOE, shared_expert_intermediate_size=32)
# Mamba-2 mixers: heads x head_dim == expand x hidden (8 x 16 == 2 x 64)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_n_groups=2)
_MAMBA2 |= dict(mamba_d_state=8, mamba_chunk_size=16)
HYBRIDS: dict[str, tuple[str, dict]] = {
    "qwen3_5": ("qwen3_5_text", _GDN),
    "qwen3_5_moe": ("qwen3_5_moe_text", _GDN_MOE),
    # (its shared expert wider than Qwen3.5-MoE's: with _GDN_MOE's weights the first prompt's
    # first token is a tie within 6e-6 between two logits, which float noise breaks either way)
    "qwen3_next": ("qwen3_next", dict(_GDN_MOE, shared_expert_intermediate_size=48)),
    "olmo_hybrid": ("olmo_hybrid", dict(_GDN, linear_allow_neg_eigval=True)),
    "lfm2": ("lfm2", dict(conv_L_cache=3, layer_types=["conv", "full_attention"] * 2)),
    "bamba": ("bamba", dict(_MAMBA2, attn_layer_indices=[1, 3])),
    "granite-4.0-h": (
        "granitemoehybrid",
        dict(_MAMBA2, layer_types=["mamba", "attention"] * 2),
    ),
    "falcon_h1": ("falcon_h1", dict(_MAMBA2, mamba_d_ssm=128)),  # attention beside each mixer
    "nemotron_h": (  # mamba / moe / attention / mlp layers
        "nemotron_h",
        dict(mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=16),
    ),
    "kimi_linear": (  # Kimi Delta Attention / latent attention (NoPE MLA), MoE past layer 0
        "kimi_linear",
        dict(
            _MLA,
            q_lora_rank=None,
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
        ),
    ),
    "jamba": (  # Mamba-1 mixers, attention on layers 1 and 3
        "jamba",
        dict(
            mamba_expand=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
            attn_layer_offset=1,
            attn_layer_period=2,
            num_experts=1,
        ),
    ),
}
# Models of recurrent layers alone: no KV, the tree's group holds token ids only.
HYBRIDS["mamba2"] = (
    "mamba2",
    dict(num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=8, chunk_size=16),
)
HYBRIDS["mamba"] = ("mamba", dict(expand=2, state_size=8, time_step_rank=4))
# LFM2-MoE (dense layer 0, then experts) and LFM3 (short convolutions, window and full layers)
HYBRIDS["lfm2_moe"] = (
    "lfm2_moe",
    dict(conv_L_cache=3, layer_types=["conv", "full_attention"] * 2, num_dense_layers=1, **_MOE),
)
HYBRIDS["lfm3"] = (
    "lfm3",
    dict(
        conv_L_cache=3,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["conv", "sliding_attention", "conv", "full_attention"],
    ),
)
# Zamba 2: Mamba-2 mixers in every layer, one attention block shared by the hybrid layers (its
# module's layer_idx is -1: the layer comes from the cache call), with per-layer adapters, RoPE
# (and as many KV heads as query heads: transformers' K/V adapters are as wide as the queries).
HYBRIDS["zamba2"] = (
    "zamba2",
    dict(
        num_key_value_heads=4,
        layers_block_type=["hybrid", "mamba"] * 2,
        n_mamba_heads=8,
        mamba_headdim=16,
        mamba_expand=2,
        mamba_ngroups=2,
        mamba_d_state=8,
        chunk_size=16,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
    ),
)
LATENT = (
    "deepseek-v2",
    "deepseek-v3",
    "sarvam-mla",
    "glm4-moe-lite",
    "mistral4",
    "minicpm3",
    "longcat-flash",
    "axk1",
    "youtu",
)


# Traffic that takes a window model's KV through its lower tiers: 6 prompts of 30-44 tokens (8-11
# blocks of 4) over a device pool of 24 full and 12 window blocks, so that every round evicts
# the prefixes and window tails of the one before.
WINDOW_TIER_PROMPTS = random_prompts(41, 4, shared_prefix=3 * WINDOW, min_len=6, max_len=20)
WINDOW_TIER_PROMPTS += random_prompts(42, 2, min_len=4 * WINDOW, max_len=5 * WINDOW)
WINDOW_TIER_DEVICE = dict(
    block_size=4, num_blocks=24, num_window_blocks=12, max_num_seqs=2, chunked_prefill_size=16
)


def build_config(model_type: str, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**_SIZES, **fields})


def causal_lm_class(config):
    """AutoModelForCausalLM, or the class the config's `architectures` names for a type the auto
    class does not map (Mistral 4)."""
    import transformers
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    return getattr(transformers, config.architectures[0])


def tiny_model(config, seed: int = 0):
    """A random model of `config`, its sinks (if any) drawn at random."""
    torch.manual_seed(seed)
    cls = causal_lm_class(config)
    model = (cls.from_config(config) if hasattr(cls, "from_config") else cls(config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".sinks"):
                param.normal_(0.0, 1.0)
    return model


def save_tiny_model(config, path: Path, seed: int = 0) -> Path:
    """A random model of `config` (`tiny_model`) and the word-level tokenizer, saved into
    `path`."""
    tiny_model(config, seed).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def arch_config(arch: str):
    model_type, fields = ARCHITECTURES[arch] if arch in ARCHITECTURES else HYBRIDS[arch]
    return build_config(model_type, **fields)


def build_arch(arch: str, path: Path) -> Path:
    return save_tiny_model(arch_config(arch), path)


def greedy_tokens(
    path: Path, prompts: list[list[int]], max_new: list[int], device: str = "cpu"
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (eager attention, fp32, on `device`)."""
    from transformers import AutoConfig

    model = (
        causal_lm_class(AutoConfig.from_pretrained(path))
        .from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
        .eval()
    )
    model.to(device)
    outs = []
    for prompt, n in zip(prompts, max_new, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt], device=device),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=EOS_ID,
                pad_token_id=0,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs
