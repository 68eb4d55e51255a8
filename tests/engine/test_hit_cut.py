"""A window model's hit cut back is explained (issue 43, item 10): the tree matched more of a
prompt than the cache could serve, because a hit resumes only where the window layers' KV was
kept. Each request's stats and the chat's lines say how many tokens matched and why; a
full-attention model's never do."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_archs import build_arch
from tiny_llama import build_model

from radixkv.chat.cli import stats_text, status_line
from radixkv.engine import LLM, SamplingParams

FIRST = list(range(10, 50))
SECOND = FIRST[:30] + list(range(100, 110))  # leaves FIRST after 30 tokens


def _run(llm: Any, prompt: list[int]) -> Any:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    llm.check_integrity()
    return out.stats


@pytest.fixture(scope="module")
def window_llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = build_arch("gemma3", tmp_path_factory.mktemp("gemma3"))
    return LLM(
        str(model), block_size=4, num_blocks=64, num_window_blocks=40, chunked_prefill_size=16
    )


def test_a_cut_hit_reports_what_matched_and_why(window_llm) -> None:
    first = _run(window_llm, FIRST)
    assert first.num_matched_tokens == first.num_cached_tokens == 0
    assert first.hit_cut_reason is None
    second = _run(window_llm, SECOND)
    assert second.num_matched_tokens == 30 and second.num_cached_tokens < 30
    reason = second.hit_cut_reason
    assert reason is not None and "matched 30 tokens" in reason
    assert f"up to {second.num_cached_tokens}" in reason
    assert reason in status_line(second)
    cut = window_llm.cache.num_cut_hit_tokens
    assert cut == 30 - second.num_cached_tokens
    assert f"cut hits      {cut} matched tokens not served" in stats_text(window_llm)


def test_a_full_attention_models_hits_are_never_cut() -> None:
    llm = LLM(build_model("gqa"), num_blocks=64)
    _run(llm, FIRST)
    second = _run(llm, SECOND)
    assert second.num_matched_tokens == second.num_cached_tokens == 30
    assert second.hit_cut_reason is None and "\n" not in status_line(second)
    assert "cut hits" not in stats_text(llm)


def test_a_hybrid_models_cut_hit_and_its_state_slots_are_reported(tmp_path) -> None:
    """A recurrent model resumes only where a snapshot of its state is kept: SECOND leaves
    FIRST's path at 30, where none was taken, so its hit is cut to 0 (and a snapshot is taken
    there for the next prompt through it)."""
    path = build_arch("qwen3_5", tmp_path)
    llm = LLM(str(path), block_size=4, num_blocks=64, max_num_seqs=2, snapshot_min_gap_tokens=8)
    _run(llm, FIRST)
    second = _run(llm, SECOND)
    assert second.num_matched_tokens == 30 and second.num_cached_tokens == 0
    assert "recurrent layers kept what a hit resumes from only up to 0" in second.hit_cut_reason
    third = _run(llm, SECOND[:30] + [7, 8, 9])
    assert third.num_matched_tokens == third.num_cached_tokens == 30
    text = stats_text(llm)
    assert "cut hits      30 matched tokens not served" in text
    state = llm.cache.groups[-1]
    slot_kib = f"{state.slot_bytes / 1024:.1f}"
    assert f"state slots   {state.num_blocks} of {slot_kib} KiB: 0 running, " in text
    assert " 1 hits resumed 30 tokens from one" in text
