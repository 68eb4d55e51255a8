"""The step API (add_request / step / abort_request): one loop under generate, stream, server."""

from __future__ import annotations

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, RequestUpdate, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def llm(tiny_model_dir, request):
    settings = dict(block_size=4, num_blocks=128, max_num_seqs=3, async_scheduling=request.param)
    return LLM(str(tiny_model_dir("gqa")), **settings)


def drive(llm: LLM) -> dict[str, list[RequestUpdate]]:
    """Step until idle; the updates of each request, in order."""
    updates: dict[str, list[RequestUpdate]] = {}
    while llm.has_unfinished_requests():
        for u in llm.step():
            updates.setdefault(u.request_id, []).append(u)
        llm.check_integrity()
    return updates


def test_step_loop_equals_generate(llm):
    prompts = random_prompts(41, 5, shared_prefix=6, max_len=20)
    params = [SamplingParams(max_tokens=3 + i, ignore_eos=i % 2 == 0) for i in range(5)]
    expected = llm.generate(prompts, params)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert llm.num_waiting_requests == 5 and llm.has_unfinished_requests()
    updates = drive(llm)
    assert set(updates) == set(ids)
    for rid, want in zip(ids, expected, strict=True):
        got = updates[rid]
        assert [u.output is not None for u in got] == [False] * (len(got) - 1) + [True]
        out = got[-1].output
        assert out.token_ids == want.token_ids == tuple(t for u in got for t in u.new_token_ids)
        assert out.text == "".join(u.new_text for u in got) == llm.decode(out.token_ids)
        assert out.finish_reason == want.finish_reason and all(u.error is None for u in got)
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert llm.cache.stats().num_in_use_blocks == 0


def test_add_request_validates_and_queues_nothing(llm):
    for bad, error in (([], ValueError), ([[1, 2], [3]], ValueError), (3.5, TypeError)):
        with pytest.raises(error):
            llm.add_request(bad)
    with pytest.raises(TypeError):
        llm.add_request([5, 6], {"max_tokens": 2})
    assert llm.num_waiting_requests == 0 and not llm.has_unfinished_requests()


def test_abort_request_returns_blocks_and_reports_once(llm):
    prompt = random_prompts(42, 1, max_len=20)[0]
    rid = llm.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    queued = llm.add_request(prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    assert llm.abort_request(queued) and llm.abort_request(rid)
    assert not llm.abort_request(rid) and not llm.abort_request("req-unknown")
    updates = llm.step()
    assert [u.request_id for u in updates] == [queued, rid]
    assert all(u.output.finish_reason == "abort" and u.new_token_ids == () for u in updates)
    assert not llm.has_unfinished_requests() and llm.step() == []
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0


def test_generate_and_stream_share_the_loop_with_step_requests(llm):
    prompts = random_prompts(43, 3, max_len=20)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = llm.generate(prompts, params)
    rid = llm.add_request(prompts[0], params)
    stream = llm.stream(prompts[1], params)
    first = next(stream)
    (out,) = llm.generate([prompts[2]], params)  # advances the other two as well
    assert out.token_ids == expected[2].token_ids
    rest = list(stream)
    assert first.token_ids + tuple(t for d in rest for t in d.token_ids) == expected[1].token_ids
    updates = drive(llm)[rid]  # the updates of the steps generate and stream drove are kept
    assert tuple(t for u in updates for t in u.new_token_ids) == expected[0].token_ids
    assert not llm._tracked and llm.cache.stats().num_in_use_blocks == 0


def test_check_integrity_sees_a_request_the_engine_lost_track_of(llm):
    rid = llm.add_request(random_prompts(44, 1, max_len=8)[0], SamplingParams(max_tokens=2))
    llm.check_integrity()
    llm.scheduler.abort(rid)  # behind the engine's back: its record still says unfinished
    with pytest.raises(AssertionError):
        llm.check_integrity()
    assert llm.abort_request(rid) and llm.step()[0].output.finish_reason == "abort"
    llm.check_integrity()
