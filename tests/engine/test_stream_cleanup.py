"""A stream closed or dropped at any point, started or not, aborts its request and leaves no
record: nothing it queued runs inside a later call."""

from __future__ import annotations

import gc

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def llm(tiny_model_dir, request):
    settings = dict(block_size=4, num_blocks=64, async_scheduling=request.param)
    return LLM(str(tiny_model_dir("gqa")), **settings)


def rows_run_by(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Request ids of every row the scheduler schedules from now on."""
    seen: list[str] = []
    schedule = llm.scheduler.schedule

    def recording():
        out = schedule()
        seen.extend(row.request_id for row in out.rows)
        return out

    monkeypatch.setattr(llm.scheduler, "schedule", recording)
    return seen


def test_two_thousand_abandoned_streams_leave_nothing(llm, monkeypatch):
    prompts = random_prompts(61, 8, max_len=6)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    cycles = []
    for i in range(2000):
        stream = llm.stream(prompts[i % 8], params)
        for _ in range(i % 3):  # never started, started, or read twice
            next(stream)
        if i % 4 == 0:
            stream.close()
        elif i % 4 == 3:
            stream.cycle = stream  # garbage only the cycle collector frees, at any time
            cycles.append(stream)
        del stream
    # Cyclic garbage lives until a collection; the plain drops were aborted at once.
    cycles.clear()
    gc.collect()
    seen = rows_run_by(llm, monkeypatch)
    (out,) = llm.generate([prompts[0]], params)
    assert set(seen) == {out.request_id}
    assert not llm._tracked and not llm.scheduler.has_unfinished()
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0


def test_a_stream_freed_inside_a_step_is_aborted_after_it(llm, monkeypatch):
    prompts = random_prompts(63, 2, max_len=6)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (expected,) = llm.generate([prompts[1]], params)
    stream = llm.stream(prompts[0], params)
    next(stream)
    stream.cycle = stream  # running, and garbage only the cycle collector frees
    del stream
    seen = rows_run_by(llm, monkeypatch)

    def collect(*_: object) -> None:  # a pre-hook's return value would replace the layer input
        gc.collect()

    hook = llm.model.model.layers[0].register_forward_pre_hook(collect)
    try:
        (out,) = llm.generate([prompts[1]], params)
    finally:
        hook.remove()
    assert out.token_ids == expected.token_ids
    orphan_rows = [rid for rid in seen if rid != out.request_id]
    assert len(orphan_rows) == 1  # the dropped stream ran in one step, no more
    assert not llm._tracked and not llm.scheduler.has_unfinished()
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0


def test_a_finished_or_failed_stream_ends_cleanly(llm):
    prompt = random_prompts(62, 1, max_len=6)[0]
    stream = llm.stream(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    deltas = list(stream)
    assert deltas[-1].output.finish_reason == "length" and next(stream, None) is None
    stream.close()
    assert not llm._tracked and not llm.scheduler.has_unfinished()
