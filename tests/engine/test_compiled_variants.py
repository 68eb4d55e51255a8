"""No Triton compile after warm-up: the kernels' per-step arguments do not specialize them.

On a GPU every new specialization of a kernel's arguments is a 0.5-2 s compile. The step buffer
puts the attention metadata at offsets that move with the step's shape, and request and token
counts change every step; Triton would specialize on each (an int of 1 or a multiple of 16, a
pointer's 16-byte alignment). These tests compute, on the CPU, the keys Triton's CUDA JIT would
compile (`kernel_variants.VariantRecorder`) for the launches of real steps, run by the Triton
kernels under the interpreter.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kernel_variants import VariantRecorder, radixkv_kernels
from tiny_llama import build_model, random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.config import EngineConfig
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.engine.step.step_inputs import layout_for, pack_step, split_step
from radixkv.kernels import paged_attention_step, store_kv_step, use_backend
from radixkv.scheduler.output import ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.interpreter

BLOCK = 4
KV_SHAPE = (64, BLOCK, 2, 16)  # [num_blocks, block_size, kv_heads, head_dim]


def _decode_rows(n: int, context: int, first_block: int) -> list[ScheduledRequest]:
    """n decode rows after `context` tokens each, in consecutive blocks from `first_block`."""
    per_row = -(-(context + 1) // BLOCK)
    rows = []
    for i in range(n):
        start = first_block + i * per_row
        rows.append(
            ScheduledRequest(f"r{i}", (7,), context, (tuple(range(start, start + per_row)),), True)
        )
    return rows


def _run_step(rows: list[ScheduledRequest], k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """store + attention of one layer over a step packed like the engine packs it."""
    layout = layout_for(rows)
    flat = torch.from_numpy(np.empty(layout.total, dtype=np.int32))
    pack_step(rows, (), BLOCK, layout, flat.numpy())
    _, (meta,) = split_step(layout, flat, flat, [KV_SHAPE])
    num_tokens = layout.num_tokens
    kv = torch.randn(num_tokens, KV_SHAPE[2], KV_SHAPE[3])
    store_kv_step(kv, kv, k_cache, v_cache, meta)
    q = torch.randn(num_tokens, 2 * KV_SHAPE[2], KV_SHAPE[3])
    paged_attention_step(q, k_cache, v_cache, meta, 0.25)


def test_steps_of_every_shape_share_one_variant_per_kind(monkeypatch):
    """Decode steps of 1, 3 and 16 rows over different context lengths (so the metadata sits at
    offsets of every alignment, and counts are 1, odd or multiples of 16) compile one variant of
    each kernel; prefill steps of any length one more of the attention."""
    recorder = VariantRecorder(monkeypatch, radixkv_kernels())
    k_cache, v_cache = torch.zeros(KV_SHAPE), torch.zeros(KV_SHAPE)
    with use_backend("triton"):
        for n, context in [(1, 5), (3, 9), (16, 2), (1, 12)]:
            _run_step(_decode_rows(n, context, first_block=0), k_cache, v_cache)
        decode = recorder.variants()
        for q_len, start in [(5, 0), (16, 3), (1 + 2 * BLOCK, 1)]:
            prefill = [ScheduledRequest("p", (7,) * q_len, start, (tuple(range(8)),), True)]
            _run_step(_decode_rows(2, 3, first_block=8) + prefill, k_cache, v_cache)
    assert len(decode["store_kv"]) == 1
    assert len(decode["paged_attention"]) == 1
    variants = recorder.variants()
    assert len(variants["store_kv"]) == 1
    assert len(variants["paged_attention"]) == 2  # decode-like and prefill tiles


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("gqa")


def test_nothing_compiles_after_the_engines_warm_up(monkeypatch, model_dir, reference_generate):
    """An engine on the Triton kernels (fused Llama modules included): whatever compiles,
    compiles in `LLM()`'s warm-up; a workload of prefills, prefix hits with copy-on-write, mixed
    and decode steps of changing batch sizes adds no variant, and its greedy tokens are
    transformers'."""
    recorder = VariantRecorder(monkeypatch, radixkv_kernels())
    with use_backend("triton"):
        llm = LLM(model_dir, block_size=BLOCK, num_blocks=64, max_num_seqs=4)
        assert llm.runner.fused_modules
        at_start = recorder.variants()
        warm_up_launches = recorder.launches()
        assert warm_up_launches > 0
        prompts = random_prompts(5, 5, shared_prefix=6, max_len=5)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))
        max_new = (2, 5, 3, 6, 1)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in max_new])
    assert [list(o.token_ids) for o in outs] == reference_generate("gqa", prompts, max_new)
    assert recorder.launches() > warm_up_launches
    after = recorder.variants()
    new = {name: after[name] - at_start[name] for name in after if after[name] - at_start[name]}
    assert not new, f"variants first compiled after the warm-up: {sorted(new)}"
    assert len(at_start["paged_attention"]) == 2


