"""OpenAI's logprobs, penalties and logit_bias through a live server, read by the real `openai`
client; 400 naming the field for what the server does not do (issue 20, F5)."""

from __future__ import annotations

import pytest
from serve_helpers import render_chat, user_message

from radixkv.engine.sampling_params import SamplingParams

openai = pytest.importorskip("openai")  # a test extra: absent on the GPU machine

MESSAGES = [{"role": "user", "content": user_message(60)}]
N = 8


def chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": N, "extra_body": {"ignore_eos": True}} | kwargs
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)


def alone(reference_llm, **params):
    prompt = render_chat(reference_llm.tokenizer, MESSAGES)
    (out,) = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=N, ignore_eos=True, **params)
    )
    return out


def test_chat_logprobs_in_openais_shape_equal_the_engines(server, reference_llm) -> None:
    reply = chat(server.client(), logprobs=True, top_logprobs=2)
    expected = alone(reference_llm, logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == N == reply.usage.completion_tokens
    decode = reference_llm.tokenizer.decode
    for entry, lp in zip(content, expected.logprobs, strict=True):
        assert entry.token == decode([lp.token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [
            decode([t], skip_special_tokens=False) for t, _ in lp.top
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in lp.top], abs=1e-4
        )
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best
    assert reply.choices[0].message.content == expected.text

    streamed = [c for c in chat(server.client(), logprobs=True, top_logprobs=2, stream=True)]
    entries = [
        e
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in entries] == [e.token for e in content]
    # approx: the second run reads the prompt's KV from the cache, a float sum in another order
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert chat(server.client()).choices[0].logprobs is None  # none asked, none sent


def test_completion_logprobs_in_the_legacy_shape(server, reference_llm) -> None:
    client = server.client()
    prompt = render_chat(reference_llm.tokenizer, MESSAGES)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=N, temperature=0, logprobs=3)
    reply = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    expected = alone(reference_llm, logprobs=3).logprobs
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == N
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    stream = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [v for lp in chunks for v in lp.token_logprobs] == logprobs.token_logprobs
    assert [o for lp in chunks for o in lp.text_offset] == logprobs.text_offset


def test_penalties_and_logit_bias_equal_the_engines(server, reference_llm) -> None:
    client = server.client()
    plain = chat(client).choices[0].message.content
    neutral = chat(client, presence_penalty=0, frequency_penalty=0.0, logit_bias={})
    assert neutral.choices[0].message.content == plain  # greedy, unchanged
    penalised = chat(client, frequency_penalty=1.5, presence_penalty=0.5)
    expected = alone(reference_llm, frequency_penalty=1.5, presence_penalty=0.5)
    assert penalised.choices[0].message.content == expected.text
    biased = chat(client, logit_bias={"77": 100})
    assert biased.choices[0].message.content == alone(reference_llm, logit_bias={77: 100}).text
    assert biased.choices[0].message.content != plain


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("completion", {"echo": True}, "echo"),
        ("completion", {"best_of": 2}, "best_of"),
        ("completion", {"suffix": "the end"}, "suffix"),
        ("chat", {"frequency_penalty": "x"}, "frequency_penalty"),
        ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
        ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": True}}, "logit_bias"),
        ("chat", {"logit_bias": {"1000000": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ("chat", {"logit_bias": [5]}, "logit_bias"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"logprobs": 1}, "logprobs"),
        ("completion", {"logprobs": 6}, "logprobs"),
        ("completion", {"logprobs": True}, "logprobs"),
    ],
)
def test_unsupported_and_bad_fields_get_400_naming_them(server, kind, fields, param) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            chat(client, extra_body=fields)
        else:
            client.completions.create(model="tiny", prompt="w12", max_tokens=2, extra_body=fields)
    assert info.value.body["param"].startswith(param), info.value.body
    assert param in info.value.body["message"] or "Invalid type" in info.value.body["message"]


def test_what_is_neutral_is_accepted(server) -> None:
    client = server.client(max_retries=0)
    reply = chat(client, response_format={"type": "text"}, tool_choice="none")
    assert reply.choices[0].message.content
    done = client.completions.create(
        model="tiny", prompt="w12", max_tokens=2, echo=False, best_of=1, suffix=""
    )
    assert done.choices[0].finish_reason in ("stop", "length")
