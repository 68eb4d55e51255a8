"""vLLM's sampling extensions (top_k, min_p, repetition_penalty, min_tokens) sent as the real
`openai` client's `extra_body` to both completion routes: each means what it means in the
engine (the same request run alone gives the same reply), null is the default, vLLM's top_k -1
is off, and a bad value is a 400 naming its field."""

from __future__ import annotations

import pytest
from serve_helpers import render_chat, user_message

from radixkv.engine.sampling_params import SamplingParams

openai = pytest.importorskip("openai")  # a test extra: absent on the GPU machine

MESSAGES = [{"role": "user", "content": user_message(61)}]
N = 10


def chat(client, extra: dict, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": N} | kwargs
    body = {"ignore_eos": True} | extra
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, extra_body=body, **kwargs
    )


def completion(client, prompt: list[int], extra: dict, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": N} | kwargs
    return client.completions.create(model="tiny", prompt=prompt, extra_body=extra, **kwargs)


def alone(reference_llm, **params):
    prompt = render_chat(reference_llm.tokenizer, MESSAGES)
    params = {"max_tokens": N, "ignore_eos": True} | params
    (out,) = reference_llm.generate([prompt], SamplingParams(**params))
    return out


def test_repetition_penalty_equals_the_engines_on_both_routes(server, reference_llm) -> None:
    client = server.client()
    plain = chat(client, {}).choices[0].message.content
    penalised = chat(client, {"repetition_penalty": 1.3}).choices[0].message.content
    expected = alone(reference_llm, repetition_penalty=1.3)
    assert penalised == expected.text != plain
    prompt = render_chat(reference_llm.tokenizer, MESSAGES)
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    assert completion(client, prompt, extra).choices[0].text == expected.text
    streamed = completion(client, prompt, extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_min_tokens_outlasts_a_stop_token_and_a_stop_string(server, reference_llm) -> None:
    client = server.client()
    prompt = render_chat(reference_llm.tokenizer, MESSAGES)
    plain = alone(reference_llm)
    stop = plain.token_ids[1]  # the model's second token, as a stop token id
    ended = completion(client, prompt, {"stop_token_ids": [stop]})
    assert ended.usage.completion_tokens == 2 and ended.choices[0].finish_reason == "stop"
    held = completion(client, prompt, {"stop_token_ids": [stop], "min_tokens": 6})
    want = alone(reference_llm, stop_token_ids=[stop], min_tokens=6, ignore_eos=False)
    assert held.choices[0].text == want.text and held.usage.completion_tokens >= 6
    first = plain.text.split()[0]  # a stop string: the text of the first token
    assert chat(client, {}, stop=[first]).choices[0].message.content == ""
    reply = chat(client, {"min_tokens": 3}, stop=[first]).choices[0].message.content
    assert reply.startswith(first) and len(reply) > len(first)


def test_seeded_min_p_and_top_k_equal_the_engines(server, reference_llm) -> None:
    client = server.client()
    sampled = {"temperature": 1.0, "seed": 7}
    for extra in ({"min_p": 0.3}, {"top_k": 5}, {"top_k": 3, "min_p": 0.1}):
        reply = chat(client, extra, **sampled).choices[0].message.content
        assert reply == alone(reference_llm, temperature=1.0, seed=7, **extra).text, extra
    greedy = chat(client, {}).choices[0].message.content
    assert chat(client, {"top_k": 1}, **sampled).choices[0].message.content == greedy
    free = chat(client, {}, **sampled).choices[0].message.content
    for off in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0}):
        assert chat(client, off, **sampled).choices[0].message.content == free, off


def test_null_is_the_default(server) -> None:
    client = server.client()
    nulls = {"top_k": None, "min_p": None, "repetition_penalty": None, "min_tokens": None}
    assert (
        chat(client, nulls).choices[0].message.content
        == chat(client, {}).choices[0].message.content
    )


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": "3"}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": "0.1"}, "min_p"),
        ({"min_p": True}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": [1.1]}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.0}, "min_tokens"),
        ({"min_tokens": N + 1}, "min_tokens"),  # more than max_tokens
    ],
)
def test_bad_values_get_400_naming_the_field(server, kind, fields, param) -> None:
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        if kind == "chat":
            chat(client, fields)
        else:
            completion(client, [12, 13], fields)
    assert info.value.body["param"] == param, info.value.body
    assert param in info.value.body["message"], info.value.body
