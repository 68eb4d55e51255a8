"""The CPU's weight layout: linears stored column-major with their values unchanged, a tied
output head given its own copy, kept linears left as they are."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from radixkv.engine.step.cpu_weights import use_column_major_linears


def _model(dtype: torch.dtype, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def test_linears_turn_column_major_and_compute_the_same() -> None:
    model = _model(torch.float32, tied=True)
    ids = torch.tensor([[3, 5, 7, 11]])
    with torch.no_grad():
        before = model(ids).logits
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = model.model.layers[0].self_attn.o_proj
    changed = use_column_major_linears(model, keep=[kept])
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert changed == len(linears) - 1  # all but the kept one, the tied head included
    for m in linears:
        w = m.weight
        assert (w.stride() == (1, w.shape[0])) == (m is not kept)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.is_contiguous()  # its row lookups keep rows
    values["lm_head.weight"] = values["model.embed_tokens.weight"]  # tied: listed once before
    for name, p in model.named_parameters():
        assert torch.equal(p, values[name]), name
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, before, atol=1e-5)
    assert use_column_major_linears(model, keep=[kept]) == 0  # idempotent