def test_a_compile_after_start_up_is_logged_with_the_step(model_dir, caplog, monkeypatch):
    """Triton calls its compile hook for a new specialization; after the warm-up the runner warns,
    naming the kernel and the step's shape."""
    from triton import knobs

    from radixkv.kernels import compile_counter

    counter = compile_counter()
    assert counter is not None
    with use_backend("triton"):
        runner = ModelRunner(build_model("gqa"), EngineConfig(block_size=BLOCK, num_blocks=16))
        runner.warm_up()
        execute = runner._execute

        def compiling_execute(step, feed=None):
            # What Triton does on a cache miss: the pre-compile hook, then the post-compile one.
            info = type("JitFunctionInfo", (), {"name": "_late_kernel"})()
            knobs.runtime.jit_cache_hook(key="k", repr="_late_kernel[...]", fn=info)
            knobs.runtime.jit_post_compile_hook(key="k", repr="_late_kernel[...]", fn=info)
            return execute(step, feed)

        monkeypatch.setattr(runner, "_execute", compiling_execute)
        rows = tuple(_decode_rows(2, 3, first_block=0))
        with caplog.at_level(logging.WARNING, logger="radixkv.engine.step.model_runner"):
            runner.execute(SchedulerOutput(rows=rows))
            runner.execute(SchedulerOutput(rows=rows))  # counted once, not again
    warnings = [r.getMessage() for r in caplog.records if "compile" in r.getMessage()]
    assert len(warnings) == 2
    assert "1 Triton JIT compile(s) after start-up" in warnings[0]
    assert "2 rows and 2 tokens" in warnings[0] and "_late_kernel" in warnings[0]


def test_the_compile_counter_keeps_earlier_hooks(monkeypatch):
    """Installed after another tool's hooks, the counter calls them and keeps their answer (a
    cache hook returning True tells Triton to skip the compile)."""
    import triton.runtime.jit  # noqa: F401

    from radixkv.kernels import jit_monitor

    calls = []
    namespace = type("Runtime", (), {"jit_cache_hook": None, "jit_post_compile_hook": None})()
    namespace.jit_cache_hook = lambda **kw: calls.append(("earlier", kw["key"])) or True
    counter = jit_monitor.CompileCounter()
    hook = jit_monitor._chain(counter.before_compile, namespace.jit_cache_hook)
    assert hook(key="a", repr="_k[num_warps=4](x: *fp32)", fn=None) is True
    assert calls == [("earlier", "a")]
    assert counter.count == 1 and counter.names_since(0) == ["_k"]
    assert jit_monitor._chain(counter.before_compile, None)(key="b", fn=None) is None
    assert counter.names_since(1) == ["?"] and counter.names_since(2) == []


@pytest.mark.parametrize("arch", ["gemma2", "gpt-oss"])
def test_window_softcap_and_sinks_compile_in_the_warm_up(arch, monkeypatch, tmp_path):
    """Gemma 2 (window / full layers, soft-cap, query_pre_attn_scalar) and GPT-OSS (window / full
    layers, sinks) on the Triton kernels: the warm-up compiles both layer kinds' variants, a
    workload of prompts several windows long adds none, and the greedy tokens are
    transformers'."""
    from tiny_archs import WINDOW, build_arch
    from transformers import AutoModelForCausalLM

    path = build_arch(arch, tmp_path)
    prompts = random_prompts(7, 2, shared_prefix=3 * WINDOW, max_len=5)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=3, do_sample=False, pad_token_id=0
            )
        expected.append(out[0, len(prompt) :].tolist())
    recorder = VariantRecorder(monkeypatch, radixkv_kernels())
    with use_backend("triton"):
        llm = LLM(path, block_size=BLOCK, num_blocks=64, max_num_seqs=2)
        at_start = recorder.variants()
        outs = llm.generate(prompts, SamplingParams(max_tokens=3))
    assert [list(o.token_ids) for o in outs] == expected
    after = recorder.variants()
    assert after == at_start, "a variant first compiled after the warm-up"
    # window and full layers, each decode-like and prefill
    assert len(at_start["paged_attention"]) == 4


def test_latent_layers_compile_in_the_warm_up(monkeypatch, tmp_path):
    """DeepSeek V3's latent layers on the Triton kernels: the warm-up compiles the absorbed
    form's decode and extend variants and the expanded form's first and later chunks (a prefill
    of two chunks: 16 positions each here, so that it stays small under the interpreter); a
    workload of prefills, prefix hits (extends over the cache) and decodes adds none, and the
    greedy tokens are transformers'. Two layers (a dense one, a MoE one) keep it quick."""
    from tiny_archs import ARCHITECTURES, build_config, greedy_tokens, save_tiny_model

    from radixkv.kernels import latent_reference

    for bound in ("MAX_EXPANDED_CHUNK", "MIN_EXPANDED_CHUNK"):
        monkeypatch.setattr(latent_reference, bound, 16)
    model_type, fields = ARCHITECTURES["deepseek-v3"]
    path = save_tiny_model(build_config(model_type, **{**fields, "num_hidden_layers": 2}), tmp_path)
    prompts = random_prompts(7, 3, shared_prefix=9, max_len=6)
    expected = greedy_tokens(path, prompts, [3] * len(prompts))
    recorder = VariantRecorder(monkeypatch, radixkv_kernels())
    with use_backend("triton"):
        llm = LLM(str(path), block_size=BLOCK, num_blocks=64, max_num_seqs=2)
        at_start = recorder.variants()
        for _ in range(2):  # cold, then from the cache
            outs = llm.generate(prompts, SamplingParams(max_tokens=3))
            assert [list(o.token_ids) for o in outs] == expected
    assert after_warm_up_adds_none(recorder, at_start)
    assert len(at_start["latent_attention"]) == 2  # decode-like and extend tiles
    assert len(at_start["expanded_chunk"]) == 2  # the first chunk and the ones resuming it
    assert not at_start["paged_attention"]  # no layer attends over K and V


def after_warm_up_adds_none(recorder: VariantRecorder, at_start: dict) -> bool:
    after = recorder.variants()
    new = {name: after[name] - at_start[name] for name in after if after[name] - at_start[name]}
    assert not new, f"variants first compiled after the warm-up: {sorted(new)}"
    return True
