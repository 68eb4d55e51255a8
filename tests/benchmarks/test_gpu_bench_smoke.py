"""The GPU serving benchmark on its tiny configuration, on the CPU: every system's plumbing runs,
and greedy replies agree across systems (fp32, same weights), so the script is sound before a GPU
run. No timing assertions."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_bench", None)


def test_tiny_run_prints_one_table_and_the_goals(bench, capsys):
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    names = (
        "radixkv cache on | radixkv cache off | transformers generate | transformers continuous "
        "batching"
    )
    assert f"| metric | {names} | on vs off, x | on vs generate, x | on vs batch, x |" in out
    for label in ("chat total, s", "chat turn 2 mean TTFT, ms", "decode, output tok/s"):
        assert f"| {label} |" in out
    assert "| start-up (copy, KV cache, warm-up, graphs), s |" in out
    # Each figure carries its roofline's share: "value (share)".
    assert re.search(r"\| chat total, s \| [0-9.]+ \([0-9.]+\) \|", out)
    assert "ceilings measured in this run: copy" in out
    # Each system printed as it finished, with what it is.
    assert "- transformers continuous batching: chat " in out and "As run: attention" in out
    assert "- radixkv cache off: chat " in out and "prefix cache off" in out
    # Nothing compiles on the CPU (the engine runs the torch reference): zero for every system.
    assert "| Triton JIT compiles in the timed runs | 0 | 0 | 0 | 0 |" in out
    assert "| JIT compiles in timed runs (radixkv) | 0 | 0 | met |" in out
    # Greedy, fp32, the same weights: every system's replies (chat turns and decode) agree.
    off = "| replies equal to radixkv cache off (share; not a check in bf16) |"
    assert f"{off} 1.00 | 1.00 | 1.00 | 1.00 |" in out
    # Only a rerun or the other step mode of the same engine must agree exactly: none here.
    assert "| replies equal to radixkv cache on's (share) | 1.00 | 1.00 | 1.00 | 1.00 |" in out
    assert "| chat total, cache off | <= 2.9 s |" in out
    assert "| decode tok/s: cache on / transformers continuous batching | >= 3.0 x |" in out
    assert "token for token" not in out


def test_a_failing_system_loses_only_its_own_figures(bench, capsys, monkeypatch):
    def broken(model, cfg):
        raise RuntimeError("this system cannot start")

    monkeypatch.setitem(bench.SYSTEMS, "off", broken)
    assert bench.main(["--tiny", "--systems", "on,off,generate"]) == 1
    out = capsys.readouterr().out
    assert "- off: FAILED after" in out and "systems that failed: off" in out
    assert "| metric | radixkv cache on | transformers generate | on vs generate, x |" in out


def test_workloads_have_the_configured_shape(bench):
    cfg = bench.TINY
    model = bench.build_model(cfg)
    system = bench.HFGenerate(model)
    chat = bench.run_chat(system, cfg)
    assert len(chat.replies) == cfg.chat_turns
    assert all(len(turn) == cfg.chat_conversations for turn in chat.replies)
    assert all(len(r) == cfg.chat_turn_tokens for turn in chat.replies for r in turn)
    assert chat.turn_ttft_s == [None] * cfg.chat_turns  # generate reports no TTFT
    decode = bench.run_decode(system, cfg)
    assert len(decode.replies) == cfg.decode_prompts and decode.tokens_per_s > 0
    full = bench.FULL
    assert (full.hidden, full.layers, full.heads, full.kv_heads, full.head_dim, full.vocab) == (
        2048,
        16,
        32,
        8,
        64,
        32000,
    )
    assert full.max_model_len >= full.chat_system_tokens + 2 * 6 * 128


def test_continuous_batching_replies_match_generate(bench):
    """transformers' continuous batching, one manager across calls: replies in prompt order,
    equal to padded `generate`, with a time to first token."""
    cfg = bench.TINY
    model = bench.build_model(cfg)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17]]
    expected = bench.HFGenerate(bench.copy.deepcopy(model)).generate(prompts, 5).replies
    system = bench.HFBatch(model, cfg)
    try:
        got = system.generate(prompts, 5)
        again = system.generate(prompts[::-1], 5)  # the same manager, a second call
    finally:
        system.close()
    assert got.replies == expected and again.replies == expected[::-1]
    assert got.ttft_s is not None and all(t > 0 for t in got.ttft_s)


def test_the_warm_up_runs_both_workloads_and_leaves_nothing_cached(bench, monkeypatch):
    """Every step shape of the timed runs before they start (a long system-prompt prefill,
    a turn over a cached prefix, a decode batch), over other tokens, and an empty cache after."""
    cfg = bench.TINY
    system = bench.RadixKV(bench.build_model(cfg), cfg, cache=True)
    calls = []
    generate = system.generate
    monkeypatch.setattr(system, "generate", lambda p, n: calls.append((p, n)) or generate(p, n))
    bench._warm_up(system, cfg)
    chat_turns = calls[: min(2, cfg.chat_turns)]
    assert [len(p[0]) for p, _ in chat_turns] == [
        cfg.chat_system_tokens + cfg.chat_turn_tokens,
        cfg.chat_system_tokens + 3 * cfg.chat_turn_tokens,
    ]
    assert system.llm.cache.stats().num_hit_tokens > 0  # the second turn hit the first
    prompts, new = calls[-1]
    assert len(prompts) == min(4, cfg.decode_prompts) and new == min(4, cfg.decode_new_tokens)
    assert {len(p) for p in prompts} == {cfg.decode_prompt_tokens}
    stats = system.llm.cache.stats()
    assert stats.num_free_blocks == stats.num_blocks  # forgotten: the timed runs start cold
