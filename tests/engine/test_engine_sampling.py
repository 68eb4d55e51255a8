"""Sampling through the engine: seeded reproducibility, degenerate filters equal greedy; and
vLLM's extensions, in both step modes: greedy decoding with a repetition penalty and with
min_tokens equals transformers' `generate(do_sample=False, repetition_penalty=...,
min_new_tokens=...)` token for token (transformers, like vLLM, penalises the prompt's tokens and
the reply's); min_tokens outlasts a stop token the model emits early; seeded min_p sampling
repeats itself and never draws a token below its threshold (read from the logprobs, which stay
the model's own)."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_llama import EOS_ID, random_prompts

from radixkv import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlapped"])
def llm(model_dir, request):
    return LLM(model_dir, block_size=4, num_blocks=256, async_scheduling=request.param)


def tokens(outs):
    return [list(o.token_ids) for o in outs]


def test_seeded_request_is_reproducible_alone_or_batched(llm):
    prompts = random_prompts(31, 3, max_len=20)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    (alone,) = llm.generate([prompts[0]], seeded)
    again = llm.generate(prompts, [seeded, SamplingParams(max_tokens=5), seeded])
    assert list(again[0].token_ids) == list(alone.token_ids)
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    (different,) = llm.generate([prompts[0]], other_seed)
    assert list(different.token_ids) != list(alone.token_ids)


def test_seeds_that_differ_in_any_bit_give_different_streams(llm):
    # torch's CPU generator keeps the low 32 bits of its seed: unmixed, 0, 2**32 and 2**63
    # gave one stream (issue 20, F10).
    prompt = random_prompts(33, 1, max_len=12)[0]
    seeds = [0, 1, 2**32, 2**63, 2**63 + 2**32, 2**64 - 1]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in seeds
    ]
    streams = [tuple(o.token_ids) for o in llm.generate([prompt] * len(seeds), params)]
    assert len(set(streams)) == len(seeds), streams
    assert tuple(llm.generate([prompt], params[3])[0].token_ids) == streams[3]


def test_unseeded_sampling_is_deterministic_per_engine_seed(model_dir):
    prompts = random_prompts(32, 3, max_len=20)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, ignore_eos=True)
    runs = [
        tokens(LLM(model_dir, block_size=4, num_blocks=128, seed=s).generate(prompts, params))
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # Requests of one call get different streams even with identical prompts.
    same = LLM(model_dir, block_size=4, num_blocks=128).generate([prompts[0]] * 2, params)
    assert same[0].token_ids != same[1].token_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=10, temperature=1.5, top_k=1),
        SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-9),
        SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-50),
        SamplingParams(max_tokens=10, temperature=1e-50),
    ],
    ids=["top_k=1", "tiny top_p", "top_p=1e-50", "temperature=1e-50"],
)
def test_degenerate_sampling_equals_greedy(llm, params):
    prompts = random_prompts(33, 4, max_len=20)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10))
    assert tokens(llm.generate(prompts, params)) == tokens(greedy)


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(34, 1, max_len=20)[0]
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    (stopped,) = llm.generate(
        [prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is included


# ---------------------------------------------------------------------- vLLM's extensions

EXT_PROMPTS = random_prompts(23, 4, min_len=4, max_len=20)
N = 12


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()


def hf_greedy(model, prompt: list[int], **kwargs) -> list[int]:
    kwargs = {"max_new_tokens": N, "eos_token_id": EOS_ID} | kwargs
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(prompt) :].tolist()


def stepped(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens, through the step API with the engine's integrity checked after
    every step."""
    ids = [llm.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while llm.has_unfinished_requests():
        for u in llm.step():
            if u.output is not None:
                done[u.request_id] = list(u.output.token_ids)
        llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    return [done[rid] for rid in ids]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_repetition_penalty_equals_transformers(llm, hf_model, penalty) -> None:
    params = SamplingParams(max_tokens=N, repetition_penalty=penalty)
    got = stepped(llm, EXT_PROMPTS, params)
    want = [hf_greedy(hf_model, p, repetition_penalty=penalty) for p in EXT_PROMPTS]
    assert got == want
    plain = [hf_greedy(hf_model, p) for p in EXT_PROMPTS]
    assert got != plain  # the penalty changed some reply: the test can fail


def test_min_tokens_outlasts_a_stop_token_the_model_emits_early(llm, hf_model) -> None:
    prompt = EXT_PROMPTS[1]
    (plain,) = stepped(llm, [prompt], SamplingParams(max_tokens=N, ignore_eos=True))
    stop = next(t for i, t in enumerate(plain) if i > 0 and t not in plain[:i])
    early = plain.index(stop) + 1  # the reply's length when that token stops it
    stops = SamplingParams(max_tokens=N, stop_token_ids=[stop])
    assert stepped(llm, [prompt], stops) == [plain[:early]]
    held = SamplingParams(max_tokens=N, stop_token_ids=[stop], min_tokens=early + 3)
    (got,) = stepped(llm, [prompt], held)
    assert len(got) >= early + 3 and stop not in got[: early + 2]
    eos = [EOS_ID, stop]
    assert got == hf_greedy(hf_model, prompt, min_new_tokens=early + 3, eos_token_id=eos)


@pytest.mark.parametrize("min_tokens", [1, 5])
def test_min_tokens_holds_back_stop_tokens_exactly_that_long(llm, hf_model, min_tokens) -> None:
    """With most of the vocabulary as stop tokens, the model takes one as soon as it may:
    the reply is min_tokens tokens, then a stop token."""
    stops = range(3, 256)  # all but ids 0 and 1, and EOS (2)
    params = SamplingParams(max_tokens=N, stop_token_ids=stops, min_tokens=min_tokens)
    got = stepped(llm, EXT_PROMPTS, params)
    for prompt, reply in zip(EXT_PROMPTS, got, strict=True):
        assert len(reply) == min_tokens + 1 and reply[-1] in stops, reply
        assert not set(reply[:-1]) & set(stops)
        hf = hf_greedy(hf_model, prompt, min_new_tokens=min_tokens, eos_token_id=[2, *stops])
        assert reply == hf


def test_min_tokens_and_repetition_penalty_together_equal_transformers(llm, hf_model) -> None:
    params = SamplingParams(max_tokens=N, repetition_penalty=1.3, min_tokens=N - 2)
    got = stepped(llm, EXT_PROMPTS, params)
    kwargs = dict(repetition_penalty=1.3, min_new_tokens=N - 2)
    assert got == [hf_greedy(hf_model, p, **kwargs) for p in EXT_PROMPTS]
    assert all(len(g) >= N - 2 for g in got)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_seeded_min_p_repeats_and_never_draws_below_its_threshold(llm, temperature) -> None:
    """The logprobs are the model's (temperature 1): a token t was allowed iff (lp(t) -
    lp(top)) / temperature >= log(min_p)."""
    min_p = 0.3
    params = [
        SamplingParams(
            max_tokens=N, temperature=temperature, min_p=min_p, seed=s, logprobs=1, ignore_eos=True
        )
        for s in range(4)
    ]
    outs = llm.generate(EXT_PROMPTS, params)
    floor = math.log(min_p) * temperature
    for out in outs:
        assert out.logprobs is not None
        for lp in out.logprobs:
            assert lp.logprob - lp.top[0][1] >= floor - 1e-4, (out.request_id, lp)
    again = llm.generate(EXT_PROMPTS[2:3], params[2])[0]  # alone, not batched
    assert again.token_ids == outs[2].token_ids
    free = [
        SamplingParams(max_tokens=N, temperature=temperature, seed=s, logprobs=1, ignore_eos=True)
        for s in range(4)
    ]
    below = [
        lp for out in llm.generate(EXT_PROMPTS, free) for lp in out.logprobs or ()
        if lp.logprob - lp.top[0][1] < floor
    ]  # fmt: skip
    assert below, "without min_p the same draws take tokens it removes: the test can fail"
