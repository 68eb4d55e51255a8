"""Overlapped steps (`async_scheduling=True`) give the synchronous engine's output token for token:
greedy and seeded sampling, stop tokens and EOS, max_tokens and max_model_len, aborts mid-flight,
prefix hits with copy-on-write, chunked prefill, preemption; the engine's and scheduler's
integrity (placeholders included) holds after every step, and nothing stays in use."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams

SMALL_POOL = dict(block_size=4, num_blocks=40, max_num_seqs=4, chunked_prefill_size=8)
PROMPTS = random_prompts(7, 8, shared_prefix=10, min_len=3, max_len=30)


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=7, temperature=1.3, top_k=30, seed=11),
        SamplingParams(max_tokens=2),
        SamplingParams(max_tokens=15, temperature=0.7, seed=5, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=11),
    ]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


def _engines(model_dir: str, **settings) -> dict[bool, LLM]:
    return {on: LLM(model_dir, async_scheduling=on, **settings) for on in (False, True)}


def _stepped(llm: LLM, prompts, params) -> dict[str, list[int]]:
    """Request id -> tokens, stepping through the step API with integrity checks after each."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    done: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for u in llm.step():
            tokens[u.request_id] += u.new_token_ids
            if u.output is not None:
                assert list(u.output.token_ids) == tokens[u.request_id]
                done[u.request_id] = tokens[u.request_id]
        llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    return {rid: done[rid] for rid in ids}


def _common_token(llm: LLM, prompts) -> int:
    """The third token the greedy engine emits for the prompt: a stop token that stops it."""
    (out,) = llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    return out.token_ids[2]


@pytest.mark.parametrize(
    "settings",
    [
        SMALL_POOL,  # evictions, prefix hits with copy-on-write, chunked prefill
        dict(block_size=4, num_blocks=24, max_num_seqs=4, chunked_prefill_size=8),  # preemption
        dict(block_size=8, num_blocks=64, max_num_seqs=8, prefill_first=True, max_model_len=40),
        dict(block_size=4, num_blocks=64, enable_prefix_cache=False),
    ],
    ids=["small-pool", "preempting", "prefill-first-short-context", "no-cache"],
)
def test_overlapped_output_equals_synchronous(model_dir, settings):
    engines = _engines(model_dir, **settings)
    params = _params(_common_token(engines[False], PROMPTS[3:4]))  # stops request 3
    outs = {on: _stepped(llm, PROMPTS, params) for on, llm in engines.items()}
    assert list(outs[True].values()) == list(outs[False].values())
    stopped = [o for o in engines[True].generate(PROMPTS, params) if o.finish_reason == "stop"]
    assert stopped, "a stop token ended some request"
    if settings is SMALL_POOL:
        assert engines[True].cache.stats().num_evicted_blocks > 0
    if settings.get("num_blocks") == 24:
        assert engines[True].scheduler.num_preemptions > 0, "the small pool preempted"
    again = [o.token_ids for o in engines[True].generate(PROMPTS, params)]
    assert again == [o.token_ids for o in engines[False].generate(PROMPTS, params)]


def test_second_turn_hits_the_prefix_cache_alike(model_dir):
    engines = _engines(model_dir, **SMALL_POOL)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    firsts = {on: llm.generate(PROMPTS[:3], params) for on, llm in engines.items()}
    follow = [list(o.prompt_token_ids) + list(o.token_ids) + [9, 10] for o in firsts[False]]
    seconds = {on: llm.generate(follow, params) for on, llm in engines.items()}
    assert [o.token_ids for o in firsts[True]] == [o.token_ids for o in firsts[False]]
    assert [o.token_ids for o in seconds[True]] == [o.token_ids for o in seconds[False]]
    hits = [o.stats.num_cached_tokens for o in seconds[True]]
    assert hits == [o.stats.num_cached_tokens for o in seconds[False]] and min(hits) > 0


def test_abort_while_a_step_is_in_flight(model_dir):
    """Abort requests at every point of their lives, one step in flight; the others' tokens are
    the synchronous engine's, and every block and lock comes back."""
    llm = LLM(model_dir, async_scheduling=True, **SMALL_POOL)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, **SMALL_POOL).generate(PROMPTS, params)]
    for abort_after in range(1, 8):
        ids = [llm.add_request(p, params) for p in PROMPTS]
        victims = set(ids[abort_after % 3 :: 3])
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        finished: dict[str, str] = {}
        step = 0
        while llm.has_unfinished_requests():
            step += 1
            if step == abort_after:
                for rid in victims:
                    llm.abort_request(rid)
            for u in llm.step():
                tokens[u.request_id] += u.new_token_ids
                if u.output is not None:
                    finished[u.request_id] = u.output.finish_reason
            llm.check_integrity()
        for rid, want in zip(ids, expected, strict=True):
            if rid in victims and finished[rid] == "abort":
                assert tokens[rid] == list(want[: len(tokens[rid])])
            else:
                assert tokens[rid] == list(want), rid
        assert llm.cache.stats().num_in_use_blocks == 0


