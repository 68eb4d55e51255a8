"""The engine on CUDA (Triton kernels): greedy output equals transformers on the same device."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
        reason="TRITON_INTERPRET is on: the engine would run interpreted kernels on CUDA tensors",
    ),
]


@pytest.mark.parametrize("kind", ["gqa", "mha"])
def test_greedy_matches_transformers_on_cuda(kind, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(kind)
    reference = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).to("cuda")
    prompts = random_prompts(41, 6, shared_prefix=20, max_len=40)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = reference.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    llm = LLM(str(path), device="cuda", dtype=torch.float32, block_size=16, num_blocks=256)
    for _ in range(2):  # cold, then from the cache
        outs = llm.generate(prompts, SamplingParams(max_tokens=16))
        assert [list(o.token_ids) for o in outs] == expected
    llm.cache.check_integrity()
