"""The engine on CUDA (compiled Triton kernels): greedy output with CUDA-graph decode equals eager
decode and transformers on the same device, under eviction pressure; steps never sync.

    python3 -P -m pytest -m gpu tests/engine/test_engine_gpu.py
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest
import torch
from tiny_archs import WINDOW, build_arch, greedy_tokens
from tiny_llama import build_model, random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.config import EngineConfig
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"),
        reason="TRITON_INTERPRET is on: the engine would run interpreted kernels on CUDA tensors",
    ),
]

MAX_NEW = 24
# KV pools far smaller than the workload (10 prompts of up to 84 tokens with their replies), yet
# holding the longest request: requests are evicted and preempted by recompute.
POOL_BLOCKS = {1: 120, 16: 10, 64: 3}


@pytest.fixture(scope="module")
def cuda_reference(tiny_model_dir) -> Callable[[str, Sequence[Sequence[int]]], list[list[int]]]:
    """(kind, prompts) -> greedy tokens of plain transformers on CUDA (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def run(kind: str, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        if kind not in models:
            models[kind] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(kind), attn_implementation="eager", dtype=torch.float32
            ).to("cuda")
        expected = []
        with torch.no_grad():
            for p in prompts:
                out = models[kind].generate(
                    torch.tensor([list(p)], device="cuda"),
                    max_new_tokens=MAX_NEW,
                    do_sample=False,
                    eos_token_id=2,
                    pad_token_id=0,
                )
                expected.append(out[0, len(p) :].tolist())
        return expected

    return run


# Each kind, block size and path at least once, in 5 engines rather than all 12 combinations:
# each new (kind, block size) costs its own Triton compiles. Steps are overlapped (the CUDA
# default) except at block size 64.
CASES = [
    ("gqa", 1, False),
    ("mha", 16, False),
    ("gqa", 64, False),
    ("mha", 1, True),
    ("gqa", 16, True),
]


@pytest.mark.parametrize(
    ("kind", "block_size", "enforce_eager"),
    CASES,
    ids=[f"{k}-b{b}-{'eager' if e else 'graphs'}" for k, b, e in CASES],
)
def test_greedy_matches_transformers_on_cuda(
    kind, block_size, enforce_eager, tiny_model_dir, cuda_reference
):
    prompts = random_prompts(41, 10, shared_prefix=20, max_len=40)
    expected = cuda_reference(kind, prompts)
    llm = LLM(
        str(tiny_model_dir(kind)),
        device="cuda",
        dtype=torch.float32,
        block_size=block_size,
        num_blocks=POOL_BLOCKS[block_size],
        max_num_seqs=6,
        enforce_eager=enforce_eager,
        async_scheduling=block_size != 64,
    )
    graphs = llm.runner.decode_graphs
    assert (graphs is None) == enforce_eager
    for _ in range(2):  # cold, then from the cache
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
        assert [list(o.token_ids) for o in outs] == expected
        llm.cache.check_integrity()
    assert llm.cache.stats().num_evicted_blocks > 0
    if graphs is not None:
        assert graphs.buckets == (1, 2, 4, 6)
        assert graphs.num_replays > 0


def _row(rid, tokens, start, table, sample=True):
    return ScheduledRequest(rid, tuple(tokens), start, (tuple(table),), sample)


def _steps() -> list[SchedulerOutput]:
    """Prefill of a and b; then decode steps, one with a copy-on-write, one mixed with a prefill;
    batch sizes 2 and 3 (graph buckets 2 and 4: one pad row)."""
    a, b, c = list(range(10, 31)), list(range(40, 49)), list(range(50, 60))
    return [
        SchedulerOutput(rows=(_row("a", a, 0, [7, 3]), _row("b", b, 0, [5]))),
        SchedulerOutput(rows=(_row("a", [31], 21, [7, 3]), _row("b", [49], 9, [5]))),
        SchedulerOutput(
            rows=(_row("a", [32], 22, [7, 3]), _row("b", [50], 10, [5])),
            plans=(GroupPlan(copies=(BlockCopy(src_block=5, dst_block=9, num_slots=10),)),),
        ),
        SchedulerOutput(rows=(_row("a", [33], 23, [7, 3]), _row("c", c, 0, [11]))),
        SchedulerOutput(
            rows=(_row("a", [34], 24, [7, 3]), _row("b", [51], 11, [5]), _row("c", [60], 10, [11]))
        ),
    ]


def test_steps_never_sync_and_graphs_equal_eager():
    """Every step after the first runs under sync-debug "error" (a host<->device sync raises):
    decode steps replayed from graphs, a copy-on-write, a mixed eager step. The graph runner's
    logits equal the eager runner's."""
    model = build_model("gqa").to("cuda")
    runners = {
        eager: ModelRunner(
            model,
            EngineConfig(
                block_size=16, num_blocks=16, enforce_eager=eager, max_num_seqs=4, max_model_len=256
            ),
            validate_steps=False,
        )
        for eager in (True, False)
    }
    assert runners[False].decode_graphs is not None
    logits: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for eager, runner in runners.items():
        steps = _steps()
        logits[eager].append(runner.execute(steps[0]).clone())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in steps[1:]:
                logits[eager].append(runner.execute(step).clone())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert runners[False].decode_graphs.num_replays == 3  # the three pure decode steps
    for graph_step, eager_step in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(graph_step, eager_step, rtol=1e-5, atol=1e-5)
    # Padded graph batches may pick other matmul kernels: equal up to rounding.
    torch.testing.assert_close(
        runners[False].kv[0].k_cache, runners[True].kv[0].k_cache, rtol=1e-5, atol=1e-5
    )


def test_nothing_compiles_after_the_warm_up_on_cuda(tiny_model_dir):
    """`LLM()` compiles every Triton variant its steps use: prefills, prefix hits with
    copy-on-write, mixed steps, graph replays of every bucket, eager decode past the largest
    bucket, long contexts that split, sampled rows. Counted by Triton's own compile hook."""
    from radixkv.kernels import compile_counter

    counter = compile_counter()
    assert counter is not None
    llm = LLM(
        str(tiny_model_dir("gqa")),
        device="cuda",
        dtype=torch.bfloat16,
        block_size=16,
        num_blocks=256,
        max_num_seqs=6,
    )
    assert llm.runner.fused_modules and llm.runner.decode_graphs is not None
    start = counter.count
    prompts = random_prompts(3, 12, shared_prefix=40, max_len=60)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8))
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    llm.generate(
        prompts, [sampled if i % 2 else SamplingParams(max_tokens=i + 3) for i in range(12)]
    )
    long_prompt = random_prompts(4, 1, min_len=900, max_len=900)
    llm.generate(long_prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    assert counter.count == start, f"compiled after start-up: {counter.names_since(start)}"


def test_overlapped_steps_equal_synchronous_on_cuda(tiny_model_dir):
    """Greedy, seeded and stop-token requests under eviction: the overlapped engine (tokens read
    one step late, placeholders fed on the device, graphs and eager steps) gives the synchronous
    engine's tokens."""
    prompts = random_prompts(43, 10, shared_prefix=20, max_len=40)
    settings = dict(device="cuda", dtype=torch.float32, block_size=16, num_blocks=10)
    engines = {
        on: LLM(str(tiny_model_dir("gqa")), max_num_seqs=6, async_scheduling=on, **settings)
        for on in (False, True)
    }
    stop_probe = SamplingParams(max_tokens=4, ignore_eos=True)
    (probe,) = engines[False].generate(prompts[2:3], stop_probe)  # its third token stops it
    params = [
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=3),
        SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[probe.token_ids[2]]),
        SamplingParams(max_tokens=5, temperature=1.2, top_k=20, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=1),
    ] * 2
    outs = {on: llm.generate(prompts, params) for on, llm in engines.items()}
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert outs[True][2].finish_reason == "stop"
    assert engines[True].cache.stats().num_evicted_blocks > 0
    assert engines[True].runner.decode_graphs.num_replays > 0
    engines[True].check_integrity()