def test_placeholders_are_read_one_step_late(model_dir):
    """The first step's token arrives with the second step's update: the overlap is real."""
    llm = LLM(model_dir, async_scheduling=True, **SMALL_POOL)
    rid = llm.add_request(PROMPTS[0][:6], SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.step() == []  # the prefill is launched, its token is not read yet
    (req,) = llm.scheduler.running_requests
    assert req.num_pending == 1
    (update,) = llm.step()
    assert update.request_id == rid and len(update.new_token_ids) == 1
    assert req.num_pending == 1  # the second token is in flight now
    llm.check_integrity()
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.cache.stats().num_in_use_blocks == 0


def test_async_scheduling_setting(model_dir):
    default = LLM(model_dir, num_blocks=16)
    assert default.config.async_scheduling is None  # the default: decided by the device
    assert default._overlap is False  # a CPU: its forward runs on the host, nothing to overlap
    assert LLM(model_dir, num_blocks=16, async_scheduling=True).config.async_scheduling is True
    with pytest.raises(TypeError, match="async_scheduling must be a bool"):
        LLM(model_dir, async_scheduling="yes")


def _adjusted_params() -> list[SamplingParams]:
    """Penalties, logit bias and logprobs, greedy and seeded, beside plain rows."""
    return [
        SamplingParams(max_tokens=10, frequency_penalty=1.5, logprobs=2, ignore_eos=True),
        SamplingParams(
            max_tokens=12, temperature=0.9, seed=3, presence_penalty=1.0, ignore_eos=True
        ),
        SamplingParams(max_tokens=8, logit_bias={5: 3.0, 7: -100.0}, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=1.1, seed=9, frequency_penalty=-0.5, logprobs=3),
        SamplingParams(max_tokens=6, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.8, seed=4, logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=13, frequency_penalty=0.7, ignore_eos=True),
    ]


def _stepped_outputs(llm: LLM, prompts, params) -> list:
    """The finished outputs in submit order, through the step API, integrity checked after
    every step."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {}
    while llm.has_unfinished_requests():
        done.update((u.request_id, u.output) for u in llm.step() if u.output is not None)
        llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    return [done[rid] for rid in ids]


@pytest.mark.parametrize(
    "settings",
    [SMALL_POOL, dict(block_size=4, num_blocks=24, max_num_seqs=4, chunked_prefill_size=8)],
    ids=["small-pool", "preempting"],
)
def test_penalties_bias_and_logprobs_equal_the_synchronous_engines(model_dir, settings):
    """A penalty counts the request's last token while it is still on the device (its
    placeholder not filled yet); logprobs come back one step late with their tokens."""
    engines = _engines(model_dir, **settings)
    params = _adjusted_params()
    outs = {on: _stepped_outputs(llm, PROMPTS, params) for on, llm in engines.items()}
    for sync, overlapped in zip(outs[False], outs[True], strict=True):
        assert overlapped.token_ids == sync.token_ids
        assert (overlapped.logprobs is None) == (sync.logprobs is None)
        for a, b in zip(overlapped.logprobs or (), sync.logprobs or (), strict=True):
            assert (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    plain = [replace(p, frequency_penalty=0.0, presence_penalty=0.0) for p in params]
    unpenalized = engines[True].generate(PROMPTS, plain)
    penalized = [0, 5, 7]  # the greedy rows with penalties
    assert any(unpenalized[i].token_ids != outs[True][i].token_ids for i in penalized)
    streamed = [lp for d in engines[True].stream(PROMPTS[0], params[0]) for lp in d.logprobs]
    assert [lp.token_id for lp in streamed] == list(outs[True][0].token_ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_first_token_is_stamped_when_it_is_sampled(model_dir, overlap):
    """An overlapped step reads a step's tokens after launching the next one: a first token's
    time is still when it was sampled, not when it was read (on the CPU, after the next step's
    whole forward). Every step after the prefill is made 0.5 s slower here."""
    import time

    llm = LLM(model_dir, async_scheduling=overlap)
    execute, calls = llm.runner.execute, []

    def slow_after_the_first(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            time.sleep(0.5)
        return execute(*args, **kwargs)

    llm.runner.execute = slow_after_the_first
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(calls) == 3
    assert out.stats.ttft_s < 0.4 < out.stats.total_s
