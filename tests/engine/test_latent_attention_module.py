"""radixkv's latent attention modules against transformers' own MLA attention, module by module.

Each family's attention module of the installed transformers is built from a tiny random config
(fp32, num_key_value_heads = num_attention_heads), run on a causal mask as transformers runs it,
then swapped for its paged class and run over a paged latent cache: the first tokens in one
call, the rest in a second call that reads the first call's latents from the cache. Both calls'
outputs together must equal transformers' output for the whole sequence, in each form
(absorbed, expanded) and at block sizes 1 / 16 / 64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_archs import YARN
from transformers import AutoConfig

from radixkv import kernels
from radixkv.engine.model.model_loader import ModelLoadError
from radixkv.engine.step.latent_attention import (
    FAMILY_SPECS,
    LatentCacheSpec,
    LatentLayers,
    PagedLatentAttention,
    _module,
    swap_latent_modules,
    unswap_latent_modules,
)
from radixkv.kernels import AttentionMetadata, LatentPart, LatentStep, latent_cache_shape

SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# test id: (model type, config fields over SIZES)
FAMILIES = {
    "deepseek_v2": ("deepseek_v2", dict(q_lora_rank=None)),
    "deepseek_v2-yarn": ("deepseek_v2", dict(q_lora_rank=24, rope_parameters=YARN)),
    "deepseek_v3": ("deepseek_v3", dict(q_lora_rank=24)),
    "deepseek_v3-yarn-half": (
        "deepseek_v3",
        dict(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN),
    ),
    "glm4_moe_lite": ("glm4_moe_lite", dict(q_lora_rank=24)),
    "mistral4": (
        "mistral4",
        dict(q_lora_rank=24, rope_parameters={**YARN, "llama_4_scaling_beta": 0.1}),
    ),
    "minicpm3": ("minicpm3", dict(q_lora_rank=24)),
    "longcat_flash": ("longcat_flash", dict(q_lora_rank=24, head_dim=8)),  # its rope width
    "kimi_linear": ("kimi_linear", dict(q_lora_rank=None)),
    "axk1": ("axk1", dict(q_lora_rank=24)),
    "youtu": ("youtu", dict(q_lora_rank=24)),
}
NUM_TOKENS, PREFIX = 21, 13


def _attention(model_type: str, fields: dict) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """transformers' attention module of the family (layer 0, random weights, eager) and its
    rotary embedding (None for NoPE)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SIZES, **fields)
    config._attn_implementation = "eager"
    module = _module(model_type)
    attention = getattr(module, FAMILY_SPECS[model_type][0])(config, layer_idx=0).eval()
    for p in attention.parameters():  # wider than the default init: outputs far from zero
        torch.nn.init.normal_(p, std=0.2)
    rotary = None
    rotary_name = next((n for n in dir(module) if n.endswith("RotaryEmbedding")), None)
    if rotary_name is not None and model_type != "kimi_linear":
        rotary = getattr(module, rotary_name)(config)
    return attention, rotary


