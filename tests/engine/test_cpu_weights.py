"""The CPU's linears: every plain `nn.Linear` runs the few-rows kernel through `CpuLinear`, with
its weight, layout and parameter untouched (a tied head keeps sharing the embedding's), and the
model computes what it computed before."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from radixkv.engine.step.cpu_weights import CpuLinear, use_cpu_linears


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


class _OwnLinear(torch.nn.Linear):
    """A subclass with a forward of its own (a quantized linear, say): left alone."""


def test_plain_linears_run_the_kernel_and_compute_the_same() -> None:
    model = _model(tied=True)
    model.model.layers[0].mlp.down_proj.__class__ = _OwnLinear
    ids = torch.tensor([[3, 5, 7, 11]])  # 4 rows: the kernel's side of every linear
    with torch.no_grad():
        before = model(ids).logits
    weights = {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert use_cpu_linears(model) == len(linears) - 1
    assert model.model.layers[0].mlp.down_proj.__class__ is _OwnLinear
    assert all(type(m) is CpuLinear for m in linears if type(m) is not _OwnLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied, no copy
    assert {n: (p.data_ptr(), p.stride()) for n, p in model.named_parameters()} == weights
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
    assert use_cpu_linears(model) == 0  # idempotent
