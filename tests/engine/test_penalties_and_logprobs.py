"""OpenAI's logit_bias, presence / frequency penalties and logprobs through the engine (issue 20,
F5): neutral values change nothing, a penalty equals the bias it stands for, logprobs are the
plain transformers model's log-softmax; bad values are refused at the door."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.sampling.penalties import RowTokens, adjust_logits

PROMPTS = random_prompts(91, 3, max_len=14)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return str(tiny_model_dir("gqa"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, block_size=4, num_blocks=256)


def token_ids(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def test_neutral_values_leave_greedy_output_and_the_logits_alone(llm) -> None:
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    neutral = SamplingParams(
        max_tokens=10, ignore_eos=True, presence_penalty=0.0, frequency_penalty=0, logit_bias={}
    )
    assert token_ids(llm.generate(PROMPTS, neutral)) == token_ids(llm.generate(PROMPTS, plain))
    logits = torch.randn(2, 7)
    assert adjust_logits(logits, [neutral, plain], [RowTokens([1, 1]), RowTokens([2])]) is logits


def test_adjust_logits_matches_openais_formula() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 9, generator=gen)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.5, logit_bias={4: 3.0}),
        SamplingParams(),
        SamplingParams(frequency_penalty=-2.0, logit_bias={0: -100, 8: 100}),
    ]
    outputs = [[4, 4, 2, 7, 4], [1, 1], [8, 8]]
    got = adjust_logits(logits, params, [RowTokens(out) for out in outputs])
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        bias = dict(p.logit_bias)
        for t in range(9):
            count = out.count(t)
            want = logits[i, t] + bias.get(t, 0.0)
            want -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            assert got[i, t].item() == pytest.approx(want.item(), abs=1e-5), (i, t)
    assert torch.equal(got[1], logits[1])


def test_a_logit_bias_of_100_makes_greedy_pick_that_token(llm) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    assert token_ids(llm.generate(PROMPTS[:1], params)) == [[77] * 6]
    (plain,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    banned = SamplingParams(max_tokens=1, logit_bias={plain.token_ids[0]: -100})
    assert llm.generate(PROMPTS[:1], banned)[0].token_ids != plain.token_ids


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (1.5, 0.0), (-1.0, 0.7)])
def test_penalties_equal_the_bias_they_stand_for(llm, presence, frequency) -> None:
    """A penalised greedy reply, token by token, equals replies of one token each whose
    logit_bias is the penalty the tokens so far earn: two paths of the engine, one answer."""
    prompt, n = PROMPTS[1], 10
    penalised = SamplingParams(
        max_tokens=n, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    )
    (out,) = llm.generate([prompt], penalised)
    reply: list[int] = []
    for _ in range(n):
        bias = {
            t: -(frequency * reply.count(t) + presence) for t in set(reply)
        }  # only tokens already in the reply are penalised
        step = SamplingParams(max_tokens=1, ignore_eos=True, logit_bias=bias)
        (one,) = llm.generate([prompt + reply], step)
        reply.append(one.token_ids[0])
    assert list(out.token_ids) == reply
    plain = SamplingParams(max_tokens=n, ignore_eos=True)
    if frequency >= 1.0:  # a strong penalty changes this reply (it repeats tokens)
        assert list(llm.generate([prompt], plain)[0].token_ids) != reply


def test_logprobs_are_the_models_log_softmax(llm, model_dir) -> None:
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.9, seed=4)
    (out,) = llm.generate(PROMPTS[:1], params)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    sequence = list(PROMPTS[0]) + list(out.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0]
    expected = torch.log_softmax(logits[len(PROMPTS[0]) - 1 : -1].float(), dim=-1)
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(expected[i, lp.token_id].item(), abs=1e-4)
        values, ids = expected[i].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
    none = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0]
    assert none.logprobs is None
    zero = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logprobs=0))[0]
    assert zero.logprobs is not None and all(lp.top == () for lp in zero.logprobs)


def test_stream_deltas_carry_their_tokens_logprobs(llm) -> None:
    """Each delta's logprobs are its own tokens', in order: together they are the output's."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, temperature=0.9, seed=4)
    deltas = list(llm.stream(PROMPTS[1], params))
    out = deltas[-1].output
    assert out is not None and out.logprobs is not None
    for d in deltas:
        assert [lp.token_id for lp in d.logprobs] == list(d.token_ids)
    assert tuple(lp for d in deltas for lp in d.logprobs) == out.logprobs
    plain = list(llm.stream(PROMPTS[1], SamplingParams(max_tokens=3)))
    assert all(d.logprobs == () for d in plain)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(presence_penalty=2.5), ValueError, "presence_penalty"),
        (dict(frequency_penalty="1"), TypeError, "frequency_penalty"),
        (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
        (dict(logit_bias={3: 101}), ValueError, r"logit_bias\[3\]"),
        (dict(logit_bias={3: True}), TypeError, r"logit_bias\[3\]"),
        (dict(logit_bias={"3": 1}), TypeError, "logit_bias"),
        (dict(logit_bias=[3]), TypeError, "logit_bias"),
        (dict(logprobs=21), ValueError, "logprobs"),
        (dict(logprobs=-1), ValueError, "logprobs"),
    ],
)
def test_bad_values_are_refused_on_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_a_bias_for_a_token_outside_the_vocabulary_is_refused_at_the_door(llm) -> None:
    bad = SamplingParams(logit_bias={llm.vocab_size: 1.0})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.add_request(PROMPTS[0], bad)
    assert not llm.has_unfinished_requests()
    llm.check_integrity()