def _transformers_output(attention, rotary, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    kwargs = {} if rotary is None else {"position_embeddings": rotary(x, positions)}
    with torch.no_grad():
        out, _ = attention(hidden_states=x, attention_mask=mask, position_ids=positions, **kwargs)
    return out


def _paged_calls(attention, rotary, x, block_size: int, absorbed: bool | None) -> torch.Tensor:
    """The paged module over [0, PREFIX) in one call, then [PREFIX, NUM_TOKENS) over the cache.
    absorbed None: the plan's choice (by multiply-adds, as on a GPU)."""
    dims = attention.latent_dims
    spec = LatentCacheSpec(1, dims.latent_dim, block_size, torch.float32)
    num_blocks = 2 * (-(-NUM_TOKENS // block_size)) + 1
    cache = spec.allocate(num_blocks, "cpu")[0].fill_(float("nan"))  # unwritten slots poison
    gen = torch.Generator().manual_seed(1)
    table = torch.randperm(num_blocks, generator=gen)[: -(-NUM_TOKENS // block_size)]
    outs = []
    for start, end in ((0, PREFIX), (PREFIX, NUM_TOKENS)):
        pos = torch.arange(start, end)
        slots = table[pos // block_size] * block_size + pos % block_size
        metadata = AttentionMetadata(
            table.to(torch.int32)[None],
            torch.tensor([end], dtype=torch.int32),
            torch.tensor([0, end - start], dtype=torch.int32),
            latent_cache_shape(cache),
            slot_mapping=slots,
        )
        if absorbed is None:
            step = kernels.plan_latent_step(metadata, dims, merge_cost=0)
        else:
            step = LatentStep(metadata, (LatentPart(absorbed, slice(0, end - start), metadata),))
        part = x[:, start:end]
        kwargs = {} if rotary is None else {"position_embeddings": rotary(part, pos[None])}
        with torch.no_grad():
            out, _ = attention(
                hidden_states=part,
                attention_mask=None,
                position_ids=pos[None],
                radixkv_cache=LatentLayers([cache], step),
                **kwargs,
            )
        outs.append(out)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_latent_attention_equals_transformers(family, absorbed, block_size):
    model_type, fields = FAMILIES[family]
    attention, rotary = _attention(model_type, fields)
    x = torch.randn(1, NUM_TOKENS, SIZES["hidden_size"], generator=torch.Generator().manual_seed(2))
    expected = _transformers_output(attention, rotary, x)
    assert swap_latent_modules(attention) is not None
    assert isinstance(attention, PagedLatentAttention)
    actual = _paged_calls(attention, rotary, x, block_size, absorbed)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_the_plan_mixes_forms_in_one_module_call():
    # By multiply-adds the 13-token prefill is expanded and the 8-token extend over it absorbed.
    attention, rotary = _attention("deepseek_v3", FAMILIES["deepseek_v3"][1])
    x = torch.randn(1, NUM_TOKENS, SIZES["hidden_size"], generator=torch.Generator().manual_seed(3))
    expected = _transformers_output(attention, rotary, x)
    swap_latent_modules(attention)
    dims = attention.latent_dims
    assert not dims.prefers_absorbed(PREFIX, PREFIX, 0)
    assert dims.prefers_absorbed(NUM_TOKENS - PREFIX, NUM_TOKENS, 0)
    torch.testing.assert_close(_paged_calls(attention, rotary, x, 16, None), expected)


@pytest.mark.interpreter
def test_the_triton_kernels_behind_the_module():
    attention, rotary = _attention("deepseek_v3", FAMILIES["deepseek_v3"][1])
    x = torch.randn(1, NUM_TOKENS, SIZES["hidden_size"], generator=torch.Generator().manual_seed(4))
    expected = _transformers_output(attention, rotary, x)
    swap_latent_modules(attention)
    with kernels.use_backend("triton"):
        for absorbed in (True, False):
            actual = _paged_calls(attention, rotary, x, 16, absorbed)
            torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)


def test_the_swap_keeps_weights_and_undoes_cleanly():
    attention, rotary = _attention("deepseek_v3", FAMILIES["deepseek_v3"][1])
    plain_class = type(attention)
    state = copy.deepcopy(attention.state_dict())
    x = torch.randn(1, 5, SIZES["hidden_size"])
    before = _transformers_output(attention, rotary, x)
    dims = swap_latent_modules(attention)
    assert dims == kernels.LatentDims(4, 32, 8, 16, 12)
    # W_UK / W_UV are views of kv_b_proj's weight: no second copy of it
    weight = attention.kv_b_proj.weight
    for view in (attention.w_uk, attention.w_uv):
        assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert attention.w_uk.shape == (4, 16, 32) and attention.w_uv.shape == (4, 12, 32)
    torch.testing.assert_close(attention.w_uv[1], weight[28 + 16 : 28 + 28])
    assert swap_latent_modules(attention) == dims  # swapping twice is swapping once
    unswap_latent_modules(attention)
    assert type(attention) is plain_class and not hasattr(attention, "w_uk")
    assert all(torch.equal(v, state[k]) for k, v in attention.state_dict().items())
    torch.testing.assert_close(_transformers_output(attention, rotary, x), before)


def test_a_model_without_latent_layers_is_left_alone(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("gqa"))
    classes = [type(m) for m in model.modules()]
    assert swap_latent_modules(model) is None
    assert [type(m) for m in model.modules()] == classes


def test_sparse_attention_is_refused_in_one_line():
    config = AutoConfig.for_model("deepseek_v32", **SIZES, q_lora_rank=24)
    attention = _module("deepseek_v32").DeepseekV32Attention(config, layer_idx=0)
    with pytest.raises(ModelLoadError, match="deepseek_v32: DeepSeek sparse attention") as info:
        swap_latent_modules(torch.nn.ModuleList([attention]))
    assert "\n" not in str(info.value)
    assert type(attention).__name__ == "DeepseekV32Attention"


def test_outside_the_runner_it_says_so():
    attention, rotary = _attention("minicpm3", FAMILIES["minicpm3"][1])
    swap_latent_modules(attention)
    x = torch.randn(1, 3, SIZES["hidden_size"])
    with pytest.raises(RuntimeError, match="only inside the radixkv model runner"):
        attention(hidden_states=x, position_embeddings=rotary(x, torch.arange(3)[None]))