def test_overlapped_penalties_logprobs_and_tiers_equal_synchronous_on_cuda(tiny_model_dir):
    """The overlapped step with what it gained last: penalties counting the token still on the
    device, logprobs copied behind the tokens, and a host tier whose loads and offloads run
    while the previous step is in flight; all equal to the synchronous engine's."""
    prompts = random_prompts(44, 8, shared_prefix=24, max_len=40)
    settings = dict(
        device="cuda", dtype=torch.float32, block_size=16, num_blocks=10, host_cache_bytes=2**22
    )
    engines = {
        on: LLM(str(tiny_model_dir("gqa")), max_num_seqs=4, async_scheduling=on, **settings)
        for on in (False, True)
    }
    params = [
        SamplingParams(max_tokens=MAX_NEW, frequency_penalty=1.5, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=3, presence_penalty=1.0),
        SamplingParams(max_tokens=9, logit_bias={5: 3.0}, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=MAX_NEW, ignore_eos=True),
    ] * 2
    rounds = {on: [llm.generate(prompts, params) for _ in range(2)] for on, llm in engines.items()}
    for sync, overlapped in zip(rounds[False], rounds[True], strict=True):
        for a, b in zip(overlapped, sync, strict=True):
            assert a.token_ids == b.token_ids
            assert [lp.token_id for lp in a.logprobs or ()] == [
                lp.token_id for lp in b.logprobs or ()
            ]
            for x, y in zip(a.logprobs or (), b.logprobs or (), strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    stats = engines[True].cache.stats()
    assert stats.num_evicted_blocks > 0 and stats.num_host_hit_tokens > 0
    engines[True].check_integrity()


# Window models on CUDA: decode graphs capture both block tables, the window group's pool is
# short enough to evict tails and preempt, and with a host tier the window group's blocks move
# over their own tensors (radixkv.engine.tiers.tier_io). Block size 4, 24 full and 12 window blocks:
# the CPU window-tier tests' pressure.
WINDOW_CASES = [("gemma3", True, True), ("gemma2", False, True), ("mistral-window", True, False)]


@pytest.mark.parametrize(("arch", "overlap", "host_tier"), WINDOW_CASES)
def test_window_models_match_transformers_on_cuda(arch, overlap, host_tier, tmp_path):
    prompts = random_prompts(41, 4, shared_prefix=3 * WINDOW, min_len=6, max_len=20)
    prompts += random_prompts(42, 2, min_len=4 * WINDOW, max_len=5 * WINDOW)
    max_new = [5 + i % 3 for i in range(len(prompts))]
    path = build_arch(arch, tmp_path)
    expected = greedy_tokens(path, prompts, max_new, device="cuda")
    llm = LLM(
        str(path),
        device="cuda",
        dtype=torch.float32,
        block_size=4,
        num_blocks=24,
        num_window_blocks=12,
        max_num_seqs=2,
        chunked_prefill_size=16,
        async_scheduling=overlap,
        host_cache_bytes=2**20 if host_tier else 0,
    )
    params = [SamplingParams(max_tokens=n) for n in max_new]
    for _ in range(2):  # cold, then from the cache (and the host tier)
        outs = llm.generate(prompts, params)
        assert [list(o.token_ids) for o in outs] == expected
        llm.check_integrity()
    graphs = llm.runner.decode_graphs
    assert graphs is not None and graphs.num_replays > 0
    assert llm.cache.groups[1].num_evicted_tails > 0
    if host_tier:
        assert llm.cache.stats().num_host_hit_tokens > 0
        assert llm.tier_ios[1].totals["load"].num_blocks > 0
