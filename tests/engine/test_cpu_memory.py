"""A CPU engine keeps large freed blocks for the next step: a prefill's activations, allocated and
freed layer after layer, no longer come back as fresh pages (the process's minor page faults)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from radixkv.engine.step.cpu_memory import keep_freed_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# Two SmolLM2-wide random layers; eight 500-token prompts a run; the faults of the third run.
# "default" runs the engine with malloc's own settings.
_PREFILLS = textwrap.dedent(
    """
    import random, resource, sys
    sys.path.pop(0)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    import radixkv.engine.step.model_runner as model_runner
    if sys.argv[1] == "default":
        model_runner.keep_freed_memory = lambda: False
    from radixkv.engine import LLM
    from radixkv.engine.sampling_params import SamplingParams
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024,
    )
    llm = LLM(LlamaForCausalLM(config).eval(), num_threads=1)
    rng = random.Random(0)
    def faults():
        prompts = [[rng.randrange(5, 500) for _ in range(500)] for _ in range(8)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        llm.generate(prompts, SamplingParams(max_tokens=1))
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults(), faults()
    print(faults())
    """
)


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PREFILLS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


def test_a_prefills_activations_are_reused_without_page_faults() -> None:
    # malloc's own settings map fresh pages every run: about 36,000 faults alone, as few as
    # 4,600 beside a busy test run (its dynamic mmap threshold follows the frees it has seen).
    default, keep = _faults("default"), _faults("keep")
    assert keep < 500 and default > 20 * max(keep, 50), (default, keep)


def test_it_can_be_asked_twice() -> None:
    assert keep_freed_memory() and keep_freed_memory()
